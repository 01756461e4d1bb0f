"""The search's caches give what the plain loops give: a chunk's memory totals (``memory._chunk_totals``, built
from per-kind values shared by a layout's chunks) against a layer-by-layer sum, and DualPipe's op counts (cached on
PP, micro-batches and rank) against counting the layout's own ``dualpipe_order``."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.analytic import _dualpipe_counts
from simulator.events import dualpipe_order
from simulator.layers import layer_stats
from simulator.memory import _chunk_totals, _layer_act
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
