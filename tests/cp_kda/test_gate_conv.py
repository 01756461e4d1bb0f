"""Gates and the short convolution against their plain twins."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_kda import kda_gate, kda_gate_naive, short_conv, short_conv_naive
from tests.cp_kda.helpers import max_abs


def _gate_inputs(with_A=True, with_bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    f = (10 * torch.randn(2, 7, 3, 8, generator=gen, dtype=torch.float64)).requires_grad_()
    A = torch.log(torch.linspace(1, 16, 3, dtype=torch.float64)).requires_grad_() if with_A else None
    b = (0.5 * torch.randn(24, generator=gen, dtype=torch.float64)).requires_grad_() if with_bias else None
    return f, A, b


@pytest.mark.parametrize(
    "lower_bound,with_A,with_bias",
    [
        (None, True, True),
        (None, True, False),  # softplus form (needs A_log)
        (-5.0, True, True),
        (-5.0, True, False),
        (-5.0, False, True),  # K3 lower-bound form
    ],
)
def test_gate_matches_naive(lower_bound, with_A, with_bias):
    """Values and grads of f, A_log, dt_bias of the hand-written backward vs autograd (FLA tests 1e-4)."""
    f, A, b = _gate_inputs(with_A, with_bias)
    g1, g2 = kda_gate(f, A, b, lower_bound), kda_gate_naive(f, A, b, lower_bound)
    dg = torch.randn_like(g1)
    inputs = [x for x in (f, A, b) if x is not None]
    d1 = torch.autograd.grad((g1 * dg).sum(), inputs)
    d2 = torch.autograd.grad((g2 * dg).sum(), inputs)
    assert max_abs(g1, g2) < 1e-12
    assert all(max_abs(x, y) < 1e-10 for x, y in zip(d1, d2))


def test_gate_ranges_and_formula():
    """Softplus gate <= 0; K3 gate in [lb, 0] (open interval up to rounding) and equal to lb * sigmoid(exp(A_log) *
    (f + dt_bias))."""
    f, A, b = _gate_inputs()
    assert (kda_gate(f, A, b) <= 0).all()
    g = kda_gate(f, A, b, lower_bound=-5.0)
    assert ((g >= -5) & (g <= 0)).all()
    manual = -5.0 * torch.sigmoid(A.exp()[:, None] * (f + b.reshape(3, 8)))
    assert max_abs(g, manual) < 1e-14
    f32 = kda_gate(f.detach().bfloat16(), A.detach().float(), b.detach().float())
    assert f32.dtype == torch.float32


def test_gate_bad_input():
    f, A, b = _gate_inputs()
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(f, A[:2], b)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(f, A, b[:5])
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(f, A, b, lower_bound=1.0)


@pytest.mark.parametrize("cu", [None, [0, 2, 9, 20]])
def test_conv_matches_naive(cu):
    """Vectorised conv vs the token loop, with a carried state; values, final states, grads."""
    gen = torch.Generator().manual_seed(1)
    B = 2 if cu is None else 1
    N = B if cu is None else len(cu) - 1
    x = torch.randn(B, 20, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    state = torch.randn(N, 6, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    cut = None if cu is None else torch.tensor(cu)
    outs = [
        fn(x, w, bias, initial_state=state, output_final_state=True, cu_seqlens=cut)
        for fn in (short_conv, short_conv_naive)
    ]
    dy = torch.randn_like(outs[0][0])
    grads = [torch.autograd.grad((y * dy).sum() + s.sum(), [x, w, bias, state]) for y, s in outs]
    assert max_abs(outs[0][0], outs[1][0]) < 1e-12 and max_abs(outs[0][1], outs[1][1]) == 0
    assert all(max_abs(a, b) < 1e-12 for a, b in zip(*grads))


@settings(max_examples=10, deadline=None)
@given(T=st.integers(2, 30), cut=st.integers(1, 29), W=st.integers(2, 5))
def test_conv_state_carry_splits_exactly(T, cut, W):
    """Running [0, cut) then [cut, T) from the carried state equals one run (decode/prefill consistency)."""
    cut = min(cut, T - 1)
    gen = torch.Generator().manual_seed(T * 31 + cut)
    x = torch.randn(1, T, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(5, W, generator=gen, dtype=torch.float64)
    y, _ = short_conv(x, w)
    y1, s1 = short_conv(x[:, :cut], w, output_final_state=True)
    y2, _ = short_conv(x[:, cut:], w, initial_state=s1)
    assert max_abs(torch.cat([y1, y2], 1), y) < 1e-12


def test_conv_bad_input():
    x = torch.randn(1, 5, 4)
    with pytest.raises(ValueError, match="weight"):
        short_conv(x, torch.randn(3, 4))
    with pytest.raises(ValueError, match="initial_state"):
        short_conv(x, torch.randn(4, 4), initial_state=torch.randn(1, 4, 2))
    with pytest.raises(ValueError, match="cu_seqlens"):
        short_conv(x, torch.randn(4, 4), cu_seqlens=torch.tensor([0, 3]))
