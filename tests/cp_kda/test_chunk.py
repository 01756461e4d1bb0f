"""Chunked KDA (forward and its own backward) against the token recurrence."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_kda import kda_chunk, kda_recurrent
from tests.cp_kda.helpers import loss_grads, make_inputs, max_abs, rel_rms

FP64_CASES = [  # B, T, H, K, V, chunk, lower_bound
    (1, 64, 1, 16, 16, 64, None),
    (2, 100, 3, 12, 8, 64, None),  # T not a multiple of the chunk
    (1, 203, 2, 8, 20, 64, -5.0),  # K3 gate, ragged last chunk
    (2, 70, 1, 32, 16, 32, -5.0),
    (1, 50, 2, 20, 10, 16, None),
]


def _both(xs, chunk_size, cu=None, seed=7):
    q, k, v, g, beta, h0 = xs
    ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    out = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=chunk_size)
    gen = torch.Generator().manual_seed(seed)
    cot = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in ref]
    return ref, out, loss_grads(ref, cot, xs), loss_grads(out, cot, xs)


@pytest.mark.parametrize("case", FP64_CASES)
def test_fp64_exact(case):
    """fp64: outputs, final state and grads of q, k, v, g, beta, h0 within 1e-10 max abs (rounding only)."""
    B, T, H, K, V, C, lb = case
    ref, out, g_ref, g_out = _both(make_inputs(B, T, H, K, V, seed=T, lower_bound=lb), C)
    for a, b in zip(ref + tuple(g_ref), out + tuple(g_out)):
        assert max_abs(a, b) <= 1e-10


@pytest.mark.parametrize("lb", [None, -5.0])
def test_fp32_relative_rms(lb):
    """fp32: 1e-5 relative RMS (FLA's metric) on outputs, final states and all grads."""
    ref, out, g_ref, g_out = _both(make_inputs(1, 150, 2, 32, 24, dtype=torch.float32, lower_bound=lb), 64)
    for a, b in zip(ref + tuple(g_ref), out + tuple(g_out)):
        assert rel_rms(a, b) <= 1e-5


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_varlen_fp64(chunk_size):
    """Catches: a chunk straddling two packed sequences, or per-sequence initial/final states misplaced."""
    cu = torch.tensor([0, 15, 80, 81, 150])
    ref, out, g_ref, g_out = _both(make_inputs(1, 150, 2, 8, 6, seed=3, N=4), chunk_size, cu)
    for a, b in zip(ref + tuple(g_ref), out + tuple(g_out)):
        assert max_abs(a, b) <= 1e-10


@pytest.mark.parametrize("group_elements", [1, 2500])
@pytest.mark.parametrize("varlen", [False, True])
def test_groups_of_chunks_carry_the_state(monkeypatch, group_elements, varlen):
    """The forward runs one group of chunks at a time (the whole sequence is one group at these sizes): with
    groups of one chunk, or of two with a shorter last one, the state must pass from group to group and the
    outputs land in their rows. Catches a group's state loop restarting from h0, or outputs written to the wrong
    chunks."""
    from cp_kda import chunk

    monkeypatch.setattr(chunk, "GROUP_ELEMENTS", group_elements)
    if varlen:
        cu = torch.tensor([0, 15, 80, 81, 150])
        ref, out, g_ref, g_out = _both(make_inputs(1, 150, 2, 12, 6, seed=4, N=4), 16, cu)
    else:
        ref, out, g_ref, g_out = _both(make_inputs(2, 100, 3, 12, 8, seed=4), 16)
    for a, b in zip(ref + tuple(g_ref), out + tuple(g_out)):
        assert max_abs(a, b) <= 1e-10


def test_no_initial_state_and_no_final_state():
    q, k, v, g, beta, _ = make_inputs(1, 40, 2, 8, 8, with_state=False)
    o, ht = kda_chunk(q, k, v, g, beta, chunk_size=16)
    assert ht is None
    o_ref, _ = kda_recurrent(q, k, v, g, beta)
    (gq,) = torch.autograd.grad(o.sum(), [q])
    (gq_ref,) = torch.autograd.grad(o_ref.sum(), [q])
    assert max_abs(o, o_ref) < 1e-12 and max_abs(gq, gq_ref) < 1e-12


def test_extreme_gates_stay_finite_fp32():
    """Catches: exp(-cumsum g) overflow. g = -1000 (hard resets) and g = -30 runs make cumulative decays of
    -10^4 inside a chunk; the chunked pass must stay finite and agree with fp64."""
    xs = make_inputs(1, 128, 1, 8, 8, dtype=torch.float64, seed=5)
    with torch.no_grad():
        xs[3][:, ::17] = -1000.0
        xs[3][:, 40:90] = -30.0
    low = [x.detach().float().requires_grad_() for x in xs]
    ref = kda_recurrent(*(x.detach().double() for x in low[:5]), initial_state=xs[5], output_final_state=True)
    out = kda_chunk(*low[:5], initial_state=low[5], output_final_state=True)
    grads = torch.autograd.grad(out[0].sum() + out[1].sum(), low)
    assert all(torch.isfinite(t).all() for t in (*out, *grads))
    assert rel_rms(ref[0], out[0]) < 1e-5 and rel_rms(ref[1], out[1]) < 1e-5


def test_backward_saves_inputs_only():
    """Catches: the forward stashing per-token or per-chunk states for the backward instead of recomputing."""
    xs = make_inputs(1, 128, 2, 8, 8)
    o, _ = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=16)
    saved = sum(t.numel() for t in o.grad_fn.saved_tensors)
    assert saved == sum(x.numel() for x in xs)


