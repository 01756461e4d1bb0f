"""``moonep.grouped_experts``, the one expert step (moonep.MoE, k3.LatentMoE): both weight layouts and both gated
activations (SwiGLU's closed-form derivative, SiTU-GLU through autograd) against a dense loop-over-experts twin on
two real gloo ranks, with skewed routing (replicas in the shared pools) and two layers sharing those pools."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moonep
from collectives import launch
from k3.layers import situ_glu
from moonep.expert_math import SWIGLU, GatedActivation, check_weights
from tests.distributed import run_checks

H, F, EPN, S, K = 6, 5, 2, 7, 2
SITU = functools.partial(situ_glu, beta=2.0, linear_beta=3.0)  # small betas: the tanh bends are exercised


def _weights(layout: str, E: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(E, H, 2 * F), (E, F, H)] if layout == "fused" else [(E, F, H), (E, F, H), (E, H, F)]
    return [torch.randn(*s, generator=g) for s in shapes]


def _expert(layout: str, act, ws, e: int, x: torch.Tensor) -> torch.Tensor:
    """The dense twin of one expert on rows x [m, H]."""
    if layout == "fused":
        pre = x @ ws[0][e]
        return act(pre[:, :F], pre[:, F:]) @ ws[1][e]
    return act(x @ ws[0][e].t(), x @ ws[1][e].t()) @ ws[2][e].t()


def _dense(layout, act, layers, x, idx, w) -> torch.Tensor:
    for ws in layers:
        out = torch.zeros_like(x)
        for e in range(ws[0].shape[0]):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            out = out.index_add(0, tok, _expert(layout, act, ws, e, x[tok]) * w[tok, slot][:, None])
        x = out
    return x


def _inputs(R: int, E: int):
    """Every rank's (x, topk_w, topk_idx), skewed to expert 0 so that the plan makes replicas."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(R * S, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(R * S)])
    idx[torch.rand(R * S, generator=g) < 0.7, 0] = 0
    idx[idx[:, 1] == idx[:, 0], 1] = 1 + (idx[idx[:, 1] == idx[:, 0], 0] % (E - 1))
    return x, torch.rand(R * S, K, generator=g) + 0.5, idx


def check_step(comm, layout: str, activation, recompute: bool) -> str | None:
    """Two chained layers on one Buffer: outputs, input / routing-weight grads and own expert grads vs the twin."""
    R, r = comm.world_size, comm.rank
    E = EPN * R
    act = activation or SWIGLU
    buf = moonep.Buffer(comm, S=S, H=H, K=K, E=E)
    full = [_weights(layout, E, 10 + i) for i in range(2)]
    X, W, idx = _inputs(R, E)
    G = torch.randn(R * S, H, generator=torch.Generator().manual_seed(4))
    ref = [[t.clone().requires_grad_() for t in ws] for ws in full]
    Xr, Wr = X.clone().requires_grad_(), W.clone().requires_grad_()
    (_dense(layout, act, ref, Xr, idx, Wr) * G).sum().backward()
    mine = [[t[r * EPN : (r + 1) * EPN].clone().requires_grad_() for t in ws] for ws in full]
    rows = slice(r * S, (r + 1) * S)
    x, w = X[rows].clone().requires_grad_(), W[rows].clone().requires_grad_()
    y, replicas = x, 0
    for ws in mine:
        recv, recv_w, _, plan = moonep.dispatch(buf, y, topk_idx=idx[rows], topk_weights=w)
        z = moonep.grouped_experts(
            buf, plan, recv, recv_w, ws, layout=layout, activation=activation, recompute=recompute
        )
        y, replicas = moonep.combine(buf, plan, z), replicas + plan.global_plan.num_replicas
    (y * G[rows]).sum().backward()
    errs = {"out": (y.detach(), _dense(layout, act, full, X, idx, W)[rows]), "x.grad": (x.grad, Xr.grad[rows])}
    errs["w.grad"] = (w.grad, Wr.grad[rows])
    for i, (m, rf) in enumerate(zip(mine, ref)):
        for j, (a, b) in enumerate(zip(m, rf)):
            errs[f"layer{i}.w{j}.grad"] = (a.grad, b.grad[r * EPN : (r + 1) * EPN])
    bad = {k: float((a - b).abs().max() / b.abs().max()) for k, (a, b) in errs.items()}
    bad = {k: v for k, v in bad.items() if not v <= 1e-5}
    if bad:
        return f"{layout}/{'swiglu' if activation is None else 'situ'}: relative errors above 1e-5: {bad}"
    return None if replicas else "the skewed routing made no replicas: the pools were not exercised"


def _job(comm) -> dict:
    cases = {
        "fused_swiglu": ("fused", None, False),
        "fused_situ_recompute": ("fused", SITU, True),
        "linear_situ": ("linear", SITU, False),
        "linear_swiglu_recompute": ("linear", None, True),
    }
    return run_checks(comm, {k: functools.partial(check_step, comm, *v) for k, v in cases.items()})


@functools.cache
def _results() -> dict:
    return launch(_job, 2, backend="torch", timeout=30, job_timeout=180)


@pytest.mark.spawns
@pytest.mark.parametrize("case", ["fused_swiglu", "fused_situ_recompute", "linear_situ", "linear_swiglu_recompute"])
def test_grouped_experts_equals_dense_twin_on_two_ranks(case):
    assert _results()[case] is None, _results()[case]


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 6),
    f=st.integers(1, 5),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_swiglu_closed_form_grad_equals_autograd(n, f, scale, seed):
    """SWIGLU's explicit derivative vs the autograd path every other activation takes (large gates included)."""
    g = torch.Generator().manual_seed(seed)
    gate, up, dh = (torch.randn(n, f, generator=g, dtype=torch.float64) * scale for _ in range(3))
    got = SWIGLU.value_and_grad(gate, up, dh)
    want = GatedActivation(SWIGLU.fn).value_and_grad(gate, up, dh)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "layout,shapes,match",
    [
        ("sideways", [(2, 6, 10), (2, 5, 6)], "layout must be one of"),
        ("fused", [(2, 6, 10)], "takes 2 weights"),
        ("fused", [(3, 6, 10), (3, 5, 6)], "epn=2"),
        ("fused", [(2, 6, 9), (2, 5, 6)], "must be"),
        ("linear", [(2, 5, 6), (2, 5, 6), (2, 5, 6)], "must be"),
        ("linear", [(2, 5, 7), (2, 5, 7), (2, 7, 5)], "hidden size 6"),
    ],
)
def test_bad_weights_are_one_line_errors(layout, shapes, match):
    with pytest.raises(ValueError, match=match):
        check_weights(layout, [torch.zeros(s) for s in shapes], 2, 6)
