"""Command-line input of ``moonep simulate``: the flags turned into a checked job (model, hardware, cluster,
parallel layout), or a ``UsageError`` naming the flag; the what-if perturbations and search lists parsed and
checked the same way. ``simulator.cli`` prints a ``UsageError`` as one line with exit status 2."""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from dataclasses import replace

from simulator.feasibility import infeasible_reason
from simulator.hardware import load_hardware
from simulator.modelspec import MAX_SIZE, MAX_TOKENS
from simulator.network import ClusterSpec
from simulator.parallel import ParallelConfig
from simulator.specs import load_model
from simulator.whatif import TIERS, check_link, check_slowdown


class UsageError(ValueError):
    """Bad input (a flag, a model or hardware file): one line on stderr, exit status 2."""


_POSITIVE = ("gpus", "tp", "pp", "ep", "cp", "dp", "vpp", "micro_batch", "seq_len", "global_batch_tokens", "top")
_NON_NEGATIVE = ("etp", "pp_first_layers", "pp_last_layers", "microbatch_group", "mtp_layers")
_NUMBERS = {"maxvio": 0, "oversubscription": 1, "offload_fraction": 0, "moe_capacity_factor": 0}
"""Float flags and their floors: finite and >= the floor (argparse's float() takes inf and nan)."""


def check_sizes(args) -> None:
    """Every size flag is in range, named as on the command line (argparse takes ``--tp -2`` as an int, and
    ``--gpus 10**20`` too, which would be priced as such)."""
    sizes = _POSITIVE + ("nodes_per_leaf", "event_top", "inference_batch", "inference_context", "world_size")
    for name in sizes + _NON_NEGATIVE:
        v = getattr(args, name, None)
        floor = 0 if name == "event_top" or name in _NON_NEGATIVE else 1
        if v is not None and v < floor:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {floor}, got {v}")
        top = MAX_TOKENS if name == "global_batch_tokens" else MAX_SIZE
        if v is not None and v > top:
            raise UsageError(f"--{name.replace('_', '-')} must be <= {top}, got {v}")
    for name, floor in _NUMBERS.items():
        v = getattr(args, name, None)
        if v is not None and not (math.isfinite(v) and v >= floor):
            raise UsageError(f"--{name.replace('_', '-')}: must be a finite number >= {floor}, got {v}")
    v = getattr(args, "max_seconds", None)
    if v is not None and not (math.isfinite(v) and v > 0):
        raise UsageError(f"--max-seconds: must be a finite number > 0, got {v}")


