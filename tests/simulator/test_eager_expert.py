"""Megatron's eager expert path for biased, clamped experts (gpt-oss): the bytes ``simulator.layers`` charges are
the ones megatron-core's own code moves, and ``fused_expert_mlp`` (TE's op-fuser) is what removes them.

The byte counter sums, for every ATen op that is not a view, the sizes of the tensors it reads and writes, over
the forward and over autograd's backward of ``TEGroupedMLP._apply_bias`` (FC2's bias, per expert) and of
``weighted_bias_quick_geglu_impl`` with and without its clamp (the difference is the clamp's share)."""

import warnings
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from simulator.analytic import simulate
from simulator.hardware import load_hardware
from simulator.hf_config import from_hf_config
from simulator.layers import EAGER_BIAS_BYTES, EAGER_CLAMP_BYTES, eager_expert_bytes
from simulator.modelspec import ModelSpec
from simulator.published import ROWS
from simulator.specs import load_model
from simulator.validation import published_config, published_model
from tests.simulator.hf_moe_config_data import GPT_OSS_120B


class _Bytes(TorchDispatchMode):
    """Bytes read and written by the non-view ATen ops run under it."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func is not torch.ops.aten.detach.default:
            flat = tree_flatten((args, kwargs or {}))[0] + tree_flatten(out)[0]
            self.total += sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        return out


def _fwd_bwd_bytes(fn, inputs, grad) -> tuple[int, int]:
    with _Bytes() as fwd:
        out = fn(*inputs)
    with _Bytes() as bwd:
        out.backward(grad)
    return fwd.total, bwd.total


@pytest.fixture(scope="module")
def megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.fusions import fused_bias_geglu
        from megatron.core.transformer.moe.experts import TEGroupedMLP
    return TEGroupedMLP, fused_bias_geglu


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 700), min_size=1, max_size=16).filter(lambda c: sum(c) >= 16 * len(c)),
    h=st.sampled_from([64, 384]),
)
def test_bias_bytes_are_the_ones_megatron_moves(megatron, counts, h):
    """Any split of the routed copies over the local experts (empty experts included), any width."""
    grouped_mlp, _ = megatron
    n = sum(counts)
    g = torch.Generator().manual_seed(0)
    out = torch.randn(n, h, generator=g, dtype=torch.bfloat16, requires_grad=True)
    bias = [torch.randn(h, generator=g, dtype=torch.bfloat16, requires_grad=True) for _ in counts]
    probs = torch.rand(n, 1, generator=g, requires_grad=True)
    fwd, bwd = _fwd_bwd_bytes(
        grouped_mlp._apply_bias,
        (out, bias, list(counts), probs),
        torch.randn(n, h, generator=g).bfloat16(),
    )
    assert fwd / (n * h) == pytest.approx(EAGER_BIAS_BYTES[0], rel=0.05)
    assert bwd / (n * h) == pytest.approx(EAGER_BIAS_BYTES[1], rel=0.05)


def test_clamp_bytes_are_the_ones_megatron_moves(megatron):
    _, geglu = megatron
    n, f = 4096, 384
    counted = {}
    for clamp in (7.0, None):
        g = torch.Generator().manual_seed(1)
        fc1 = torch.randn(n, 2 * f, generator=g, dtype=torch.bfloat16, requires_grad=True)
        probs = torch.rand(n, 1, generator=g, requires_grad=True)
        grad = torch.randn(n, f, generator=g).bfloat16()
        with torch._dynamo.config.patch(disable=True):  # megatron-core compiles the activation; run it eagerly
            counted[clamp] = _fwd_bwd_bytes(
                lambda x, p, c=clamp: geglu.weighted_bias_quick_geglu_impl(x, None, p, False, 1.0, c),
                (fc1, probs),
                grad,
            )
    fwd, bwd = (a - b for a, b in zip(counted[7.0], counted[None]))
    assert fwd / (n * 2 * f) == pytest.approx(EAGER_CLAMP_BYTES[0], rel=0.05)
    assert bwd / (n * 2 * f) == pytest.approx(EAGER_CLAMP_BYTES[1], rel=0.05)


def test_only_biased_or_clamped_experts_pay():
    oss = load_model("gpt-oss-120b")
    assert oss.expert_bias and oss.glu_clamp == 7.0
    fwd, bwd, redo = eager_expert_bytes(oss)
    assert fwd == 28 * 2880 + 8 * 5760 and bwd == 40 * 2880 + 15 * 5760 and redo == 8 * 5760
    assert eager_expert_bytes(load_model("deepseek-v3")) == (0.0, 0.0, 0.0)
    assert eager_expert_bytes(replace(oss, expert_bias=False))[0] == 8 * 5760


def _run(row, **overrides):
    par = replace(published_config(row), **overrides)
    return simulate(published_model(row), row.system, par, row.gpus)


@pytest.mark.parametrize("model", ["gpt-oss-120b", "deepseek-v3"])
def test_the_op_fuser_removes_exactly_the_eager_bytes(model):
    """On a published recipe, fusing the experts takes off the eager bytes of every routed copy, forward and
    backward (and the recomputed clamp with ``moe_act`` recompute), and nothing else; a model without expert
    biases or clamp is unchanged."""
    row = next(r for r in ROWS if r.model == model and r.system == "b200")
    eager, fused = _run(row, fused_expert_mlp=False), _run(row, fused_expert_mlp=True)
    par, spec, hw = published_config(row), published_model(row), load_hardware(row.system)
    fwd, bwd, redo = eager_expert_bytes(spec)
    moe_layers = sum(k[1] == "moe" for k in spec.layer_kinds()) / par.pp
    copies = par.micro_batches * moe_layers * par.micro_batch * par.seq_len * spec.top_k / par.tp
    per_byte = copies / (hw.hbm_tbps * 1e12 * hw.efficiency.hbm)
    if model == "deepseek-v3":  # no expert bias, no clamp
        assert (fwd, bwd, redo) == (0.0, 0.0, 0.0) and eager.step_time_s == fused.step_time_s
        return
    assert par.pp == 1 and par.recomputes("moe_act")  # the recipe: one stage, moe_act recomputed
    diff = {k: eager.breakdown[k] - fused.breakdown[k] for k in ("elementwise", "recompute", "gemm", "ep")}
    assert diff["elementwise"] == pytest.approx(per_byte * (fwd + bwd), rel=1e-9, abs=1e-12)
    assert diff["recompute"] == pytest.approx(per_byte * redo, rel=1e-9, abs=1e-12)
    assert diff["gemm"] == diff["ep"] == 0.0
    assert eager.step_time_s > fused.step_time_s


def test_hf_config_reads_the_clamp_and_refuses_a_bad_one():
    spec = from_hf_config(GPT_OSS_120B)
    assert spec.expert_bias and spec.glu_clamp == 7.0
    assert not from_hf_config({**GPT_OSS_120B, "swiglu_limit": None}).glu_clamp
    for bad in ("7", -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="swiglu_limit"):
            from_hf_config({**GPT_OSS_120B, "swiglu_limit": bad})
    with pytest.raises(ValueError, match="glu_clamp"):
        replace(spec, glu_clamp=-1.0)
    assert isinstance(ModelSpec.__dataclass_fields__["glu_clamp"].default, float)
