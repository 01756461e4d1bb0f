"""The search's caches give what the plain loops give: a chunk's memory totals (``memory._chunk_totals``, built
from per-kind values shared by a layout's chunks) against a layer-by-layer sum, and DualPipe's op counts (cached on
PP, micro-batches and rank) against counting the layout's own ``dualpipe_order``; the specs' hash worked out once
(``field_checks.hash_once``) against dataclass's own, and the pipeline ranks' memory kept between calls against
``rank_memory`` each time; the memory screen that stops at the first rank over the limit against the heaviest
rank, a chunk's parameters against a layer-by-layer sum, and the DP buckets kept per arguments against a fresh
pricing."""

import dataclasses
import pickle
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analytic import _dualpipe_counts
from simulator.events import dualpipe_order
from simulator.hardware import load_hardware
from simulator.layers import layer_stats
from simulator.memory import (
    _chunk_totals,
    _layer_act,
    chunk_params,
    exceeds_memory,
    peak_memory,
    pipeline_memory,
    rank_memory,
)
from simulator.parallel import ParallelConfig, stage_layers
from simulator.specs import load_model

MODELS = ("k3", "deepseek-v3", "qwen3-30b-a3b", "gpt-oss-120b", "llama3-70b")


def _naive_totals(spec, layers, par, flash) -> tuple:
    t = par.micro_batch * par.seq_len / par.cp
    dense = expert = act = kv = kda = 0.0
    moe = 0
    for i in layers:
        kind = spec.layer_kinds()[i]
        s = layer_stats(spec, kind)
        a, k, d = _layer_act(spec, par, s, t, flash)
        dense, expert, moe = dense + s.dense_params, expert + s.expert_params, moe + (kind[1] == "moe")
        act, kv, kda = act + a, kv + k, kda + d
    return dense, expert, moe, act, kv, kda


@settings(max_examples=40, deadline=None)
@given(
    model=st.sampled_from(MODELS),
    pp=st.sampled_from([1, 2, 4, 8]),
    vpp=st.sampled_from([1, 2, 3]),
    micro_batch=st.sampled_from([1, 2]),
    precision=st.sampled_from(["bf16", "fp8"]),
    modules=st.sampled_from([(), ("layernorm",), ("moe_act", "mla_up_proj"), ("mlp",)]),
    store=st.booleans(),
    flash=st.booleans(),
)
def test_chunk_totals_are_the_layer_by_layer_sum(model, pp, vpp, micro_batch, precision, modules, store, flash):
    spec = load_model(model)
    store = store and not spec.glu_clamp
    par = ParallelConfig(
        pp=pp,
        vpp=vpp,
        schedule="interleaved" if vpp > 1 else "1f1b",
        micro_batch=micro_batch,
        seq_len=4096,
        global_batch_tokens=4096 * 64,
        precision=precision,
        recompute="selective",
        recompute_modules=modules,
        activation_fp8_input_store=store,
    )
    for layers in stage_layers(spec, par):
        got, want = _chunk_totals(spec, layers, par, flash), _naive_totals(spec, layers, par, flash)
        assert got[2] == want[2]
        assert got == pytest.approx(want, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(half_pp=st.integers(1, 8), extra=st.integers(0, 24), seq=st.sampled_from([1024, 4096]))
def test_dualpipe_counts_are_the_layouts_own(half_pp, extra, seq):
    pp = 2 * half_pp
    m = 2 * pp + 2 * extra
    par = ParallelConfig(pp=pp, dp=2, seq_len=seq, global_batch_tokens=seq * 2 * m, schedule="dualpipe")
    assert par.micro_batches == m
    for rank in range(pp):
        want = Counter(tuple(e) for e in dualpipe_order(par, rank))
        assert dict(_dualpipe_counts(par, rank)) == want


def _field_hash(obj) -> int:
    """What dataclass's generated ``__hash__`` returns: the tuple of the compared fields."""
    return hash(tuple(getattr(obj, f.name) for f in dataclasses.fields(obj) if f.compare))


@settings(max_examples=30, deadline=None)
@given(model=st.sampled_from(MODELS), hardware=st.sampled_from(["h100", "b200", "gb200"]), tp=st.sampled_from([1, 2]))
def test_hash_once_is_the_field_hash_and_follows_equality(model, hardware, tp):
    spec, hw, par = load_model(model), load_hardware(hardware), ParallelConfig(tp=tp, seq_len=4096)
    for obj in (spec, hw, hw.efficiency, par):
        assert hash(obj) == _field_hash(obj)
        assert hash(obj) == hash(obj)  # the kept value
        twin = dataclasses.replace(obj)  # a fresh equal instance: same hash, same cache slot
        assert twin == obj and hash(twin) == hash(obj)
        assert "_hash_once" not in dataclasses.asdict(obj)
        other = dataclasses.replace(obj, name=obj.name + "-x") if hasattr(obj, "name") else None
        if other is not None:
            assert other != obj and hash(other) == _field_hash(other)
    assert hash(dataclasses.replace(par, tp=2 * tp)) != hash(par)


@pytest.mark.spawns
def test_pickled_spec_hashes_again_in_another_process():
    """String hashes are salted per process: a pickled spec must not carry the sender's value."""
    spec = load_model("deepseek-v3")
    hash(spec)
    blob = pickle.dumps(spec)
    assert "_hash_once" not in pickle.loads(blob).__dict__
    code = (
        "import pickle, sys, dataclasses\n"
        "s = pickle.loads(sys.stdin.buffer.read())\n"
        "print(hash(s) == hash(tuple(getattr(s, f.name) for f in dataclasses.fields(s) if f.compare)))"
    )
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=60, check=True)
    assert out.stdout.strip() == b"True"


