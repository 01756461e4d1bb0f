"""Single-block hybrids (Nemotron-H, the Nemotron 3 family): layers that hold a mixer or an FFN, not both
(``ModelSpec.mixer_only_layers`` / ``ffn_only_layers``), 2-matrix squared-ReLU experts, and the Hugging Face
reader of ``hybrid_override_pattern`` / ``layers_block_type`` (``simulator.hf_layer_kinds``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from moonep.console import main
from simulator import ParallelConfig, simulate
from simulator.hardware import load_hardware
from simulator.hf_layer_kinds import PATTERN
from simulator.layers import layer_stats, param_counts
from simulator.memory import mtp_params, rank_memory
from simulator.modelspec import ModelSpec
from simulator.specs import from_hf_config
from tests.simulator.hf_moe_config_data import NEMOTRON_3_NANO as NANO
from tests.simulator.hf_moe_config_data import NEMOTRON_3_SUPER as SUPER
from tests.simulator.hf_moe_config_data import SUPER_ELEMENTS

H100 = load_hardware("h100")
BASE = {"name": "hybrid", "hidden": 2048, "vocab": 32000, "num_heads": 16, "num_kv_heads": 4, "seq_len": 4096}
MOE = {"num_experts": 64, "top_k": 4, "moe_ffn_hidden": 768, "num_shared_experts": 1}
MAMBA2 = {"mamba_heads": 32, "mamba_groups": 4, "mamba_d_state": 64, "mamba_inner_dim": 4096}


def _paired_and_split(n: int, mixers: str, ffn: str) -> tuple[ModelSpec, ModelSpec]:
    """``n`` layers of a mixer and an FFN, and the same model with each layer cut into a mixer-only layer followed
    by an FFN-only one (``mixers``: ``mamba`` / ``mha`` / ``alt`` alternating; ``ffn``: ``moe`` / ``dense``)."""
    extra = (MOE if ffn == "moe" else {}) | MAMBA2 | {"ffn_hidden": 1536}
    mamba = {"mamba": range(n), "mha": range(0), "alt": range(0, n, 2)}[mixers]
    paired = ModelSpec(**BASE, **extra, num_layers=n, mamba_layers=tuple(mamba))
    split = ModelSpec(
        **BASE,
        **extra,
        num_layers=2 * n,
        mamba_layers=tuple(2 * i for i in mamba),
        mixer_only_layers=tuple(range(0, 2 * n, 2)),
        ffn_only_layers=tuple(range(1, 2 * n, 2)),
        moe_layers=tuple(range(1, 2 * n, 2)) if ffn == "moe" else (),
    )
    return paired, split


@pytest.mark.parametrize(("mixers", "ffn"), [("alt", "moe"), ("mamba", "dense"), ("mha", "moe")])
@pytest.mark.parametrize(("pp", "tp"), [(1, 1), (2, 1), (1, 2)])
def test_cutting_each_layer_into_its_two_blocks_changes_nothing(mixers, ffn, pp, tp):
    """A layer's mixer and FFN as two single-block layers: the same weights, FLOPs, step time term by term and
    memory (a norm per block either way; the elementwise and TP terms split between the blocks)."""
    paired, split = _paired_and_split(8, mixers, ffn)
    assert param_counts(paired) == param_counts(split)
    ep = 4 if ffn == "moe" else 1
    dp = 8 // pp // tp
    par = ParallelConfig(pp=pp, ep=ep, etp=1 if ep > 1 else 0, dp=dp, tp=tp, micro_batch=1, seq_len=4096)
    par = replace(par, global_batch_tokens=64 * 4096, dispatcher="deepep", recompute="none")
    a, b = simulate(paired, H100, par, 8), simulate(split, H100, par, 8)
    assert a.feasible and b.feasible and (a.breakdown["tp"] > 0) == (tp > 1)
    assert b.step_time_s == pytest.approx(a.step_time_s, rel=1e-9)
    for key, value in a.breakdown.items():
        assert b.breakdown[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert b.memory_gib_per_gpu == pytest.approx(a.memory_gib_per_gpu, rel=1e-9)
    assert b.tflops_per_gpu == pytest.approx(a.tflops_per_gpu, rel=1e-9)


def test_squared_relu_experts_have_two_matrices():
    gated = ModelSpec(**BASE, **MOE, num_layers=2)
    plain = replace(gated, gated_experts=False)
    one = BASE["hidden"] * MOE["moe_ffn_hidden"]
    assert param_counts(gated).experts - param_counts(plain).experts == 2 * MOE["num_experts"] * one
    g, p = layer_stats(gated, ("mha", "moe")), layer_stats(plain, ("mha", "moe"))
    assert p.grouped_flops / g.grouped_flops == pytest.approx(2 / 3)
    act = {t.name: t.nbytes for t in p.act_terms}
    assert act["expert_act_in"] == 2 * MOE["top_k"] * MOE["moe_ffn_hidden"]  # squared ReLU keeps its [F] input


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"mixer_only_layers": (0,), "ffn_only_layers": (0,)}, "disjoint"),
        ({"mixer_only_layers": (9,)}, "below num_layers"),
        ({"ffn_only_layers": (0,), "mamba_layers": (0,)}, "ffn_only_layers must not be KDA or Mamba"),
        ({"mixer_only_layers": (1,), "ffn_only_layers": (0,), "moe_layers": (1,)}, "mixer_only_layers must not be MoE"),
        ({"mixer_only_layers": (0,), "ffn_only_layers": (1,)}, "moe_layers must name the MoE layers"),
    ],
)
def test_impossible_single_block_layouts_are_refused(change, named):
    with pytest.raises(ValueError, match=named):
        ModelSpec(**BASE, **MOE, **MAMBA2, ffn_hidden=1536, num_layers=4, **change)


def test_nemotron_3_nano_reads_as_published():
    """31.6B parameters in all and 3.2B active without the input embedding (3.6B with it), as NVIDIA states for the
    model; 23 Mamba-2, 23 MoE and 6 attention blocks, as its pattern says."""
    spec = from_hf_config(NANO)
    counts = param_counts(spec)
    assert counts.total == pytest.approx(31.6e9, rel=0.005)
    assert counts.active == pytest.approx(3.2e9, rel=0.02)
    assert counts.active + counts.embedding == pytest.approx(3.6e9, rel=0.02)
    kinds = spec.layer_kinds()
    assert (kinds.count(("mamba", "none")), kinds.count(("none", "moe")), kinds.count(("mha", "none"))) == (23, 23, 6)
    assert spec.mamba_inner == 64 * 64 and not spec.gated_experts and spec.router_bias


def test_the_pattern_and_the_block_list_are_one_model():
    """A published file's ``hybrid_override_pattern`` and transformers 5.x's ``layers_block_type`` (what its
    ``NemotronHConfig`` writes, without ``num_hidden_layers``) read as the same spec."""
    names = {"mamba": "linear_attention", "attention": "full_attention", "moe": "moe", "mlp": "mlp"}
    listed = [names[PATTERN[ch]] for ch in NANO["hybrid_override_pattern"]]
    other = {k: v for k, v in NANO.items() if k not in ("hybrid_override_pattern", "num_hidden_layers")}
    assert from_hf_config(other | {"layers_block_type": listed}) == from_hf_config(NANO)


def test_nemotron_3_nano_runs_from_its_config(tmp_path):
    """The published recipe's layout (8 GB300, EP 8, MXFP8, per-module graphs) from the CLI: feasible, every
    block priced (Mamba-2 scans in the recurrent channel, attention, experts, EP)."""
    path, out = tmp_path / "config.json", tmp_path / "r.json"
    path.write_text(json.dumps(NANO))
    args = ["simulate", "run", "--model", str(path), "--hardware", "gb300", "--gpus", "8", "--ep", "8", "--etp", "1"]
    args += ["--micro-batch", "4", "--seq-len", "8192", "--global-batch-tokens", str(512 * 8192)]
    args += ["--precision", "fp8", "--dispatcher", "deepep", "--recompute", "none", "--cuda-graph", "modules"]
    assert main([*args, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["feasible"] and all(res["breakdown"][k] > 0 for k in ("kda", "attention", "grouped_gemm", "ep"))


def test_nemotron_3_nano_h100_recipe_that_ran_is_feasible(tmp_path):
    """The 26.06 table's 16-H100 FP8 run (EP 8, one 8k sequence per micro-batch) recomputed what its recipe lists
    (Megatron-Bridge ``scripts/performance/configs/nemotronh/nemotron_3_workload_base_configs.py``: ``moe``,
    ``layernorm``, ``core_attn``, ``moe_act``; bf16 gradients, ``nemotron_3_llm_pretrain.py``'s
    ``grad_reduce_in_fp32 = False``). It ran, so the plan fits; Megatron's ``moe`` module (the whole MoE layer re-run)
    takes about a third of the activations off it, and costs recompute time."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(NANO))
    args = ["simulate", "run", "--model", str(path), "--hardware", "h100", "--gpus", "16", "--ep", "8", "--etp", "1"]
    args += ["--micro-batch", "1", "--seq-len", "8192", "--global-batch-tokens", str(1024 * 8192)]
    args += ["--precision", "fp8", "--dispatcher", "deepep", "--recompute", "selective", "--main-grads-dtype", "bf16"]
    runs = {}
    for modules in ("moe,layernorm,core_attn,moe_act", "layernorm,core_attn,moe_act"):
        out = tmp_path / f"{len(modules)}.json"
        main([*args, "--recompute-modules", modules, "--json", str(out)])
        runs[modules] = json.loads(out.read_text())
    ran, without = runs.values()
    assert ran["feasible"], ran["reason"]
    assert ran["memory_breakdown_gib"]["activations"] < 0.75 * without["memory_breakdown_gib"]["activations"]
    assert ran["breakdown"]["recompute"] > without["breakdown"]["recompute"]


