"""Context parallelism over real gloo processes (1..4 ranks) against the single-device recurrence.

One launch per world size; each runs every case inside (a spawn costs seconds on a 2-core machine).
"""

import pytest
import torch

from collectives import launch
from cp_kda import context_parallel_kda, context_parallel_short_conv, kda_recurrent, short_conv
from tests.cp_kda.helpers import loss_grads, make_inputs, max_abs, rel_rms

pytestmark = pytest.mark.spawns  # every test here starts processes: make test-fast leaves them out

T = 48
H, K, V = 2, 6, 5
CASES = [  # (name, B, cu_seqlens) over T = 48 global tokens
    ("dense", 2, None),
    ("edges-and-short", 1, [0, 5, 12, 13, 24, 40, 48]),
    ("one-long", 1, [0, 7, 48]),
    ("rank-aligned", 1, [0, 12, 24, 36, 48]),
    ("late-cut", 1, [0, 47, 48]),
]


def _kda_case(comm, B, cu, strategy, dtype=torch.float64):
    """Max error of (o, final state, grads of q, k, v, g, beta) on this rank, and the reported payload."""
    xs = make_inputs(B, T, H, K, V, dtype=dtype, seed=B + len(cu or []), with_state=False)[:5]
    cut = None if cu is None else torch.tensor(cu)
    o, ht = kda_recurrent(*xs, output_final_state=True, cu_seqlens=cut)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=ht.dtype)
    ref = loss_grads((o, ht), (do, dht), xs)
    n = T // comm.world_size
    rows = slice(comm.rank * n, (comm.rank + 1) * n)
    local = [x.detach()[:, rows].clone().requires_grad_() for x in xs]
    stats = {}
    o_cp, ht_cp = context_parallel_kda(
        *local, comm, strategy=strategy, cu_seqlens=cut, chunk_size=8, output_final_state=True, stats=stats
    )
    # every rank holds the replicated final state: give each 1/W of its cotangent so the sum is dht
    grads = loss_grads((o_cp, ht_cp), (do[:, rows], dht / comm.world_size), local)
    metric = max_abs if dtype == torch.float64 else rel_rms
    pairs = [(o[:, rows], o_cp), (ht, ht_cp)] + [(a[:, rows], b) for a, b in zip(ref, grads)]
    return max(metric(a, b) for a, b in pairs), stats["bytes_per_rank"]


def _conv_case(comm, cu):
    """Max error of the CP short conv (halo from the previous rank) and its input/weight grads."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, T, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    cut = None if cu is None else torch.tensor(cu)
    y, _ = short_conv(x, w, cu_seqlens=cut)
    dy = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    gx, gw = torch.autograd.grad((y * dy).sum(), [x, w])
    n = T // comm.world_size
    rows = slice(comm.rank * n, (comm.rank + 1) * n)
    xl = x.detach()[:, rows].clone().requires_grad_()
    wl = w.detach().clone().requires_grad_()
    yl = context_parallel_short_conv(xl, wl, comm, cu_seqlens=cut)
    gxl, gwl = torch.autograd.grad((yl * dy[:, rows]).sum(), [xl, wl])
    comm.all_reduce(gwl)  # replicated parameter: its gradient is the sum over CP ranks
    return max(max_abs(y[:, rows], yl), max_abs(gx[:, rows], gxl), max_abs(gw, gwl))


def cp_worker(comm):
    """All checks of one world size; returns {check name: max error over ranks} (rank 0's copy)."""
    results = {}
    for name, B, cu in CASES:
        for strategy in ("scan", "ring"):
            err, nbytes = _kda_case(comm, B, cu, strategy)
            results[f"kda/{strategy}/{name}"] = err
            expected = 8 * B * H * K * (K + V) if strategy == "scan" else 8 * B * H * K * V
            results[f"bytes/{strategy}/{name}"] = float(nbytes != (expected if cu is None else expected // B))
    err, nbytes = _kda_case(comm, 1, [0, 30, 48], "scan", dtype=torch.float32)
    results["kda/scan/fp32-rel-rms"] = err
    results["bytes/scan/fp32"] = float(nbytes != 4 * H * K * (K + V))  # fp32 M and B, independent of T
    for cu in (None, [0, 11, 13, 14, 40, 48]):
        results[f"conv/{cu}"] = _conv_case(comm, cu)
    names = sorted(results)
    errs = torch.tensor([results[n] for n in names], dtype=torch.float64)
    comm.all_reduce(errs, op="max")
    return dict(zip(names, errs.tolist()))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_context_parallel_matches_single_device(world_size):
    """fp64 max abs 1e-10 (fp32: relative RMS 1e-5) for scan and ring, dense and packed, forward and backward;
    a wrong fold order, a halo from the wrong rank or a lost final-state gradient shows up as O(1) errors."""
    results = launch(cp_worker, world_size=world_size, timeout=120)
    bad = {k: v for k, v in results.items() if (v > 1e-5 if "fp32" in k and k.startswith("kda") else v > 1e-10)}
    assert not bad, bad
