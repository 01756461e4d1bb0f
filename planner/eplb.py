"""``rebalance_experts``: a static expert placement with the semantics of DeepSeek's EPLB.

Same signature, return values and tie-breaks as ``eplb.rebalance_experts`` (deepseek-ai/EPLB): redundant
replicas go to the experts with the highest load per replica, then replicas are packed onto GPUs by greedy
longest-processing-time packing with an exact item count per pack. Hierarchical (groups -> nodes, then
replicas -> GPUs inside each node) when ``num_groups % num_nodes == 0``, global otherwise. Arithmetic is in
float32, as in EPLB, so ties resolve the same way. Written from the algorithm's description.

Use it for inference placement, and as the static baseline that ``moonep bench planner`` compares ``plan`` with.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._inputs import positive_int, to_numpy


def _balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """weight [L, n] -> (pack [L, n], rank_in_pack [L, n]); every pack gets exactly n / num_packs items.

    Items in descending weight order each go to the lightest pack that still has room (lowest index on ties).
    """
    L, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:  # one item per pack: identity, as EPLB does
        return np.tile(np.arange(n), (L, 1)), np.zeros((L, n), np.int64)
    pack = np.full((L, n), -1, np.int64)
    rank = np.full((L, n), -1, np.int64)
    for layer in range(L):
        loads = np.zeros(num_packs, np.float32)
        items = np.zeros(num_packs, np.int64)
        for item in np.argsort(-weight[layer], kind="stable"):
            p = int(np.argmin(np.where(items < per_pack, loads, np.inf)))
            pack[layer, item] = p
            rank[layer, item] = items[p]
            loads[p] += weight[layer, item]
            items[p] += 1
    return pack, rank


def _replicate(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [L, n_log] -> (phy2log [L, num_phy], replica rank [L, num_phy], logcnt [L, n_log]).

    Each extra replica goes to the expert with the largest load per replica (first index on ties).
    """
    L, n_log = weight.shape
    phy2log = np.tile(np.arange(num_phy), (L, 1))
    rank = np.zeros((L, num_phy), np.int64)
    logcnt = np.ones((L, n_log), np.int64)
    layers = np.arange(L)
    for i in range(n_log, num_phy):
        best = np.argmax(weight / logcnt.astype(np.float32), axis=1)
        phy2log[:, i] = best
        rank[:, i] = logcnt[layers, best]
        logcnt[layers, best] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse permutation of perm [L, n]."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def _hierarchical(weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int):
    """Groups packed onto nodes, replicas made inside each node, replicas packed onto the node's GPUs."""
    L, n_log = weight.shape
    group_size = n_log // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_phy // num_gpus
    group_load = weight.reshape(L, num_groups, group_size).sum(-1)
    gpack, grank = _balanced_packing(group_load, num_nodes)
    # mlog: logical ids relabelled node-major, so node k holds mlog [k*n_log/nodes, (k+1)*n_log/nodes)
    log2mlog = (((gpack * groups_per_node + grank) * group_size)[:, :, None] + np.arange(group_size)).reshape(L, -1)
    mlog2log = _inverse(log2mlog)
    mlog_load = np.take_along_axis(weight, mlog2log, axis=1).reshape(L * num_nodes, -1)
    phy2mlog, phyrank, mlogcnt = _replicate(mlog_load, num_phy // num_nodes)
    phy_load = np.take_along_axis(mlog_load / mlogcnt.astype(np.float32), phy2mlog, axis=1)
    pack, rank_in_pack = _balanced_packing(phy_load, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * per_gpu + rank_in_pack)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(L, num_nodes, -1)
    pphy2mlog = (pphy2mlog + np.arange(0, n_log, n_log // num_nodes)[None, :, None]).reshape(L, -1)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    phyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(L, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, -1), log2mlog, axis=1)
    return phy2log, phyrank, logcnt


def rebalance_experts(weight: Any, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """EPLB placement of ``num_replicas`` physical experts.

    weight: [L, E] load per layer and logical expert (numpy or torch; float or int, non-negative).
    num_replicas: physical expert slots, a multiple of num_gpus and >= E; num_groups divides E; num_nodes
    divides num_gpus. Returns (phy2log [L, num_replicas]: logical expert of each physical slot, GPU-major,
    GPU g owns slots [g*S, (g+1)*S); log2phy [L, E, max replicas]: physical slots of each expert, -1 padded;
    logcnt [L, E]: replicas per expert). Torch in -> torch (int64, CPU) out; numpy otherwise.
    """
    w = to_numpy(weight)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [layers, experts], got shape {tuple(w.shape)}")
    if w.dtype == np.bool_ or not np.issubdtype(w.dtype, np.number):
        raise ValueError(f"weight must be numeric, got dtype {w.dtype}")
    w = w.astype(np.float32)
    if w.size and (not np.all(np.isfinite(w)) or w.min() < 0):
        raise ValueError("weight must be finite and non-negative")
    L, n_log = w.shape
    num_replicas, num_groups, num_nodes, num_gpus = (
        positive_int(v, name)
        for v, name in (
            (num_replicas, "num_replicas"),
            (num_groups, "num_groups"),
            (num_nodes, "num_nodes"),
            (num_gpus, "num_gpus"),
        )
    )
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} must be a multiple of num_gpus={num_gpus}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} must be a multiple of num_nodes={num_nodes}")
    if n_log % num_groups:
        raise ValueError(f"number of experts {n_log} must be a multiple of num_groups={num_groups}")
    if num_replicas < n_log:
        raise ValueError(f"num_replicas={num_replicas} must be >= the number of experts {n_log}")
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:  # global policy: one group on one node
        phy2log, phyrank, logcnt = _hierarchical(w, num_replicas, 1, 1, num_gpus)
    max_cnt = int(logcnt.max())
    log2phy = np.full((L, n_log * max_cnt), -1, np.int64)
    np.put_along_axis(
        log2phy, phy2log * max_cnt + phyrank, np.broadcast_to(np.arange(num_replicas), phy2log.shape), axis=1
    )
    out = (phy2log.astype(np.int64), log2phy.reshape(L, n_log, max_cnt), logcnt.astype(np.int64))
    if not isinstance(weight, np.ndarray) and hasattr(weight, "detach"):
        import torch  # heavy: torch, only for tensor input (already loaded by the caller)

        return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in out)
    return out


def gpu_loads(weight: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray, num_gpus: int) -> np.ndarray:
    """[L, num_gpus] load per GPU when each expert's load splits evenly over its replicas."""
    w = np.asarray(weight, dtype=np.float64)
    per_slot = np.take_along_axis(w / logcnt, phy2log, axis=1)
    return per_slot.reshape(w.shape[0], num_gpus, -1).sum(-1)
