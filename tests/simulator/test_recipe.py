"""Recipe features of issue 18: memory knobs, MoE parallel folding, EP overlap, node dedup, uneven stages."""

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator import ParallelConfig, simulate
from simulator.costs import _layer, chunk_cost, node_dedup, steady_fraction
from simulator.feasibility import _split_reason, infeasible_reason
from simulator.gemm_shapes import roof_for, shared_expert_seconds
from simulator.hardware import load_hardware
from simulator.inflight import inflight_chunks
from simulator.kept_bytes import offload_seconds
from simulator.layers import layer_stats
from simulator.memory import _layer_act, peak_memory, rank_memory
from simulator.network import ClusterSpec, cluster_tiers, group
from simulator.parallel import _split
from simulator.published import ROWS as PUBLISHED
from simulator.specs import load_model
from simulator.validation import cli_args, published_config, published_model

DSV3 = load_model("deepseek-v3")
H100 = load_hardware("h100")
BASE = ParallelConfig(
    tp=2,
    pp=8,
    ep=64,
    etp=1,
    dp=64,
    vpp=4,
    schedule="interleaved",
    seq_len=4096,
    global_batch_tokens=8192 * 4096,
    precision="fp8",
    recompute="selective",
    dispatcher="deepep",
)


@settings(max_examples=80, deadline=None)
@given(
    L=st.integers(2, 130),
    chunks=st.integers(1, 32),
    first=st.none() | st.integers(0, 8),
    last=st.none() | st.integers(0, 8),
)
def test_uneven_split_covers_every_layer_once(L, chunks, first, last):
    """Every layer in exactly one chunk, the ends as asked (0: an embedding-only / head-only chunk), every middle
    chunk non-empty; a request ``_split_reason`` accepts is always honoured and one it refuses cannot be."""
    if _split_reason(L, chunks, first, last):
        mids = chunks - (first is not None) - (last is not None)
        rest = L - (first or 0) - (last or 0)
        assert mids < 0 or rest < max(mids, 1) or (mids == 0 and rest)
        return
    parts = _split(L, chunks, first, last)
    assert len(parts) == chunks and [i for p in parts for i in p] == list(range(L))
    assert (first is None or len(parts[0]) == first) and (last is None or len(parts[-1]) == last)
    middle = parts[(first is not None) : len(parts) - (last is not None)]
    assert all(len(c) >= 1 for c in middle)


def test_memory_knobs_each_shrink_their_item():
    base = rank_memory(DSV3, H100, BASE, 1)
    bf16 = rank_memory(DSV3, H100, replace(BASE, activation_dtype="bf16"), 1)
    assert base["activations"] < bf16["activations"]  # fp8 run: GEMM inputs kept in fp8 by default
    up = rank_memory(DSV3, H100, replace(BASE, recompute_modules=("mla_up_proj", "moe_act", "layernorm")), 1)
    assert up["activations"] < base["activations"]
    off = rank_memory(DSV3, H100, replace(BASE, offload_fraction=0.5), 1)
    assert off["activations"] == 0.5 * base["activations"]
    opt = rank_memory(DSV3, H100, replace(BASE, moment_dtype="bf16", main_grads_dtype="bf16"), 1)
    assert opt["optimizer"] == base["optimizer"] * 8 / 12 and opt["grads"] == base["grads"] / 2


def test_recompute_modules_and_offload_cost_time():
    res = simulate(DSV3, H100, BASE, 1024)
    more = simulate(DSV3, H100, replace(BASE, recompute_modules=("mla_up_proj", "shared_experts")), 1024)
    assert more.breakdown["recompute"] > res.breakdown["recompute"]
    slow_pcie = replace(H100, pcie_gbps=1.0)
    off = simulate(DSV3, slow_pcie, replace(BASE, offload_fraction=0.5), 1024)
    assert off.breakdown["offload"] > 0 and off.step_time_s > res.step_time_s
    assert abs(sum(off.breakdown.values()) - off.step_time_s) < 1e-6 * off.step_time_s


