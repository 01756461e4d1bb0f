"""Out-of-sample checks: published runs the simulator was never fitted to, each priced with its recipe's settings.

The validation rows (``simulator.published``) set the five fitted constants and carry the acceptance figures;
these do neither. They are the runs a user would bring: other models (the Nemotron 3 hybrids), other recipes of
the validated models (Megatron-Bridge's model verification cards, 50-step runs whose last ten steps are
averaged) and another framework's runs (Meta's Llama 3 405B, from its paper). Each check is the ``moonep
simulate run`` flags of its run, so the README's table (``python -m simulator.out_of_sample``) reproduces command
by command, and ``tests/simulator/test_out_of_sample.py`` keeps the README equal to what the model says today.
"""

from __future__ import annotations

from dataclasses import dataclass

from moonep_base import build_parser
from simulator.analytic import simulate
from simulator.cli import register
from simulator.cli_input import setup
from simulator.layers import model_flops_per_token

CARD = "card"
"""Megatron-Bridge's ``examples/model_verification_cards/<name>/card.yaml`` (``pretrain_performance``)."""
TABLE = "table"
"""Megatron-Bridge's performance summary (``docs/performance-summary*.md``), the release's section."""


@dataclass(frozen=True)
class Check:
    """One published run and the flags that describe it."""

    flags: tuple[str, ...]
    """``moonep simulate run`` flags (model, hardware and layout included)."""
    measured: float
    """Published tokens/s/GPU (a card's is its step time's: GBS x sequence / step / GPUs), or TFLOP/s/GPU where
    ``tflops``."""
    source: str
    """Where the number and the settings come from."""
    tflops: bool = False
    """``measured`` is model TFLOP/s/GPU (a source that gives no tokens/s), read as Megatron's causal count
    (``layers.model_flops_per_token(causal=True)``) to compare it in tokens/s."""
    over_memory: str = ""
    """Why the simulator's peak is above the GPU for a run that fit on it (the README says more); empty: it fits."""


_NANO = ("--model", "nemotron-3-nano", "--gpus", "8", "--ep", "8", "--etp", "1", "--seq-len", "8192")
_NANO += ("--global-batch-tokens", str(512 * 8192), "--precision", "fp8", "--dispatcher", "deepep")
_NANO += ("--main-grads-dtype", "bf16", "--recompute", "none", "--cuda-graph", "modules")
_LLAMA3 = ("--model", "llama3-405b", "--hardware", "h100", "--tp", "8", "--pp", "16", "--vpp", "8", "--schedule")
_LLAMA3 += ("interleaved", "--pp-first-layers", "0", "--pp-last-layers", "0", "--global-batch-tokens", str(2**24))
_LLAMA3 += ("--micro-batch", "1", "--precision", "bf16", "--recompute", "none", "--zero", "2", "--grad-reduce")
_LLAMA3 += ("microbatch", "--main-grads-dtype", "fp32")
_LLAMA3_SOURCE = "Llama 3 paper (arXiv 2407.21783) Table 4 (TFLOP/s/GPU as tokens/s)"
_SUPER = ("--model", "nemotron-3-super", "--gpus", "64", "--precision", "bf16", "--micro-batch", "1")
_SUPER += ("--dispatcher", "deepep", "--mtp-layers", "2", "--etp", "1")

