"""``rebalance_experts``: a static expert placement with the semantics of DeepSeek's EPLB.

Same signature and return values as ``eplb.rebalance_experts`` (deepseek-ai/EPLB): redundant replicas go to the
experts with the highest load per replica, then replicas are packed onto GPUs by greedy longest-processing-time
packing with an exact item count per pack. Hierarchical (groups -> nodes, then replicas -> GPUs inside each node)
when ``num_groups % num_nodes == 0``, global otherwise. Written from the algorithm's description.

Ties. Outputs equal EPLB's element for element, ties included, when torch is importable: arithmetic is float32 as
in EPLB, group loads are summed by torch (its reduction order), and packing visits items in the order of
``torch.sort(descending=True)``, which EPLB uses and which is *not* stable on CPU (rows longer than 16 put tied
items out of index order; replicas of one expert always tie). Without torch the packing visits tied items in
index order (a stable numpy sort) and group loads are numpy sums: the same balance, but placements among tied
items may differ from EPLB's.

Use it for inference placement, and as the static baseline that ``moonep bench planner`` compares ``plan`` with.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from planner._inputs import is_tensor, positive_int, to_numpy


def _torch():
    """The torch module, or None when it is not installed (then the numpy tie order is used)."""
    try:
        import torch  # optional: torch, only for EPLB's exact tie order (torch.sort) and reduction order
    except ImportError:
        return None
    return torch


def _descending_order(weight: np.ndarray) -> np.ndarray:
    """weight [L, n] float32 -> [L, n] item indices by descending weight, tied items in torch.sort's order."""
    torch = _torch()
    if torch is None:
        return np.argsort(-weight, axis=1, kind="stable")
    return torch.from_numpy(np.ascontiguousarray(weight)).sort(-1, descending=True).indices.numpy()


def _row_sums(weight: np.ndarray) -> np.ndarray:
    """weight [..., n] float32 -> [...] float32 sums, in torch's reduction order when torch is present."""
    torch = _torch()
    if torch is None:
        return weight.sum(-1, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(weight)).sum(-1).numpy()


def _balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """weight [L, n] -> (pack [L, n], rank_in_pack [L, n]); every pack gets exactly n / num_packs items.

    Items in descending weight order (``_descending_order``) each go to the lightest pack that still has room
    (lowest pack index on equal loads).
    """
    L, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:  # one item per pack: identity, as EPLB does
        return np.tile(np.arange(n), (L, 1)), np.zeros((L, n), np.int64)
    pack = np.full((L, n), -1, np.int64)
    rank = np.full((L, n), -1, np.int64)
    order = _descending_order(weight)
    for layer in range(L):
        loads = np.zeros(num_packs, np.float32)
        items = np.zeros(num_packs, np.int64)
        for item in order[layer]:
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
    group_load = _row_sums(weight.reshape(L, num_groups, group_size))
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
    num_replicas: physical expert slots, a multiple of num_gpus and >= E; num_groups divides E (when the
    hierarchical policy applies: num_groups % num_nodes == 0); num_nodes
    divides num_gpus. Returns (phy2log [L, num_replicas]: logical expert of each physical slot, GPU-major,
    GPU g owns slots [g*S, (g+1)*S); log2phy [L, E, max replicas]: physical slots of each expert, -1 padded;
    logcnt [L, E]: replicas per expert). Torch in -> torch (int64, CPU) out; numpy otherwise. Identical to
    ``eplb.rebalance_experts`` including ties when torch is importable (see the module docstring).
    """
    if is_tensor(weight) and weight.is_floating_point():
        weight = weight.detach().float()  # as EPLB's .float(); also reads bf16/fp16, which numpy cannot hold
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
    if num_groups % num_nodes == 0 and n_log % num_groups:  # the global policy ignores groups, as in EPLB
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