def test_a_dense_pattern_builds_no_experts():
    """Nemotron-H's dense models (``M``, ``*`` and ``-`` blocks only) carry transformers' default expert fields,
    which build nothing there: a dense spec whose MLP blocks have two matrices."""
    dense = NANO | {"hybrid_override_pattern": "M-M-M*-M-", "num_hidden_layers": 9, "intermediate_size": 8192}
    spec = from_hf_config(dense)
    assert not spec.is_moe and spec.layer_kinds().count(("none", "dense")) == 4 and not spec.gated_ffn
    mlp = layer_stats(spec, ("none", "dense"))
    assert mlp.dense_params == 2 * NANO["hidden_size"] * 8192 + NANO["hidden_size"]  # up, down and the block's norm


def test_mtp_module_is_built_from_the_mtp_pattern():
    """Nemotron 3 Super's MTP module is an attention block and an MoE block (``mtp_hybrid_override_pattern``
    ``*E``), not one layer of the model's last kind (``E``): with both, the backbone and the module add up to the
    checkpoint's element count, and the module's attention is priced."""
    spec = from_hf_config(SUPER)
    assert spec.mtp_kinds() == (("mha", "none"), ("none", "moe"))
    last_kind = replace(spec, mtp_blocks="")
    assert last_kind.mtp_kinds() == (("none", "moe"),)
    total = param_counts(spec).total + sum(mtp_params(spec))
    assert abs(total / SUPER_ELEMENTS - 1) < 1e-5, total
    assert abs((param_counts(spec).total + sum(mtp_params(last_kind))) / SUPER_ELEMENTS - 1) > 1e-4
    par = ParallelConfig(pp=2, ep=32, dp=32, seq_len=4096, global_batch_tokens=4096 * 1280, recompute="selective")
    assert simulate(spec, H100, par).step_time_s > simulate(last_kind, H100, par).step_time_s