def test_bf16_inputs_close_to_fp32_reference():
    xs = make_inputs(1, 96, 2, 16, 16, dtype=torch.float32, seed=9, with_state=False)
    ref, _ = kda_recurrent(*xs[:5])
    low = [x.detach().bfloat16() for x in xs[:5]]
    out, _ = kda_chunk(*low)
    assert out.dtype == torch.bfloat16 and rel_rms(ref, out) < 2e-2


@settings(max_examples=12, deadline=None)
@given(
    B=st.integers(1, 2),
    T=st.integers(1, 70),
    H=st.integers(1, 2),
    K=st.integers(1, 9),
    V=st.integers(1, 7),
    C=st.sampled_from([1, 3, 16, 32]),
    seed=st.integers(0, 2**16),
)
def test_property_any_shape_and_chunk(B, T, H, K, V, C, seed):
    """Any shape and chunk size (including chunks of 1 and sizes that are not multiples of 16)."""
    xs = make_inputs(B, T, H, K, V, seed=seed)
    ref = kda_recurrent(*xs[:5], initial_state=xs[5], output_final_state=True)
    out = kda_chunk(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=C)
    assert max_abs(ref[0], out[0]) <= 1e-10 and max_abs(ref[1], out[1]) <= 1e-10


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the fla backend is compared in the test below")
def test_fla_backend_refused_without_gpu():
    xs = make_inputs(1, 8, 1, 4, 4, with_state=False)
    with pytest.raises(ValueError, match="backend"):
        kda_chunk(*xs[:5], backend="fla")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_backend_matches_torch_on_gpu():
    pytest.importorskip("fla")
    xs = [x.detach().float().cuda() for x in make_inputs(1, 256, 2, 64, 64, seed=4, with_state=False)[:5]]
    o_ref, _ = kda_chunk(*xs)
    o, _ = kda_chunk(*xs, backend="fla")
    assert rel_rms(o_ref, o) < 5e-3


def _block_inputs(shape, kind, dtype=torch.float64, seed=3):
    """q, k (L2-normalised) and gates g ``[..., C, K]``: ordinary (logsigmoid), K3's bound held hard, or -1000
    resets with a run of -30 (both steep enough to need the exact path)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    q, k, z = (torch.randn(*shape, generator=gen, dtype=dtype) for _ in range(3))
    if kind == "ordinary":
        g = F.logsigmoid(z)
    elif kind == "bound":
        g = -5.0 * torch.sigmoid(3 * z)
    else:
        g = F.logsigmoid(z)
        g[..., ::17, :] = -1000.0
        g[..., 20:40, :] = -30.0
    return F.normalize(q, dim=-1), F.normalize(k, dim=-1), g


@pytest.mark.parametrize("C", [64, 32, 48, 50, 3])
@pytest.mark.parametrize("kind", ["ordinary", "bound", "steep"])
def test_decay_matrices_match_their_naive_twin(C, kind):
    """The sub-block factored Aqk, L, exp(G), K̃ and γ equal the full pairwise-decay twin (fp64), on both the
    middle-token path and the exact one. Catches: a wrong reference token, a cross-block factor off by one
    block, the upper half not masked, a sub-block layout slip when C is not a multiple of 16."""
    from cp_kda import intra, naive

    q, k, g = _block_inputs((2, 3, C, 24), kind)
    if C % 16 == 0:  # both paths are exercised: ordinary gates factor, steep ones take the exact path
        assert intra._block_factors(g.unflatten(-2, (C // 16, 16)))[-1] == (kind != "ordinary")
    for a, b in zip(naive.decay_matrices_naive(q, k, g), intra.decay_matrices(q, k, g)):
        assert max_abs(a, b) <= 1e-12


def test_decay_matrices_fp32_keep_relative_accuracy_on_steep_gates():
    """fp32 against the fp64 twin: no overflow, and the matrices keep ~1e-6 relative accuracy although the
    cumulative decays inside a chunk reach -10^4 (catches decays formed as differences of cumulative sums)."""
    from cp_kda import intra, naive

    q, k, g = _block_inputs((2, 3, 64, 24), "steep")
    ref = naive.decay_matrices_naive(q, k, g)
    out = intra.decay_matrices(q.float(), k.float(), g.float())
    assert all(torch.isfinite(t).all() for t in out)
    for a, b in zip(ref[:4], out[:4]):  # gamma = exp(-10^4) underflows in fp32, as it must
        assert rel_rms(a, b) <= 1e-6


def test_factored_diagonal_matches_its_exact_twin():
    """The fast factored diagonal sub-blocks equal the exact pairwise-decay ones (fp64), on gates inside the
    factoring limit; and gates beyond it take the exact path (catches a wrong switch or a mid-point bug)."""
    from cp_kda import intra

    q, k, g = _block_inputs((2, 3, 4, 16, 8), "ordinary")
    up, down, _, _, _, exact = intra._block_factors(g)
    assert not exact
    rows = torch.stack([q, k], dim=-3)
    keep = intra._keep(16, g.dtype, g.device)
    torch.testing.assert_close(
        intra._diag_factored(rows * up.unsqueeze(-3), k * down) * keep,
        intra._diag_exact(rows, k, g) * keep,
        rtol=1e-12,
        atol=1e-12,
    )
    assert intra._block_factors(g * 100)[-1]