def test_moe_recompute_reruns_the_whole_moe_layer_forward():
    """Megatron's ``moe`` recompute module re-runs the MoE layer in the backward: at least its routed experts,
    bookkeeping and exposed dispatch/combine forward, at most the layer's whole forward (what full recompute adds);
    a dense layer does not change, and the rank keeps fewer activations."""
    tiers = cluster_tiers(1024, H100, ClusterSpec())
    moe = replace(BASE, recompute_modules=("moe",))
    t = BASE.micro_batch * BASE.seq_len
    f, b, _, _ = _layer(DSV3, H100, BASE, ("mla", "moe"), t, tiers, 1.0, (1.0, 1.0, 1.0))
    _, b_moe, _, _ = _layer(DSV3, H100, moe, ("mla", "moe"), t, tiers, 1.0, (1.0, 1.0, 1.0))
    _, b_full, _, _ = _layer(
        DSV3, H100, replace(BASE, recompute="full"), ("mla", "moe"), t, tiers, 1.0, (1.0, 1.0, 1.0)
    )
    extra = b_moe["recompute"] - b["recompute"]
    assert f["grouped_gemm"] + f["moe_fixed"] + f["ep"] < extra < b_full["recompute"] - f["attention"]
    dense = [_layer(DSV3, H100, p, ("mla", "dense"), t, tiers, 1.0, (1.0, 1.0, 1.0))[1] for p in (BASE, moe)]
    assert dense[0] == dense[1]
    assert rank_memory(DSV3, H100, moe, 1)["activations"] < rank_memory(DSV3, H100, BASE, 1)["activations"]
    res, more = simulate(DSV3, H100, BASE, 1024), simulate(DSV3, H100, moe, 1024)
    assert more.breakdown["recompute"] > res.breakdown["recompute"] and more.step_time_s > res.step_time_s


@pytest.mark.parametrize(
    "change, named", [({"recompute": "full"}, "full recompute"), ({"recompute_modules": ("moe",)}, "module moe")]
)
def test_module_graphs_refuse_what_megatron_refuses(change, named):
    """TE per-module graphs with the MoE router in scope take neither full recompute nor the ``moe`` module
    (Megatron's ``TransformerConfig`` asserts both); a full-iteration graph or none takes either."""
    with pytest.raises(ValueError, match=named):
        replace(BASE, cuda_graph="modules", **change)
    assert replace(BASE, cuda_graph="full", **change) and replace(BASE, cuda_graph="none", **change)


@settings(max_examples=60, deadline=None)
@given(
    model=st.sampled_from(["deepseek-v3", "llama3-70b", "k3"]),
    recompute=st.sampled_from(["none", "selective", "selective+act", "full"]),
    modules=st.sampled_from(
        [(), ("layernorm",), ("mla_up_proj", "moe_act"), ("layernorm", "mlp_act", "moe_act"), ("moe", "mlp")]
    ),
    fp8=st.booleans(),
    store=st.booleans(),
    fraction=st.sampled_from([0.25, 0.5, 1.0]),
    hardware=st.sampled_from(["h100", "a100"]),
)
def test_offload_moves_the_bytes_memory_takes_off_the_gpu(model, recompute, modules, fp8, store, fraction, hardware):
    """What the offload sends to the host each forward (and back each backward) is what the memory model removes
    from the GPU: after recompute, fp8 storage and the SwiGLU-input store, not the layer's bf16 saved set."""
    spec, hw = load_model(model), load_hardware(hardware)
    par = replace(
        BASE,
        recompute=recompute,
        recompute_modules=modules if recompute == "selective" else (),
        precision="fp8" if fp8 and hw.fp8_tflops else "bf16",
        activation_fp8_input_store=store and not spec.glu_clamp,
        offload_fraction=fraction,
    )
    flash, t = hw.efficiency.flash_attention, par.micro_batch * par.seq_len / par.cp
    idle = dict.fromkeys(("gemm", "grouped_gemm", "attention", "kda", "elementwise"), 0.0)  # nothing hides it
    for kind in set(spec.layer_kinds()):
        st_ = layer_stats(spec, kind)
        kept = _layer_act(spec, replace(par, offload_fraction=0.0), st_, t, flash)[0]
        on_gpu = _layer_act(spec, par, st_, t, flash)[0]
        to_host, back = offload_seconds(spec, hw, par, st_, t, idle)
        assert to_host == back == pytest.approx((kept - on_gpu) / (hw.pcie_gbps * 1e9), rel=1e-12)


