"""Quantile Balancing on the device: the vectorised update equals its per-expert loop twin bit for bit, stays
within a bin of the exact quantile, reads nothing back from the device, and runs on meta tensors.

Also the tests of tests/hostreads.py, the read counter the zero-read checks rely on.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.balance import NUM_BINS, max_violation, qb_bias, qb_histogram, qb_range, update_router_biases
from k3.moe import K3Router
from k3.reference import qb_bias_loop, qb_exact, qb_histogram_host
from moonep.hostreads import READ_METHODS, HostReads

BIASES = st.sampled_from([-1.0, -0.25, 0.0, 1e-3, 0.5, 2.0]) | st.floats(-3, 3, width=32)  # ties, and any value
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.bfloat16])


def _row(draw, kind: str, m: int, nb: int, target: int) -> list[int]:
    """One expert's histogram row [nb] of ``kind``; every kind but "any" sums to m, as real rows do."""
    row = [0] * nb
    if kind == "any":  # unequal row sums: the rank may pass the end
        return draw(st.lists(st.integers(0, 5), min_size=nb, max_size=nb))
    if kind == "one_bin":  # all mass in one bin, the others empty
        row[draw(st.integers(0, nb - 1))] = m
    elif kind == "edge":  # the cumulative count hits the rank exactly at bin i
        i = draw(st.integers(0, nb - 1))
        head = min(target, m)
        first = draw(st.integers(0, head))
        row[draw(st.integers(0, i))] += first
        row[i] += head - first
        row[draw(st.integers(i, nb - 1))] += m - head
    else:  # "split": m cut at random points, many bins empty
        cuts = sorted(draw(st.lists(st.integers(0, m), min_size=nb - 1, max_size=nb - 1)))
        row = [b - a for a, b in zip([0] + cuts, cuts + [m])]
    return row


@st.composite
def qb_cases(draw):
    """(hist [E, nb] int64, bias [E], K) with E = 1, nb = 1, K = 0 and K > E among the draws."""
    E, nb, m = draw(st.integers(1, 9)), draw(st.integers(1, 12)), draw(st.integers(0, 40))
    K = draw(st.integers(0, E + 1))
    kind = draw(st.sampled_from(["split", "one_bin", "edge", "any"]))
    target = -(-m * K // E)
    rows = [_row(draw, kind, m, nb, target) for _ in range(E)]
    if draw(st.booleans()):  # tied experts: identical rows
        rows = [rows[0]] * E
    bias = torch.tensor(draw(st.lists(BIASES, min_size=E, max_size=E)), dtype=draw(DTYPES))
    return torch.tensor(rows, dtype=torch.int64), bias, K


@settings(max_examples=400, deadline=None)
@given(qb_cases())
def test_qb_bias_equals_loop_twin(case):
    """Bitwise, on empty bins, one-bin rows, ranks exactly at a bin edge or past the end, E = 1, nb = 1, ties;
    would catch an off-by-one in searchsorted's side, `before` read at b instead of b - 1, a lost clamp."""
    hist, bias, K = case
    fast, loop = qb_bias(hist, bias, K), qb_bias_loop(hist, bias, K)
    assert fast.dtype == loop.dtype == bias.dtype and fast.shape == (hist.shape[0],)
    assert torch.equal(fast, loop), (fast, loop)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(2, 9).flatmap(lambda E: st.tuples(st.just(E), st.integers(1, E - 1))),
    st.integers(1, 60),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_qb_histogram_equals_host_twin(EK, nb, seed, on_edges):
    """Bitwise, also with tied scores sitting exactly on bin edges; would catch a range or bin-index change."""
    E, K = EK
    g = torch.Generator().manual_seed(seed)
    if on_edges:  # r = alpha - s in quarters with a quarter-valued bias: bin edges of nb = 2, 4, 8, ...
        scores = torch.randint(1, 4, (50, E), generator=g) / 4.0
        bias = torch.randint(-2, 3, (E,), generator=g) / 4.0
    else:
        scores = torch.sigmoid(torch.randn(50, E, generator=g) * 2)
        bias = torch.randn(E, generator=g) * 0.2
    hist = qb_histogram(scores, bias, K, nb)
    assert hist.dtype == torch.int64 and torch.equal(hist, qb_histogram_host(scores, bias, K, nb))
    assert torch.equal(hist.sum(-1), torch.full((E,), 50))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 12).flatmap(lambda E: st.tuples(st.just(E), st.integers(1, E - 1))),
    st.sampled_from([4, 16, 100, NUM_BINS]),
    st.integers(0, 2**31 - 1),
)
def test_qb_bias_within_a_bin_of_exact(EK, nb, seed):
    """Each b_hat is interpolated inside the bin holding the exact quantile, so it is off by less than a bin
    width w, and after centring by less than 2w (tests/k3/test_components.py checks 1000 bins at 3w)."""
    E, K = EK
    g = torch.Generator().manual_seed(seed)
    scores = torch.sigmoid(torch.randn(300, E, generator=g) + torch.linspace(-1, 1, E))  # skewed experts
    bias = torch.randn(E, generator=g) * 0.1
    lo, hi = qb_range(bias)
    width = float((hi - lo) / nb)
    est = qb_bias(qb_histogram(scores, bias, K, nb), bias, K)
    assert float((est - qb_exact(scores, bias, K)).abs().max()) < 2 * width + 1e-6