def test_repeated_mtp_depths_hold_one_module_of_weights():
    """Super's recipes train two depths of its one MTP module (``mtp_use_repeated_layer``, the Nemotron-H bridge's
    default): the second depth costs its time and activations, not a second module's weights, gradients and
    optimizer state; ``mtp_use_repeated_layer: false`` in the file gives two modules."""
    spec = from_hf_config(SUPER)
    assert spec.mtp_repeated and not from_hf_config(SUPER | {"mtp_use_repeated_layer": False}).mtp_repeated
    assert not from_hf_config(SUPER | {"num_nextn_predict_layers": 0}).mtp_repeated  # no module to repeat
    with pytest.raises(ValueError, match="mtp_use_repeated_layer"):
        from_hf_config(SUPER | {"mtp_use_repeated_layer": "yes"})
    shared, own = replace(spec, mtp_layers=2), replace(spec, mtp_layers=2, mtp_repeated=False)
    assert mtp_params(shared) == mtp_params(spec) and sum(mtp_params(own)) == 2 * sum(mtp_params(spec))
    par = ParallelConfig(pp=2, ep=32, dp=32, seq_len=4096, global_batch_tokens=4096 * 1280, recompute="selective")
    last = {s: rank_memory(s, H100, par, 1) for s in (spec, shared, own)}
    assert last[shared]["activations"] == last[own]["activations"] > last[spec]["activations"]
    for item in ("params", "grads", "optimizer"):
        assert last[spec][item] == last[shared][item] < last[own][item], item
    assert rank_memory(shared, H100, par, 0) == rank_memory(own, H100, par, 0)  # the first stage holds no MTP
    assert simulate(shared, H100, par).step_time_s > simulate(spec, H100, par).step_time_s


