"""The job assumptions ``moonep simulate run`` and ``search`` used, and where each came from (a flag or a default):
printed above the result and written into its JSON as ``assumptions``, so a plan never hides its sequence length,
batch, precision, gradient reduction, DP overlap or FLOP convention."""

from __future__ import annotations

import os

from simulator.hardware import HardwareSpec
from simulator.modelspec import ModelSpec
from simulator.parallel import ParallelConfig
from simulator.specs import PRESETS


class Default(str):
    """A flag's default value (argparse keeps it as given: ``isinstance(args.x, Default)`` = the flag was not
    passed); compares and prints as the plain string."""

    __slots__ = ()


DEFAULT_BATCH_TOKENS = 2**24
"""``--global-batch-tokens`` default: 16M tokens, or one sequence per GPU when that is more (``cli_input``)."""
FLOPS = (
    "model FLOPs = 3 x forward (no recompute): 2 x the weights a token touches (LM head included) + core attention "
    "2 x heads x (d_qk + d_v) per query-key pair; tflops/MFU count every pair (full square, Korthikanti et al. "
    "2022), the 'causal' lines half of them (Megatron-LM); a sliding window caps the keys; MFU is against the "
    "dense bf16 peak whatever the precision"
)


def _model_source(arg: str) -> str:
    if str(arg).lower() in PRESETS or not os.path.exists(str(arg)):  # a preset wins over a folder of that name
        return f"preset {arg!r}"
    return f"file {os.path.basename(str(arg))} ({os.path.dirname(os.path.abspath(str(arg)))})"


def assumptions(args, spec: ModelSpec, par: ParallelConfig, hw: HardwareSpec) -> dict:
    """What the job assumed, each ``{"value": ..., "from": "flag --x" | "default: ..."}`` (JSON-ready)."""
    seq, tokens = par.seq_len, par.global_batch_tokens
    seqs = tokens / seq
    batch_from = (
        "flag --global-batch-tokens"
        if args.global_batch_tokens
        else f"default: max({DEFAULT_BATCH_TOKENS:,} tokens, seq_len x GPUs)"
    )
    precision = getattr(args, "precision", par.precision)
    return {
        "model": {"value": spec.name, "from": f"--model: {_model_source(args.model)}"},
        "seq_len": {
            "value": seq,
            "from": "flag --seq-len" if args.seq_len else f"default: the model's ({spec.seq_len})",
        },
        "global_batch": {
            "tokens": tokens,
            "sequences": int(seqs) if seqs == int(seqs) else seqs,
            "from": batch_from,
        },
        "precision": {
            "value": str(precision),
            "from": f"default ({precision})" if isinstance(precision, Default) else "flag --precision",
        },
        "gradient_reduction": {
            "value": "every micro-batch" if par.reduces_every_microbatch else "once a step",
            "from": f"flag --grad-reduce {par.grad_reduce}"
            if par.grad_reduce != "auto"
            else f"default: with --zero {par.zero_stage}, {'sharded' if par.zero_stage >= 2 else 'unsharded'} "
            "gradients",
        },
        "dp_overlap": _dp_overlap(par, hw),
        "flop_convention": FLOPS,
    }


def _dp_overlap(par: ParallelConfig, hw: HardwareSpec) -> dict:
    """Which DP collectives the compute may hide (Megatron's two overlap switches, where the hardware's efficiency
    set overlaps DP at all)."""
    if not hw.efficiency.dp_overlap:
        return {"value": "none", "from": f"hardware {hw.name}: its efficiency set (dp_overlap 0) hides no DP traffic"}
    switches = {"grad reduce": par.overlap_grad_reduce, "param gather": par.overlap_param_gather}
    on = [name for name, hidden in switches.items() if hidden]
    off = [f"--no-overlap-{name.replace(' ', '-')}" for name, hidden in switches.items() if not hidden]
    return {
        "value": " + ".join(on) or "none",
        "from": "flag " + " ".join(off) if off else "default: both, as Megatron-Bridge's recipes set them",
    }


def format_assumptions(a: dict) -> str:
    """Two lines for the human output."""
    b = a["global_batch"]
    return (
        f"assumptions: model {a['model']['value']} ({a['model']['from']}); seq_len {a['seq_len']['value']} "
        f"({a['seq_len']['from']}); global batch {b['tokens']:,} tokens = {b['sequences']} sequences "
        f"({b['from']}); precision {a['precision']['value']} ({a['precision']['from']}); gradients reduced "
        f"{a['gradient_reduction']['value']} ({a['gradient_reduction']['from']}); DP overlap "
        f"{a['dp_overlap']['value']} ({a['dp_overlap']['from']})\n"
        f"FLOP convention: {a['flop_convention']}"
    )