def test_folding_spans_tp_ranks_and_is_validated():
    # Qwen3-235B on H100 (NeMo): EP 32 over TP 2 x DP 16 with ETP 1
    par = ParallelConfig(
        tp=2,
        pp=8,
        ep=32,
        etp=1,
        dp=16,
        vpp=4,
        schedule="interleaved",
        seq_len=4096,
        global_batch_tokens=8192 * 4096,
        precision="fp8",
        recompute="selective",
    )
    assert simulate("qwen3-235b-a22b", H100, par, 256).feasible
    bad = simulate("qwen3-235b-a22b", H100, replace(par, etp=2), 256)
    assert not bad.feasible and "EP 32 x ETP 2" in bad.reason
    # expert weights split by EP x ETP: ETP 2 halves them against ETP 1 at the same EP
    a = rank_memory(load_model("qwen3-235b-a22b"), H100, replace(par, ep=16, etp=1), 0)
    b = rank_memory(load_model("qwen3-235b-a22b"), H100, replace(par, ep=16, etp=2), 0)
    assert b["params"] < a["params"]


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(1, 16), m_per=st.integers(1, 16), v=st.integers(1, 6))
def test_steady_fraction_in_unit_interval_and_grows_with_micro_batches(pp, m_per, v):
    sched = "interleaved" if v > 1 else "1f1b"
    m = pp * m_per
    par = ParallelConfig(pp=pp, vpp=v, schedule=sched, dp=1, seq_len=8, global_batch_tokens=8 * m)
    more = replace(par, global_batch_tokens=16 * m)
    assert 0.0 <= steady_fraction(par) <= steady_fraction(more) <= 1.0


def test_a2a_overlap_hides_ep_and_reports_fraction():
    off = simulate(DSV3, H100, BASE, 1024)
    on = simulate(DSV3, H100, replace(BASE, moe_a2a_overlap=True), 1024)
    assert off.ep_overlap["overlapped_fraction"] == 0.0 and off.ep_overlap["model"] == "none"
    assert 0.0 < on.ep_overlap["overlapped_fraction"] <= 1.0 and on.breakdown["ep"] < off.breakdown["ep"]
    assert on.ep_overlap["raw_s"] == off.ep_overlap["raw_s"]


def test_node_dedup_and_group_limited_routing():
    tiers = cluster_tiers(1024, H100, ClusterSpec())
    eight_nodes = group(64, 1, tiers)
    free = node_dedup(replace(DSV3, expert_groups=0, groups_per_token=0), eight_nodes)
    limited = node_dedup(DSV3, eight_nodes)
    assert 0.0 < limited < free < 1.0
    assert node_dedup(DSV3, group(8, 1, tiers)) == 1.0  # one node: nothing leaves it


def test_peak_memory_of_published_deepseek_fits():
    rank, mem = peak_memory(DSV3, H100, replace(BASE, recompute_modules=("mla_up_proj",)))
    assert sum(mem.values()) / 2**30 < H100.hbm_gib


