"""Rank bookkeeping, the affine state map, and context parallelism simulated in one process."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_kda import fold, kda_chunk, kda_recurrent, plan_rank, plan_ranks, reverse_fold, simulate_context_parallel
from cp_kda.transfer import transfer_map
from tests.cp_kda.helpers import loss_grads, make_inputs, max_abs


def test_plan_matches_fla_example():
    """FLA's test_cp_context case: cu_seqlens [0,5,12], 3 ranks of 4 tokens, rank 1."""
    p = plan_rank(1, 3, 4, [0, 5, 12])
    assert p.local_bounds == (0, 1, 4) and p.seq_ids == (0, 1)
    assert p.first_from == 0 and p.last_to == 2 and p.first_offset == 4 and p.halo(3) == 3
    assert plan_rank(0, 3, 4, [0, 5, 12]).first_from is None
    assert plan_rank(2, 3, 4, [0, 5, 12]).last_to is None


def test_plan_boundaries_on_rank_edges_and_long_spans():
    plans = plan_ranks(4, 12, [0, 12, 48])
    assert plans[0].last_to is None and plans[1].first_from is None  # sequence ends exactly on the edge
    assert plans[1].last_to == 3 and plans[3].first_from == 1  # one sequence over 3 ranks
    assert plans[2].local_bounds == (0, 12) and plans[2].first_offset == 12
    with pytest.raises(ValueError, match="cu_seqlens"):
        plan_rank(0, 4, 12, [0, 40])


def test_transfer_is_the_affine_map_and_composes():
    """S_end = M S_in + B for any S_in, and (M2,B2)∘(M1,B1) equals the transfer of the joined span."""
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(2, 40, 2, 6, 5, seed=11))
    V = v.shape[-1]
    whole = transfer_map(q, k, v, g, beta, 0.4, 16)
    _, S_end = kda_chunk(q, k, v, g, beta, scale=0.4, initial_state=h0, output_final_state=True, chunk_size=16)
    assert max_abs(whole[..., V:] @ h0 + whole[..., :V], S_end) < 1e-12
    parts = [transfer_map(*(x[:, a:b] for x in (q, k, v, g, beta)), 0.4, 16) for a, b in ((0, 13), (13, 40))]
    assert max_abs(fold(parts, V), whole[..., :V]) < 1e-12
    assert max_abs(parts[1][..., V:] @ parts[0][..., V:], whole[..., V:]) < 1e-12
    msgs = [torch.cat([torch.randn_like(p[..., :V]), p[..., V:].transpose(-1, -2)], -1) for p in parts]
    expected = msgs[0][..., :V] + msgs[0][..., V:] @ msgs[1][..., :V]
    assert max_abs(reverse_fold(msgs, V), expected) < 1e-12


SIM_CASES = [  # world_size, B, cu_seqlens (T = 48)
    (1, 2, None),
    (2, 2, None),
    (3, 1, None),
    (4, 1, [0, 5, 12, 13, 24, 40, 48]),  # boundaries on rank edges, a 1-token sequence, several per rank
    (4, 1, [0, 7, 48]),  # one sequence over all 4 ranks after a short one
    (3, 1, [0, 47, 48]),
    (4, 1, [0, 12, 24, 36, 48]),
    (2, 1, [0, 48]),
]


@pytest.mark.parametrize("world,B,cu", SIM_CASES)
def test_simulated_cp_matches_recurrent(world, B, cu):
    """fp64 forward and backward (all input grads, final states) of the scan algorithm to 1e-10."""
    xs = make_inputs(B, 48, 2, 6, 5, seed=world, with_state=False)[:5]
    cut = None if cu is None else torch.tensor(cu)
    o, ht = kda_recurrent(*xs, output_final_state=True, cu_seqlens=cut)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    ref = loss_grads((o, ht), (do, dht), xs)
    o2, ht2, grads = simulate_context_parallel(*xs, world_size=world, cu_seqlens=cut, chunk_size=8, do=do, dfinal=dht)
    assert max_abs(o, o2) < 1e-10 and max_abs(ht, ht2) < 1e-10
    assert all(max_abs(a, b) < 1e-10 for a, b in zip(ref, grads))


@settings(max_examples=10, deadline=None)
@given(
    world=st.integers(1, 5),
    per_rank=st.integers(1, 9),
    cuts=st.lists(st.integers(1, 44), max_size=6),
    seed=st.integers(0, 999),
)
def test_property_random_cuts(world, per_rank, cuts, seed):
    """Any split of any packing: sequences starting and ending anywhere, ranks of a single token; fwd + bwd."""
    T = world * per_rank
    cu = torch.tensor(sorted({0, T, *(c for c in cuts if c < T)}))
    xs = make_inputs(1, T, 1, 3, 2, seed=seed, with_state=False)[:5]
    o, ht = kda_recurrent(*xs, output_final_state=True, cu_seqlens=cu)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    ref = loss_grads((o, ht), (do, dht), xs)
    o2, ht2, grads = simulate_context_parallel(*xs, world_size=world, cu_seqlens=cu, chunk_size=4, do=do, dfinal=dht)
    assert max_abs(o, o2) < 1e-10 and max_abs(ht, ht2) < 1e-10
    assert all(max_abs(a, b) < 1e-10 for a, b in zip(ref, grads))