@pytest.mark.parametrize(
    "model,pp,schedule", [("k3", 4, "dualpipe"), ("deepseek-v3", 8, "1f1b"), ("llama3-70b", 4, "interleaved")]
)
def test_pipeline_memory_is_rank_memory_and_peak_is_a_copy(model, pp, schedule):
    spec, hw = load_model(model), load_hardware("h200")
    par = ParallelConfig(
        pp=pp, vpp=2 if schedule == "interleaved" else 1, schedule=schedule, seq_len=4096, global_batch_tokens=4096 * 64
    )
    ranks = pipeline_memory(spec, hw, par)
    assert list(ranks) == [rank_memory(spec, hw, par, r) for r in range(pp)]
    rank, mem = peak_memory(spec, hw, par)
    assert sum(mem.values()) == max(sum(m.values()) for m in ranks)
    mem["activations"] = -1.0  # a caller's edit stays its own
    assert peak_memory(spec, hw, par)[1] == ranks[rank] == rank_memory(spec, hw, par, rank)


@settings(max_examples=40, deadline=None)
@given(
    model=st.sampled_from(MODELS),
    pp=st.sampled_from([1, 2, 3, 4, 8]),
    schedule=st.sampled_from(["1f1b", "interleaved"]),
    cut=st.floats(0.0, 1.0),
)
def test_the_memory_screen_answers_as_the_heaviest_rank(model, pp, schedule, cut):
    """``exceeds_memory`` stops at the first rank over the limit (rank 0, the last, then the rest): it answers
    what the heaviest rank's total says, for limits below, at and above every rank's total; what it priced is
    what ``pipeline_memory`` then returns."""
    spec, hw = load_model(model), load_hardware("h200")
    par = ParallelConfig(
        pp=pp,
        vpp=2 if schedule == "interleaved" and pp > 1 else 1,
        schedule=schedule if pp > 1 else "1f1b",
        seq_len=4096,
        global_batch_tokens=4096 * 64,
    )
    totals = [sum(rank_memory(spec, hw, par, r).values()) for r in range(pp)]
    low, high = min(totals), max(totals)
    for limit in (low * (1 - cut), low + cut * (high - low), high, high * (1 + cut), *totals):
        assert exceeds_memory(spec, hw, par, limit) == (high > limit), (limit, totals)
    assert [sum(m.values()) for m in pipeline_memory(spec, hw, par)] == totals


@settings(max_examples=30, deadline=None)
@given(model=st.sampled_from(MODELS), pp=st.sampled_from([1, 2, 4, 8]), vpp=st.sampled_from([1, 2, 3]))
def test_chunk_params_are_the_layer_by_layer_sum(model, pp, vpp):
    spec = load_model(model)
    par = ParallelConfig(pp=pp, vpp=vpp, schedule="interleaved" if vpp > 1 else "1f1b", seq_len=4096)
    for layers in stage_layers(spec, par):
        dense = sum(layer_stats(spec, spec.layer_kinds()[i]).dense_params for i in layers)
        expert = sum(layer_stats(spec, spec.layer_kinds()[i]).expert_params for i in layers)
        assert chunk_params(spec, layers) == (dense, expert)


def test_bucket_costs_are_kept_per_arguments_and_equal_a_fresh_pricing():
    """``dp_comm.buckets`` is kept per its own (hashable, immutable) arguments: a second call returns what pricing
    them afresh gives."""
    from simulator import dp_comm
    from simulator import network as net

    tiers = net.cluster_tiers(1024, load_hardware("h100"), net.ClusterSpec())
    for n, stride in ((8, 1), (64, 8), (128, 8)):
        group = net.group(n, stride, tiers)
        for op in ("reduce_scatter", "all_gather", "all_reduce"):
            kept = dp_comm.buckets(3.5e9, 4.0, group, tiers, op, (1.0, 1.0, 1.0))
            fresh = dp_comm.buckets.__wrapped__(3.5e9, 4.0, group, tiers, op, (1.0, 1.0, 1.0))
            assert kept == fresh and kept.count >= 1 and kept.each_s > 0
