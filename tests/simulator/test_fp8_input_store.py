"""``activation_fp8_input_store`` (Megatron ``activation_func_fp8_input_store``, DeepSeek-V3's FP8 SwiGLU-input
cache): the bytes megatron-core's own SwiGLU keeps with it, the terms the simulator halves, the casts it prices,
the models Megatron refuses it for, and DeepSeek-V3's 2048-H800 run fitting with the techniques its report states."""

import warnings
from dataclasses import replace

import pytest
import torch

from moonep.console import main
from simulator.act_terms import GLU_INPUTS
from simulator.analytic import simulate
from simulator.calibrate_activations import SavedCounter
from simulator.costs import _layer
from simulator.hardware import load_hardware
from simulator.layers import layer_stats
from simulator.memory import saved_bytes_per_token
from simulator.network import ClusterSpec, cluster_tiers
from simulator.parallel import ParallelConfig
from simulator.specs import load_model

PAR = ParallelConfig(seq_len=4096, global_batch_tokens=4096 * 8, recompute="none")
DSV3_RUN = ParallelConfig(
    pp=16,
    ep=64,
    dp=128,
    seq_len=4096,
    global_batch_tokens=15360 * 4096,
    precision="fp8",
    schedule="dualpipe",
    dispatcher="deepep",
    recompute="selective",
    recompute_modules=("mla_up_proj", "layernorm", "moe_act"),
    attn_out_cache="e5m6",
    moment_dtype="bf16",
    pp_first_layers=3,
    pp_last_layers=2,
)
"""DeepSeek-V3's pre-training (report section 3): DualPipe over PP 16, EP 64 over 8 nodes, ZeRO-1, no TP, 15360
x 4096-token sequences, FP8, RMSNorm and MLA up-projection recomputed, SwiGLU output recomputed from its cached
input, the attention output cached in E5M6, BF16 Adam moments, one MTP module on the rank that holds embedding and
head. The split of the 61 layers is not stated: the three dense layers first, two layers and the MTP module last."""


@pytest.fixture(scope="module")
def swiglu():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl, weighted_bias_swiglu_impl
    return bias_swiglu_impl, weighted_bias_swiglu_impl


def _kept_per_element(fn, store: bool, rows: int = 48, width: int = 2 * 80) -> float:
    """Bytes megatron-core's SwiGLU keeps per element of its ``[rows, 2F]`` input (its probabilities left out)."""
    x = torch.randn(rows, width, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(rows, 1, requires_grad=True)
    # megatron-core wraps the elementwise math in torch.compile; eager runs the same autograd Function (what it
    # saves is its ctx.save_for_backward, outside the compiled helpers) without ~20 s of inductor on CPU
    with torch._dynamo.config.patch(disable=True):
        with SavedCounter([probs]) as saved:
            out = fn(x, probs, store)
        out.float().sum().backward()  # the saved input (fp8 or not) is what the backward reads
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    return sum(saved.bytes.values()) / x.numel()


@pytest.mark.parametrize("weighted", [False, True])
def test_megatron_keeps_one_byte_per_input_element(swiglu, weighted):
    plain, with_probs = swiglu
    fn = (lambda x, p, s: with_probs(x, None, p, s)) if weighted else (lambda x, p, s: plain(x, None, s))
    assert _kept_per_element(fn, False) == 2.0
    assert _kept_per_element(fn, True) == 1.0


@pytest.mark.parametrize("model,kind", [("deepseek-v3", ("mla", "moe")), ("deepseek-v3", ("mla", "dense"))])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_swiglu_inputs_and_nothing_else_halve(model, kind, precision):
    """Dense FFN, routed and shared experts; in bf16 and fp8 runs alike (fp8 GEMMs leave SwiGLU inputs in bf16)."""
    spec = load_model(model)
    st = layer_stats(spec, kind)
    par = replace(PAR, precision=precision)
    stored = replace(par, activation_fp8_input_store=True)
    glu = sum(t.nbytes for t in st.act_terms if t.name in GLU_INPUTS)
    assert glu > 0
    before, after = saved_bytes_per_token(spec, par, st, True), saved_bytes_per_token(spec, stored, st, True)
    assert before - after == pytest.approx(glu / 2)


def test_recomputed_swiglu_input_is_not_also_halved():
    """``mlp`` recompute drops the dense SwiGLU input whatever its dtype."""
    spec = load_model("deepseek-v3")
    st = layer_stats(spec, ("mla", "dense"))
    par = replace(PAR, recompute_modules=("mlp",))
    assert saved_bytes_per_token(spec, par, st, True) == saved_bytes_per_token(
        spec, replace(par, activation_fp8_input_store=True), st, True
    )


def test_the_casts_cost_three_bytes_per_element_each_way():
    spec, hw = load_model("deepseek-v3"), load_hardware("h800")
    par = ParallelConfig(ep=8, dp=8, seq_len=4096, global_batch_tokens=4096 * 64, precision="fp8")
    tiers = cluster_tiers(8, hw, ClusterSpec())
    kind, t = ("mla", "moe"), 4096.0
    base = _layer(spec, hw, par, kind, t, tiers, 1.0, (1.0, 1.0, 1.0))
    cast = _layer(spec, hw, replace(par, activation_fp8_input_store=True), kind, t, tiers, 1.0, (1.0, 1.0, 1.0))
    glu = sum(x.nbytes for x in layer_stats(spec, kind).act_terms if x.name in GLU_INPUTS) / 2
    per_pass = t * glu * 3.0 / (hw.hbm_tbps * 1e12 * hw.efficiency.hbm)
    for i in (0, 1):
        moved = {k for k in base[i] if base[i][k] != cast[i][k]}
        assert moved == {"elementwise"}
        assert cast[i]["elementwise"] - base[i]["elementwise"] == pytest.approx(per_pass)


@pytest.mark.parametrize("model", ["gpt-oss-120b", "gpt3-175b"])
def test_models_without_swiglu_are_refused(capsys, model):
    """gpt-oss' clamped GEGLU and GPT-3's GeLU: Megatron raises; so does the CLI, one line naming the flag."""
    args = ["simulate", "run", "--model", model, "--hardware", "h100", "--gpus", "64", "--tp", "8"]
    assert main([*args, "--activation-fp8-input-store"]) == 2
    err = capsys.readouterr().err
    assert "--activation-fp8-input-store" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("first,last", [(3, 2), (None, None)])
def test_deepseek_v3_report_run_fits_only_with_its_fp8_swiglu_cache(first, last):
    """With the split guessed above and with the even one (rank 0: stage 0's 3 dense layers, 16 micro-batches in
    flight, and stage 15's 4 MoE layers with the MTP module and the logits, 1: ``simulator.inflight``)."""
    spec = replace(load_model("deepseek-v3"), mtp_layers=1)
    run = replace(DSV3_RUN, pp_first_layers=first, pp_last_layers=last)
    without = simulate(spec, "h800", run, 2048)
    stored = simulate(spec, "h800", replace(run, activation_fp8_input_store=True), 2048)
    assert stored.feasible, stored.reason
    assert not without.feasible and "out of memory" in without.reason
    assert stored.memory_gib_per_gpu < without.memory_gib_per_gpu