def _routers(Lm: int, E: int, K: int, m: int, seed: int = 0) -> list[SimpleNamespace]:
    """Lm real K3Routers after one forward of m tokens (outside any read counter), as ``moe.gate``."""
    torch.manual_seed(seed)
    moes = []
    for _ in range(Lm):
        gate = K3Router(16, E, K, 1.0)
        torch.nn.init.normal_(gate.weight, std=0.5)
        gate.e_score_correction_bias.normal_(std=0.1)
        gate(torch.randn(m, 16))
        moes.append(SimpleNamespace(gate=gate))
    return moes


def test_qb_path_reads_nothing_back():
    """Zero host reads for the histogram, the bias update and update_router_biases (comm=None); the same
    counter sees the loop twins' reads, so a regression to them would be caught."""
    torch.manual_seed(0)
    scores, bias = torch.sigmoid(torch.randn(200, 8)), torch.randn(8) * 0.1
    with HostReads() as reads:
        qb_bias(qb_histogram(scores, bias, 2), bias, 2)
    assert reads.count == 0, reads.report()
    with HostReads() as twin:
        qb_bias_loop(qb_histogram_host(scores, bias, 2, NUM_BINS), bias, 2)
    names = {name for name, _ in twin.where}
    assert {"Tensor.__float__", "Tensor.__int__", "aten.bincount"} <= names, twin.report()
    for method in ("qb", "sign", "none"):
        moes = _routers(3, 8, 2, 64)
        with HostReads() as reads:
            viol = update_router_biases(moes, None, method)
        assert reads.count == 0, f"{method}: {reads.report()}"
        assert isinstance(viol, torch.Tensor) and viol.shape == (3,) and viol.dtype == torch.float64


def test_update_router_biases_matches_the_loop_twin():
    """Per layer, the new bias equals the host twins' on the same scores; the metric equals max_violation."""
    moes = _routers(3, 8, 2, 64)
    before = [moe.gate.e_score_correction_bias.clone() for moe in moes]
    expect = [
        qb_bias_loop(qb_histogram_host(moe.gate.last_scores, b, 2, NUM_BINS), b, 2) for moe, b in zip(moes, before)
    ]
    viol = update_router_biases(moes, None, "qb")
    for moe, want in zip(moes, expect):
        assert torch.equal(moe.gate.e_score_correction_bias, want)
    assert torch.equal(viol, max_violation(torch.stack([moe.gate.last_counts for moe in moes])))
    with pytest.raises(ValueError, match="expected 'qb'"):
        update_router_biases(moes, None, "median")