def test_the_cli_flag_overrides_the_file(tmp_path):
    """``--no-mtp-repeated-layer`` prices the card's two depths as two modules: more memory on the last stage,
    the same work (only the data-parallel reduction of the second module's gradients)."""
    job = ["simulate", "run", "--model", "nemotron-3-super", "--gpus", "64", "--hardware", "h100", "--pp", "2"]
    job += ["--ep", "32", "--etp", "1", "--seq-len", "4096", "--global-batch-tokens", "5242880", "--mtp-layers", "2"]
    job += ["--recompute", "selective", "--recompute-modules", "layernorm,moe_act,moe,core_attn"]
    out = {}
    for flag in ("--mtp-repeated-layer", "--no-mtp-repeated-layer", None):
        path = tmp_path / f"{flag}.json"
        assert main([*job, *([flag] if flag else []), "--json", str(path)]) == 0
        out[flag] = json.loads(path.read_text())
    shared, own = out["--mtp-repeated-layer"], out["--no-mtp-repeated-layer"]
    assert out[None]["memory_gib_per_gpu"] == shared["memory_gib_per_gpu"]  # the file's default: repeated
    assert shared["peak_memory_rank"] == own["peak_memory_rank"] == 1
    assert shared["memory_gib_per_gpu"] + 1 < own["memory_gib_per_gpu"]
    assert shared["tokens_per_s_per_gpu"] == pytest.approx(own["tokens_per_s_per_gpu"], rel=1e-3)  # less DP traffic


def test_mtp_blocks_read_from_the_transformers_5_list_too():
    listed = {k: v for k, v in SUPER.items() if k != "mtp_hybrid_override_pattern"}
    assert from_hf_config(listed | {"mtp_layers_block_type": ["full_attention", "moe"]}).mtp_blocks == "*E"
    assert from_hf_config(listed).mtp_blocks == ""  # none given: one layer of the last kind


@pytest.mark.parametrize(
    "field,value",
    [("mtp_hybrid_override_pattern", "*X"), ("mtp_hybrid_override_pattern", 7), ("mtp_layers_block_type", ["gdn"])],
)
def test_a_bad_mtp_pattern_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        from_hf_config({k: v for k, v in SUPER.items() if k != "mtp_hybrid_override_pattern"} | {field: value})


def test_a_dense_hybrid_without_mtp_ignores_transformers_default_mtp_blocks():
    """transformers 5.x writes ``mtp_layers_block_type = ["full_attention", "moe"]`` into every ``NemotronHConfig``,
    a dense one with no MTP module too: not a block to size."""
    dense = NANO | {"hybrid_override_pattern": "M-M*-", "num_hidden_layers": 5, "intermediate_size": 8192}
    spec = from_hf_config(dense | {"mtp_layers_block_type": ["full_attention", "moe"], "num_nextn_predict_layers": 0})
    assert not spec.is_moe and spec.mtp_layers == 0 and spec.mtp_blocks == ""


@pytest.mark.parametrize("blocks", ["*E", "M*", "*X"])
def test_mtp_blocks_the_model_cannot_size_are_refused(blocks):
    """A dense attention-only model has no expert or Mamba sizes for an MTP block of those."""
    assert ModelSpec(**BASE, num_layers=4, ffn_hidden=1536, mtp_layers=1, mtp_blocks="*-").mtp_kinds()
    with pytest.raises(ValueError, match="mtp_blocks"):
        ModelSpec(**BASE, num_layers=4, ffn_hidden=1536, mtp_layers=1, mtp_blocks=blocks)
