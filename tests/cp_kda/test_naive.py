"""The recurrent reference against the definition written another way (the DPLR transition matrix)."""

import torch

from cp_kda import kda_recurrent
from tests.cp_kda.helpers import make_inputs, max_abs


def _dplr_reference(q, k, v, g, beta, scale, h0):
    """S_t = (I - β k kᵀ) Diag(α) S_{t-1} + β k vᵀ; o_t = scale S_tᵀ q_t, one head at a time with matrices."""
    B, T, H, K = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    S_all = h0.clone()
    eye = torch.eye(K, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            S = S_all[b, h]
            for t in range(T):
                kt, bt = k[b, t, h], beta[b, t, h]
                S = (eye - bt * torch.outer(kt, kt)) @ torch.diag(g[b, t, h].exp()) @ S + bt * torch.outer(
                    kt, v[b, t, h]
                )
                o[b, t, h] = scale * S.T @ q[b, t, h]
            S_all[b, h] = S
    return o, S_all


def test_recurrent_matches_dplr_form():
    """Catches: delta correction before the decay, or the output reading the state before the write."""
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(2, 9, 2, 4, 3, seed=1))
    o, S = kda_recurrent(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True)
    o_ref, S_ref = _dplr_reference(q, k, v, g, beta, 0.7, h0)
    assert max_abs(o, o_ref) < 1e-12 and max_abs(S, S_ref) < 1e-12


def test_single_token_reads_its_own_write():
    """From a zero state one token gives o = scale * β (qᵀk) v: the diagonal of the attention is included."""
    q, k, v, g, beta, _ = (x.detach() if x is not None else None for x in make_inputs(1, 1, 1, 4, 3, with_state=False))
    o, _ = kda_recurrent(q, k, v, g, beta, scale=1.0)
    expected = beta[0, 0, 0] * (q[0, 0, 0] @ k[0, 0, 0]) * v[0, 0, 0]
    assert max_abs(o[0, 0, 0], expected) < 1e-14


def test_varlen_equals_separate_sequences():
    """Catches: state leaking across a packed-sequence boundary, or initial states given to the wrong row."""
    cu = [0, 3, 4, 11]
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(1, 11, 2, 4, 3, seed=2, N=3))
    o, S = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=torch.tensor(cu))
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        sl = slice(a, b)
        o_i, S_i = kda_recurrent(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=h0[i : i + 1], output_final_state=True
        )
        assert max_abs(o[:, sl], o_i) < 1e-14 and max_abs(S[i : i + 1], S_i) < 1e-14


def test_dtypes_of_outputs():
    """Outputs come back in v's dtype, states in fp32 for low-precision inputs."""
    xs = make_inputs(1, 5, 1, 4, 4, dtype=torch.float32, with_state=False)
    q, k, v, g, beta = (x.detach().bfloat16() for x in xs[:5])
    o, S = kda_recurrent(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