CHECKS = (
    Check(
        ("--model", "nemotron-3-nano", "--hardware", "h100", "--gpus", "16", "--ep", "8", "--etp", "1")
        + ("--micro-batch", "1", "--seq-len", "8192", "--global-batch-tokens", str(1024 * 8192), "--precision")
        + ("fp8", "--dispatcher", "deepep", "--recompute", "selective", "--main-grads-dtype", "bf16")
        + ("--recompute-modules", "moe,layernorm,core_attn,moe_act"),
        14719,
        f"{TABLE} 26.06",
    ),
    Check(_NANO + ("--hardware", "b200", "--micro-batch", "2"), 32768, f"{TABLE} 26.04.01"),
    Check(_NANO + ("--hardware", "gb200", "--micro-batch", "2"), 33522, f"{TABLE} 26.06"),
    Check(_NANO + ("--hardware", "b300", "--micro-batch", "4"), 37316, f"{TABLE} 26.06"),
    Check(_NANO + ("--hardware", "gb300", "--micro-batch", "4"), 39936, f"{TABLE} 26.08"),
    Check(
        _SUPER
        + ("--hardware", "h100", "--pp", "2", "--ep", "32", "--no-sequence-parallel", "--seq-len", "4096")
        + ("--global-batch-tokens", str(1280 * 4096), "--moe-capacity-factor", "1.1")
        + ("--moe-pad-expert-input-to-capacity", "--recompute", "selective", "--recompute-modules")
        + ("layernorm,moe_act,moe,core_attn", "--main-grads-dtype", "bf16", "--moment-dtype", "bf16"),
        2969.345,
        f"{CARD} nemotron-3-super-120b-a12b, 2026-08-03",
    ),
    Check(
        _SUPER
        + ("--hardware", "gb200", "--tp", "2", "--ep", "64", "--seq-len", "8192", "--recompute", "none")
        + ("--global-batch-tokens", str(512 * 8192), "--main-grads-dtype", "bf16", "--cuda-graph", "modules")
        + ("--ep-comm-sms", "32"),
        512 * 8192 / 64 / 9.92635,
        f"{CARD} nemotron-3-super-120b-a12b, 2026-07-24 (natural routing)",
    ),
    Check(
        ("--model", "qwen3-30b-a3b", "--hardware", "h100", "--gpus", "16", "--ep", "16", "--etp", "1")
        + ("--precision", "bf16", "--seq-len", "4096", "--global-batch-tokens", str(1024 * 4096), "--micro-batch")
        + ("1", "--recompute", "none", "--dispatcher", "deepep", "--main-grads-dtype", "fp32", "--cuda-graph")
        + ("modules", "--moe-a2a-overlap", "--ep-comm-sms", "32"),
        13011.378,
        f"{CARD} qwen3-30b-a3b, recipe 3a9559f01",
    ),
    Check(
        ("--model", "deepseek-v3", "--hardware", "h100", "--gpus", "1024", "--tp", "2", "--pp", "8", "--vpp", "4")
        + ("--schedule", "interleaved", "--ep", "64", "--etp", "1", "--precision", "bf16", "--seq-len", "4096")
        + ("--global-batch-tokens", str(16384 * 4096), "--micro-batch", "1", "--recompute", "selective")
        + ("--recompute-modules", "mla_up_proj,mlp", "--dispatcher", "deepep", "--main-grads-dtype", "bf16")
        + ("--moment-dtype", "bf16", "--mtp-layers", "1", "--pp-first-layers", "1", "--pp-last-layers", "0"),
        1061.206,
        f"{CARD} deepseek-v3, 2026-08-15",
    ),
    Check(
        _LLAMA3 + ("--gpus", "8192", "--seq-len", "8192"),
        430,
        f"{_LLAMA3_SOURCE}, 8K sequences",
        tflops=True,
        over_memory="Megatron's interleaved warm-up (N = PP) keeps 141 one-layer passes on rank 1; Meta's own "
        "schedule and its freeing of stage inputs and outputs are not modelled",
    ),
    Check(_LLAMA3 + ("--gpus", "16384", "--seq-len", "8192"), 400, f"{_LLAMA3_SOURCE}, 8K sequences", tflops=True),
    Check(
        _LLAMA3 + ("--gpus", "16384", "--seq-len", "131072", "--cp", "16"),
        380,
        f"{_LLAMA3_SOURCE}, 128K sequences",
        tflops=True,
    ),
)


def predict(check: Check) -> dict:
    """The simulator's answer for ``check``: predicted tokens/s/GPU, its error against the published number,
    peak memory and feasibility."""
    args = build_parser([register], "moonep").parse_args(["simulate", "run", *check.flags])
    spec, hw, cluster, par = setup(args)
    res = simulate(spec, hw, par, args.gpus, cluster)
    measured = check.measured
    if check.tflops:
        measured = check.measured * 1e12 / model_flops_per_token(spec, par.seq_len, causal=True)
    return {
        "model": args.model,
        "hardware": args.hardware,
        "arch": hw.arch,
        "family": "MoE" if spec.is_moe else "dense",
        "gpus": args.gpus,
        "precision": args.precision,
        "source": check.source,
        "measured": measured,
        "predicted": res.tokens_per_s_per_gpu,
        "error": res.tokens_per_s_per_gpu / measured - 1.0,
        "memory_gib": res.memory_gib_per_gpu,
        "feasible": res.feasible,
    }


def format_table(rows: list[dict]) -> str:
    """Markdown table (the README's)."""
    lines = [
        "| model | hardware | GPUs | precision | source | published tok/s/GPU | predicted | error | GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['hardware']} | {r['gpus']} | {r['precision']} | {r['source']} | "
            f"{r['measured']:.0f} | {r['predicted']:.0f} | {r['error']:+.1%} | {r['memory_gib']:.1f} |"
        )
    for arch in ("hopper", "blackwell"):
        for family in ("MoE", "dense"):
            errors = [r["error"] for r in rows if (r["arch"], r["family"]) == (arch, family)]
            if errors:
                lines.append(
                    f"\n{arch.capitalize()} {family}: {len(errors)} runs, MAE "
                    f"{sum(map(abs, errors)) / len(errors):.1%}, errors {min(errors):+.1%} to {max(errors):+.1%}"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table([predict(c) for c in CHECKS]))
    for c in CHECKS:
        print("moonep simulate run " + " ".join(c.flags))