@settings(max_examples=40, deadline=None)
@given(pp=st.sampled_from([1, 2, 4, 8]), m_per=st.integers(1, 6), v=st.integers(1, 4))
def test_a2a_overlap_runs_one_forward_ahead_without_more_activations(pp, m_per, v):
    """Megatron's combined 1F1B: one more warm-up forward per rank (PP 1: the first forward runs alone, so
    (m - 1) / m of the passes are paired), and no more activations alive at the peak than without it."""
    sched = "interleaved" if v > 1 else "1f1b"
    if pp == 1 and v > 1:
        return
    m = pp * m_per
    off = ParallelConfig(pp=pp, vpp=v, schedule=sched, ep=2, dp=2, seq_len=8, global_batch_tokens=16 * m)
    on = replace(off, moe_a2a_overlap=True)
    for r in range(pp):
        total = m * v
        assert on.warmup_passes(r) == min(total, off.warmup_passes(r) + 1)
        assert inflight_chunks(on, r) == inflight_chunks(off, r)
    if pp == 1:
        assert steady_fraction(on) == pytest.approx((m - 1) / m) and steady_fraction(off) == 1.0


def test_a2a_overlap_refuses_what_megatron_refuses():
    qwen = load_model("qwen3-30b-a3b")
    par = ParallelConfig(pp=2, ep=4, dp=4, seq_len=4096, global_batch_tokens=64 * 4096, moe_a2a_overlap=True)
    assert "PP 1 or the interleaved schedule" in infeasible_reason(qwen, H100, par, 8)
    assert infeasible_reason(qwen, H100, replace(par, vpp=2, schedule="interleaved"), 8) is None
    flat = replace(par, pp=1, dp=8)
    assert infeasible_reason(qwen, H100, flat, 8) is None
    assert "full recompute" in infeasible_reason(qwen, H100, replace(flat, recompute="full"), 8)
    assert "EP > 1" in infeasible_reason(qwen, H100, replace(flat, ep=1), 8)
    assert "EP > 1" in infeasible_reason(load_model("llama3-8b"), H100, replace(flat, ep=1), 8)


@settings(max_examples=25, deadline=None)
@given(sms=st.integers(0, 100))
def test_comm_sms_slow_only_the_compute_beside_the_overlapped_all_to_all(sms):
    """The SMs EP kernels hold cost the overlapped compute ``sms / (132 - sms)`` of the hidden time (132 SMs on
    an H100): more SMs, more exposed time; the all-to-all's own time does not change."""
    on = replace(BASE, moe_a2a_overlap=True)
    free, held = (
        simulate(DSV3, H100, replace(on, ep_comm_sms=0), 1024),
        simulate(DSV3, H100, replace(on, ep_comm_sms=sms), 1024),
    )
    more = simulate(DSV3, H100, replace(on, ep_comm_sms=sms + 10), 1024)
    alone = simulate(DSV3, H100, BASE, 1024)
    assert free.breakdown["ep"] <= held.breakdown["ep"] <= more.breakdown["ep"]
    assert (held.breakdown["ep"] > free.breakdown["ep"]) == (sms > 0)
    assert held.breakdown["gemm"] == free.breakdown["gemm"]  # the compute itself is unchanged: the EP term carries it
    assert alone.ep_overlap["raw_s"] == held.ep_overlap["raw_s"]
    assert "EP communication SMs 132" in (infeasible_reason(DSV3, H100, replace(on, ep_comm_sms=132), 1024) or "")


def test_a2a_overlap_hides_behind_the_whole_compute_stream():
    """The paired all-to-all hides behind everything on the compute stream, the MoE layer's fixed work (sync gaps,
    bookkeeping kernels) included: on Qwen3-235B's 256-H100 recipe (EP 32 over four nodes, the all-to-all longer
    than the layer's GEMMs) a larger fixed cost leaves less EP exposed, so the step grows by less than it adds."""
    row = next(r for r in PUBLISHED if r.model == "qwen3-235b-a22b" and r.system == "h100")
    spec, par = published_model(row), replace(published_config(row), ep_comm_sms=0)

    def run(fixed: float):
        hw = replace(H100, efficiency=replace(H100.efficiency, moe_layer_fixed_s=fixed))
        return simulate(spec, hw, par, row.gpus)

    lo, hi = run(0.0), run(0.004)
    added = hi.breakdown["moe_fixed"] - lo.breakdown["moe_fixed"]
    assert added > 0 and hi.breakdown["ep"] < lo.breakdown["ep"]
    assert hi.step_time_s - lo.step_time_s < added