def test_qb_runs_on_meta_tensors():
    """Meta tensors have no data, so any host read raises: the whole path must be shape-only."""
    E, K, nb = 8, 2, 32
    scores = torch.empty(100, E, device="meta")
    bias = torch.empty(E, device="meta")
    hist = qb_histogram(scores, bias, K, nb)
    assert hist.is_meta and hist.shape == (E, nb) and hist.dtype == torch.int64
    out = qb_bias(torch.empty(E, nb, dtype=torch.int64, device="meta"), bias, K)
    assert out.is_meta and out.shape == (E,) and out.dtype == bias.dtype
    gates = [K3Router(16, E, K, 1.0, device="meta") for _ in range(2)]
    for gate in gates:
        gate.last_scores = torch.empty(100, E, device="meta")
        gate.last_counts = torch.empty(E, dtype=torch.int64, device="meta")
    viol = update_router_biases([SimpleNamespace(gate=g) for g in gates], None, "qb")
    assert viol.is_meta and viol.shape == (2,)


# --- tests/hostreads.py ---


def test_hostreads_counts_each_kind_of_read_on_cpu():
    """Each read once, named, with this file in its stack; plain arithmetic and searchsorted count nothing."""
    t, mask = torch.arange(4.0), torch.tensor([True, False, True, False])
    reads_of = {  # lambdas: a method bound before the context opens is the unpatched one
        "Tensor.item": lambda: t[1].item(),
        "Tensor.tolist": lambda: t.tolist(),
        "Tensor.numpy": lambda: t.numpy(),
        "Tensor.cpu": lambda: t.cpu(),
        "Tensor.__bool__": lambda: bool(t[1]),
        "Tensor.__int__": lambda: int(t[1]),
        "Tensor.__float__": lambda: float(t[1]),
        "Tensor.__index__": lambda: [0, 1][t[1].long()],
        "Tensor.__format__": lambda: f"{t[1]:.2f}",
        "Tensor.__repr__": lambda: repr(t),
        "aten.nonzero": lambda: t.nonzero(),
        "aten.index(bool mask)": lambda: t[mask],
        "aten.equal": lambda: torch.equal(t, t),
        "aten._local_scalar_dense": lambda: torch.ops.aten._local_scalar_dense(t[1]),
        "aten.bincount": lambda: torch.bincount(t.long()),
    }
    for name, read in reads_of.items():
        with HostReads() as reads:
            read()
        assert [n for n, _ in reads.where] == [name], (name, reads.report())  # once: lowering not recounted
        assert "test_balance_device.py" in reads.where[0][1]
    with HostReads() as reads:
        (t * 2 + 1).sum().sqrt()
        torch.searchsorted(t, t[1:2])
    assert reads.count == 0, reads.report()


def test_hostreads_skips_meta_nests_and_restores():
    """Meta reads raise and are not counted; nested and re-entered contexts count once each; another thread's
    reads are not this context's; the original Tensor methods are back after an exception and on exit."""
    originals = {name: torch.Tensor.__dict__.get(name) for name in READ_METHODS}
    meta = torch.empty(3, device="meta")
    with HostReads() as outer:
        for read in (lambda: meta[0].item(), lambda: meta.tolist(), lambda: float(meta[0]), lambda: bool(meta[0])):
            with pytest.raises((RuntimeError, NotImplementedError)):
                read()
        repr(meta)  # works, but reads no data
        assert outer.count == 0, outer.report()
        with pytest.raises(ZeroDivisionError), HostReads() as inner, inner:  # nested, and the same one twice
            float(torch.ones(()))
            raise ZeroDivisionError("an exception inside the nested contexts")
        assert inner.count == 1 and outer.count == 1
        assert torch.Tensor.item is not originals["item"]  # the outer context still counts
        other = threading.Thread(target=lambda: torch.ones(()).item())  # another thread: not this context's
        other.start()
        other.join()
        float(torch.ones(()))
    assert outer.count == 2 and [n for n, _ in outer.where] == ["Tensor.__float__"] * 2
    assert {name: torch.Tensor.__dict__.get(name) for name in READ_METHODS} == originals
    with HostReads(ignore=("Tensor.item",)) as reads:
        torch.ones(()).item()
    assert reads.count == 0
