"""Micro-batches in flight per chunk (``simulator.inflight``): the closed forms against the walk of the schedule's
own op order, the weighted peak against every step of that walk, and what it changes: a DualPipe rank's two
unlike chunks (DeepSeek-V3's rank 0: stage 0 of one direction, 16 in flight; the last stage with the MTP module
and the logits of the other, 1); with it DeepSeek-V3's own H800 recipe fits with the even split too
(``test_fp8_input_store``)."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.hardware import load_hardware
from simulator.inflight import _walk_counts, inflight_candidates, inflight_chunks, peak_inflight, walk_candidates
from simulator.memory import GIB, _chunk_totals, mtp_act_bytes, rank_memory
from simulator.parallel import ParallelConfig, rank_chunks, stage_layers
from simulator.specs import load_model
from tests.simulator.test_fp8_input_store import DSV3_RUN

SEQ = 4096


def _config(schedule: str, pp: int, vpp: int, m_per_rank: int, group: int, a2a: bool) -> ParallelConfig:
    return ParallelConfig(
        pp=pp,
        vpp=vpp if schedule == "interleaved" else 1,
        ep=2 if a2a else 1,
        dp=2,
        schedule=schedule,
        seq_len=SEQ,
        global_batch_tokens=SEQ * 2 * m_per_rank,
        microbatch_group=group,
        moe_a2a_overlap=a2a,
    )


@settings(max_examples=80, deadline=None)
@given(
    schedule=st.sampled_from(["1f1b", "interleaved"]),
    pp=st.integers(1, 8),
    vpp=st.integers(2, 4),
    extra=st.integers(0, 20),
    group_extra=st.integers(0, 4),
    a2a=st.booleans(),
    data=st.data(),
)
def test_megatron_walk_peaks_at_the_closed_form(schedule, pp, vpp, extra, group_extra, a2a, data):
    """Alike chunks: the walk's largest total is the warm-up closed form (``inflight_chunks``), with and without
    the combined 1F1B of EP A2A overlap, for any contiguous group N."""
    m = pp + extra
    group = min(m, pp + group_extra) if schedule == "interleaved" and group_extra else 0
    par = _config(schedule, pp, vpp, m, group, a2a)
    rank = data.draw(st.integers(0, pp - 1))
    walked = walk_candidates(par, rank)
    assert max(sum(c) for c in walked) == inflight_chunks(par, rank)
    assert inflight_candidates(par, rank) == walked  # the closed form for one chunk, the walk itself for more
    assert all(min(c) >= 0 for c in walked)


@settings(max_examples=60, deadline=None)
@given(half_pp=st.integers(1, 8), extra=st.integers(0, 12), data=st.data())
def test_dualpipe_closed_form_is_its_walk(half_pp, extra, data):
    """DualPipe rank r keeps p - h micro-batches of its first-direction stage and h + 1 of the other
    (h = min(r, p-1-r)), p + 1 in all (DualPipe's table), as walking ``events.dualpipe_order`` gives."""
    pp = 2 * half_pp
    par = _config("dualpipe", pp, 1, 2 * pp + 2 * extra, 0, False)
    rank = data.draw(st.integers(0, pp - 1))
    assert inflight_candidates(par, rank) == walk_candidates(par, rank)
    (counts,) = inflight_candidates(par, rank)
    assert sum(counts) == inflight_chunks(par, rank) == pp + 1
    first_direction = 0 if rank < pp // 2 else 1  # local chunk 0 is stage ``rank`` (``rank_chunks``)
    assert counts[first_direction] == pp - min(rank, pp - 1 - rank)


@settings(max_examples=60, deadline=None)
@given(
    schedule=st.sampled_from(["interleaved", "dualpipe"]),
    half_pp=st.integers(1, 4),
    vpp=st.integers(2, 4),
    extra=st.integers(0, 10),
    a2a=st.booleans(),
    weights=st.lists(st.floats(0, 1e9, allow_nan=False), min_size=4, max_size=4),
    data=st.data(),
)
def test_weighted_peak_is_the_walks_largest_step(schedule, half_pp, vpp, extra, a2a, weights, data):
    """``peak_inflight`` for any bytes per chunk (adversarial: zeros, one chunk far heavier) is the largest
    ``sum(count x bytes)`` over every step of the walk (the undominated candidates lose nothing)."""
    pp = 2 * half_pp
    par = _config(schedule, pp, vpp, 2 * pp + 2 * extra, 0, a2a and schedule == "interleaved")
    rank = data.draw(st.integers(0, pp - 1))
    chunk_bytes = tuple(weights[: par.chunks])
    every_step = max(sum(n * b for n, b in zip(c, chunk_bytes)) for c in _walk_counts(par, rank))
    got = peak_inflight(par, rank, chunk_bytes)
    assert sum(n * b for n, b in zip(got, chunk_bytes)) == pytest.approx(every_step, rel=1e-12, abs=1e-6)


DSV3 = replace(DSV3_RUN, pp_first_layers=None, pp_last_layers=None, activation_fp8_input_store=True)
"""DeepSeek-V3's own 2048-H800 recipe (``test_fp8_input_store.DSV3_RUN``) with the even layer split."""


def test_dualpipe_rank_zero_keeps_its_last_stage_once():
    spec, hw = replace(load_model("deepseek-v3"), mtp_layers=1), load_hardware("h800")
    chunks, flash = stage_layers(spec, DSV3), hw.efficiency.flash_attention
    first, last = (_chunk_totals(spec, chunks[c], DSV3, flash)[3] for c in rank_chunks(DSV3)[0])
    t = DSV3.micro_batch * DSV3.seq_len
    logits = 2 * t * spec.vocab * 6.0  # main head and the MTP depth, once each
    want = 16 * first + 1 * (last + t * mtp_act_bytes(spec, DSV3, flash)) + logits
    assert rank_memory(spec, hw, DSV3, 0)["activations"] == pytest.approx(want, rel=1e-12)
    # the even split (8.5 + 8.5) it replaces is far from it: rank 0's two chunks are unlike
    even = 8.5 * (first + last + t * mtp_act_bytes(spec, DSV3, flash)) + logits
    assert even > want + 5 * GIB


@settings(max_examples=30, deadline=None)
@given(half_pp=st.integers(1, 6), extra=st.integers(0, 8), model=st.sampled_from(["deepseek-v3", "llama3-70b"]))
def test_dualpipe_zero2_walk_finds_both_gradients_at_the_activation_peak(half_pp, extra, model):
    """ZeRO-2 accumulating over the step (``grad_reduce = step``) under DualPipe walks its order: each chunk's
    first backward runs before (or in the pair that makes) the rank's activation peak, so the unsharded gradients
    of both chunks sit on top of it and ZeRO-2 keeps what ZeRO-1 keeps there (the bound this used to assume, now
    derived)."""
    spec, hw, pp = load_model(model), load_hardware("h100"), 2 * half_pp
    par = ParallelConfig(
        pp=pp,
        ep=8 if spec.is_moe else 1,
        dp=8,
        seq_len=4096,
        global_batch_tokens=4096 * 8 * (2 * pp + 2 * extra),
        schedule="dualpipe",
        recompute="selective",
        grad_reduce="step",
    )
    for rank in range(pp):
        one, two = (rank_memory(spec, hw, replace(par, zero_stage=z), rank) for z in (1, 2))
        assert two["grads"] == pytest.approx(one["grads"], rel=1e-12)
        assert two["activations"] == pytest.approx(one["activations"], rel=1e-12)