def test_shared_expert_overlap_hides_ep_behind_the_shared_experts_only():
    """Megatron's ``moe_shared_expert_overlap``: the shared experts' GEMMs run beside each pass's all-to-all, so
    ``max(0, ep - shared GEMMs)`` stays exposed; the all-to-all and the GEMMs themselves do not change, and a model
    without shared experts (Qwen3) is unaffected, as in Megatron."""
    par = replace(BASE, dispatcher="classic", tp=1, pp=8, vpp=1, schedule="1f1b", dp=128)
    tiers = cluster_tiers(1024, H100, ClusterSpec())
    moe = [i for i, k in enumerate(DSV3.layer_kinds()) if k[1] == "moe"][:1]
    off = chunk_cost(DSV3, H100, par, moe, tiers)
    on = chunk_cost(DSV3, H100, replace(par, shared_expert_overlap=True), moe, tiers)
    sf, sb = shared_expert_seconds(DSV3, roof_for(H100, "fp8"), float(par.micro_batch * par.seq_len), 1)
    assert on.fwd["ep"] == pytest.approx(max(0.0, off.fwd["ep"] - sf), rel=1e-9) and on.fwd["ep"] < off.fwd["ep"]
    assert on.bwd["ep"] == pytest.approx(max(0.0, off.bwd["ep"] - sb), rel=1e-9)
    assert on.ep_raw_fwd == off.ep_raw_fwd and on.fwd["gemm"] == off.fwd["gemm"]
    assert simulate(DSV3, H100, replace(par, shared_expert_overlap=True), 1024).ep_overlap["model"] == "shared experts"
    qwen, q_par = load_model("qwen3-235b-a22b"), replace(par, ep=8)
    plain = simulate(qwen, H100, q_par, 1024)
    flagged = simulate(qwen, H100, replace(q_par, shared_expert_overlap=True), 1024)
    assert flagged.step_time_s == plain.step_time_s and flagged.ep_overlap["model"] == "none"


@pytest.mark.parametrize(
    "change, named",
    [
        ({"moe_a2a_overlap": True}, "moe_a2a_overlap"),
        ({"dispatcher": "moonep"}, "moonep"),
        ({"recompute_modules": ("shared_experts",)}, "shared_experts"),
    ],
)
def test_shared_expert_overlap_refuses_what_megatron_refuses(change, named):
    with pytest.raises(ValueError, match=named):
        replace(BASE, **{"dispatcher": "classic", "shared_expert_overlap": True, **change})


def test_shared_expert_overlap_flag_reaches_the_model_and_its_refusal_is_one_line(tmp_path, capsys):
    """DeepSeek-V3's 25.11 B200 recipe (PP 16 x EP 8, the all-to-all dispatcher with ``moe_shared_expert_overlap``;
    superseded in the validation table by the 26.04.01 row of the same GPUs) from the CLI."""
    from moonep.console import main  # the CLI entry point, as a user runs it

    newer = next(r for r in PUBLISHED if r.model == "deepseek-v3" and r.system == "b200")
    row = replace(newer, gbs=2048, pp=16, vp=1, ep=8, dispatcher="classic", shared_expert_overlap=True,
                  moe_a2a_overlap=False, cuda_graph="none", recompute_modules=("mla_up_proj",))  # fmt: skip
    out = tmp_path / "r.json"
    assert main(["simulate", "run", *cli_args(row), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["ep_overlap"]["model"] == "shared experts"
    assert main(["simulate", "run", *cli_args(row), "--moe-a2a-overlap"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "moe_a2a_overlap" in err[0]