def load_saying_warnings(load, name):
    """``load(name)``, with what the loader warns about (an HF config's unread expert fields, an expert width
    taken by convention) printed as one ``warning:`` line each on stderr; its errors propagate."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = load(name)
    for w in said:
        print(f"warning: {w.message}", file=sys.stderr)
    return out


def _load(args):
    """(model spec, hardware); a bad preset name or file is a ``UsageError``."""
    try:
        spec = load_saying_warnings(load_model, args.model)
        hw = load_saying_warnings(load_hardware, args.hardware)
        if getattr(args, "mtp_layers", None) is not None:
            spec = replace(spec, mtp_layers=args.mtp_layers)
        if getattr(args, "mtp_repeated_layer", None) is not None:
            if args.mtp_repeated_layer and not spec.mtp_layers:
                raise ValueError(f"--mtp-repeated-layer: {spec.name} trains no MTP module (give --mtp-layers N)")
            spec = replace(spec, mtp_repeated=args.mtp_repeated_layer)
    except (ValueError, OSError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    return spec, hw


def setup(args):
    """(model spec, hardware, cluster, parallel config) from the flags; raises ``UsageError``."""
    check_sizes(args)
    spec, hw = _load(args)
    try:
        return _build(args, spec, hw)
    except UsageError:
        raise
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_layout(spec, hw, par: ParallelConfig, gpus: int) -> None:
    """A layout given in full on the command line whose sizes do not factor is bad input (exit 2), not an answer:
    only memory makes a well-formed layout infeasible (exit 1). ``search`` keeps such layouts as skipped counts."""
    reason = infeasible_reason(spec, hw, par, gpus)
    if reason:
        raise UsageError(f"the layout cannot run: {reason}")


def _build(args, spec, hw):
    cluster = ClusterSpec(
        topology=args.topology, oversubscription=args.oversubscription, nodes_per_leaf=args.nodes_per_leaf
    )
    seq = args.seq_len or spec.seq_len
    gbt = args.global_batch_tokens or max(2**24, seq * args.gpus)
    if not hasattr(args, "tp"):
        return (
            spec,
            hw,
            cluster,
            ParallelConfig(
                seq_len=seq,
                global_batch_tokens=gbt,
                precision=args.precision,
                dispatcher=args.dispatcher,
                maxvio=args.maxvio,
                zero_stage=args.zero,
                grad_reduce=args.grad_reduce,
                **_speed_knobs(args),
            ),
        )
    denom = args.tp * args.cp * args.pp
    if args.dp is None and args.gpus % denom:
        raise UsageError(
            f"--gpus {args.gpus} is not a multiple of TP x CP x PP = {args.tp}x{args.cp}x{args.pp} = {denom}"
        )
    dp = args.dp if args.dp is not None else args.gpus // denom
    if denom * dp != args.gpus:
        raise UsageError(
            f"--dp {dp}: TP x CP x PP x DP = {args.tp}x{args.cp}x{args.pp}x{dp} = {denom * dp} != --gpus {args.gpus}"
        )
    par = _parallel(args, dp, seq, gbt)
    if (par.tp * par.cp * par.dp) % (par.ep * par.expert_tp):
        raise UsageError(
            f"--ep {par.ep} x ETP {par.expert_tp} does not divide TP x CP x DP = {par.tp}x{par.cp}x{par.dp} "
            f"= {par.tp * par.cp * par.dp} (the ranks experts fold over)"
        )
    return spec, hw, cluster, par


def speed_args(p: argparse.ArgumentParser) -> None:
    """Recipe knobs that change time only: EP and DP overlap (and the SMs the EP kernels hold), CUDA graphs, FP8
    attention (``run``, ``whatif`` and ``search`` share them; ``_speed_knobs`` maps them to fields)."""
    p.add_argument(
        "--moe-a2a-overlap", action="store_true", help="overlap EP all-to-all with another micro-batch's compute"
    )
    p.add_argument(
        "--moe-shared-expert-overlap",
        action="store_true",
        help="run the shared experts beside the EP all-to-all (Megatron moe_shared_expert_overlap)",
    )
    p.add_argument(
        "--ep-comm-sms",
        type=int,
        default=20,
        help="SMs the EP dispatch/combine kernels hold, lost to the overlapped compute (DeepEP 20, HybridEP 32)",
    )
    p.add_argument(
        "--cuda-graph",
        choices=("none", "modules", "full"),
        default="none",
        help="modules: TE graphs of attention, router and MoE preprocessing (the dropless host sync stays); "
        "full: one CUDA graph per step (Megatron full_iteration; no host sync or launch gaps)",
    )
    p.add_argument("--fp8-attention", action="store_true", help="core attention in FP8 (fp8_dot_product_attention)")
    p.add_argument(
        "--fused-expert-mlp",
        action="store_true",
        help="experts as TE op-fuser grouped ops (use_transformer_engine_op_fuser): expert biases and the "
        "activation clamp cost nothing extra (default: Megatron's eager path, which pays for them)",
    )
    on = {"action": argparse.BooleanOptionalAction, "default": True}  # Megatron-LM's command line leaves both off
    p.add_argument(
        "--overlap-grad-reduce", **on, help="hide DP gradient buckets behind the backward (overlap_grad_reduce; on)"
    )
    p.add_argument(
        "--overlap-param-gather",
        **on,
        help="hide the DP parameter all-gather behind the forward (overlap_param_gather; on)",
    )


def _speed_knobs(args) -> dict:
    """``ParallelConfig`` fields of the ``speed_args`` flags."""
    return {
        "overlap_grad_reduce": args.overlap_grad_reduce,
        "overlap_param_gather": args.overlap_param_gather,
        "moe_a2a_overlap": args.moe_a2a_overlap,
        "shared_expert_overlap": args.moe_shared_expert_overlap,
        "ep_comm_sms": args.ep_comm_sms,
        "cuda_graph": args.cuda_graph,
        "fp8_attention": args.fp8_attention,
        "fused_expert_mlp": args.fused_expert_mlp,
    }


def _parallel(args, dp: int, seq: int, gbt: int) -> ParallelConfig:
    return ParallelConfig(
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        cp=args.cp,
        dp=dp,
        vpp=args.vpp,
        micro_batch=args.micro_batch,
        global_batch_tokens=gbt,
        seq_len=seq,
        recompute=args.recompute,
        zero_stage=args.zero,
        grad_reduce=args.grad_reduce,
        schedule=args.schedule,
        dispatcher=args.dispatcher,
        maxvio=args.maxvio,
        precision=args.precision,
        sequence_parallel=not args.no_sequence_parallel,
        etp=args.etp,
        recompute_modules=tuple(m for m in args.recompute_modules.split(",") if m),
        activation_dtype=args.activation_dtype,
        offload_fraction=args.offload_fraction,
        pp_first_layers=args.pp_first_layers,
        pp_last_layers=args.pp_last_layers,
        moment_dtype=args.moment_dtype,
        main_grads_dtype=args.main_grads_dtype,
        attn_res_impl=args.attn_res_impl,
        moe_probs=args.moe_probs,
        attn_out_cache=args.attn_out_cache,
        activation_fp8_input_store=args.activation_fp8_input_store,
        **_speed_knobs(args),
        microbatch_group=args.microbatch_group,
        capacity_factor=args.moe_capacity_factor,
        pad_to_capacity=args.moe_pad_expert_input_to_capacity,
    )


def int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise UsageError(f"{flag}: must be a comma list of integers >= 1, got {text!r}")
    return values


def choice_list(flag: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    values = tuple(text.split(","))
    bad = [v for v in values if v not in allowed]
    if bad:
        raise UsageError(f"{flag}: unknown {', '.join(map(repr, bad))}; known: {', '.join(allowed)}")
    return values


def parse_slow(items: list[str], par: ParallelConfig) -> dict[int, float]:
    """``--slow RANK=FACTOR`` items, each checked (rank in the job, factor finite >= 1)."""
    slow = {}
    for item in items:
        rank, _, factor = item.partition("=")
        try:
            rank, factor = int(rank), float(factor)
        except ValueError:
            raise UsageError(f"--slow {item}: expected RANK=FACTOR (an integer and a number)") from None
        try:
            check_slowdown(rank, factor, par.gpus)
        except ValueError as exc:
            raise UsageError(f"--slow {item}: {exc}") from None
        slow[rank] = factor
    return slow


def parse_links(items: list[str], par: ParallelConfig, gpus_per_node: int, cluster: ClusterSpec) -> list[dict]:
    """``--link RANK:TIER=FACTOR`` / ``leaf:I=FACTOR`` items, each checked against the job and the cluster."""
    links = []
    for item in items:
        who, _, factor = item.partition("=")
        a, _, b = who.partition(":")
        try:
            link = {"leaf": int(b)} if a == "leaf" else {"rank": int(a), "tier": b or "nic"}
            link["factor"] = float(factor)
        except ValueError:
            raise UsageError(
                f"--link {item}: expected RANK:TIER=FACTOR (TIER one of {', '.join(TIERS)}) or leaf:I=FACTOR"
            ) from None
        try:
            check_link(link, par, gpus_per_node, cluster)
        except ValueError as exc:
            raise UsageError(f"--link {item}: {exc}") from None
        links.append(link)
    return links
