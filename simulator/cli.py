"""``moonep simulate run | search | whatif | calibrate`` (also ``python -m simulator simulate ...``).

The cost model is imported at module level (``import simulator`` loads it anyway: it is numbers only); the
calibration, which imports torch, only in its handler, so ``--help`` loads no torch.

Exit status: 0 feasible, 1 infeasible for memory (the reason is printed and in the JSON), 2 bad input: a flag or
file, or a layout whose sizes do not factor (``feasibility.infeasible_reason``: divisibility, a schedule the layout
cannot run, FP8 on hardware without it).
"""

from __future__ import annotations

import argparse
import json
import sys

from moonep_base import write_json
from simulator.analytic import simulate
from simulator.assumptions import Default, assumptions, format_assumptions
from simulator.cli_input import (
    UsageError,
    check_layout,
    check_sizes,
    choice_list,
    int_list,
    load_saying_warnings,
    parse_links,
    parse_slow,
    setup,
    speed_args,
)
from simulator.layers import RECOMPUTE_MODES
from simulator.memory import GIB, inference_memory
from simulator.parallel import RECOMPUTE_MODULES, SCHEDULES
from simulator.report import format_result, format_search, write_plots
from simulator.saved_bytes import format_table, measured, side_by_side
from simulator.search import SearchSpace, search
from simulator.specs import load_model
from simulator.whatif import whatif


def register(commands, bench) -> None:
    p = commands.add_parser(
        "simulate",
        help="capacity planning: step time, memory, MFU and cost of a training job",
        description="Analytic and event-level simulator of MoE/dense training on GPU clusters.",
    )
    sub = p.add_subparsers(dest="simulate_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda args: _usage(p))
    _register_run(sub)
    _register_search(sub)
    _register_whatif(sub)
    _register_calibrate(sub)
    _register_saved_bytes(sub)


def _register_run(sub) -> None:
    run = sub.add_parser("run", help="predict one configuration (table; --json for the stable JSON)")
    _model_args(run)
    _parallel_args(run)
    run.add_argument("--engine", choices=("analytic", "event"), default="analytic", help="which engine times it")
    run.add_argument("--plots", metavar="DIR", help="write timeline, memory and maxvio plots (+ JSON) here")
    run.add_argument(
        "--inference-context",
        type=int,
        metavar="TOKENS",
        help="also report inference memory per GPU at this context length",
    )
    run.add_argument("--inference-batch", type=int, default=1, help="sequences for --inference-context")
    run.add_argument("--json", metavar="FILE", help="write the result as JSON")
    run.set_defaults(func=_run)


def _register_search(sub) -> None:
    se = sub.add_parser("search", help="rank feasible parallel layouts by tokens/s/GPU")
    _model_args(se)
    _job_args(se)
    se.add_argument("--schedules", default="1f1b,interleaved,dualpipe", help="comma list of schedules to try")
    se.add_argument("--recompute-modes", default="selective,selective+act,full", help="comma list")
    se.add_argument("--micro-batches", default="1,2", help="comma list of micro-batch sizes")
    se.add_argument("--top", type=int, default=20, help="rows to keep")
    se.add_argument("--event-top", type=int, default=3, help="re-run this many best on the event engine")
    se.add_argument("--max-seconds", type=float, help="stop enumerating after this long")
    se.add_argument("--json", metavar="FILE", help="write the ranked results as JSON")
    speed_args(se)
    se.set_defaults(func=_search)


def _register_whatif(sub) -> None:
    wi = sub.add_parser("whatif", help="step-time impact of slow GPUs and degraded links")
    _model_args(wi)
    _parallel_args(wi)
    wi.add_argument(
        "--slow",
        action="append",
        default=[],
        metavar="RANK=FACTOR",
        help="GPU RANK's kernels take FACTOR x longer (repeatable)",
    )
    wi.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="WHO=FACTOR",
        help="RANK:nic=0.5, RANK:nvlink=0.5 or leaf:I=0.5 (bandwidth factor; repeatable)",
    )
    wi.add_argument("--engine", choices=("analytic", "event"), default="event")
    wi.add_argument("--json", metavar="FILE", help="write the result as JSON")
    wi.set_defaults(func=_whatif)


def _register_calibrate(sub) -> None:
    ca = sub.add_parser("calibrate", help="measure GEMM, attention, copy and all-to-all; write a hardware profile")
    ca.add_argument("--world-size", type=int, default=2, help="local ranks for the all-to-all (1 skips it)")
    ca.add_argument("--backend", choices=("torch", "mpi"), default="torch")
    ca.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke run)")
    ca.add_argument(
        "--model",
        default=None,
        help="measure GEMM, framework ops and KDA at this model's sizes "
        "(preset or config.json; default: the k3-tiny shapes)",
    )
    ca.add_argument("--seq-len", type=int, default=None, help="sequence length for --model (default: the model's)")
    ca.add_argument("--micro-batch", type=int, default=1, help="sequences per rank for --model")
    ca.add_argument("--out", "--json", dest="out", default="hardware_profile.json", help="profile JSON to write")
    ca.set_defaults(func=_calibrate)


def _register_saved_bytes(sub) -> None:
    sb = sub.add_parser(
        "saved-bytes",
        help="saved bytes per token per layer by module: the simulator's, beside a measured k3-memory report",
    )
    sb.add_argument("--model", default="k3", help="preset, config.json or HF model folder (default k3)")
    sb.add_argument("--measured", metavar="FILE", help="a 'moonep bench k3-memory --json' report to put beside")
    sb.add_argument("--json", metavar="FILE", help="write the table as JSON")
    sb.set_defaults(func=_saved_bytes)


def _saved_bytes(args) -> int:
    try:
        spec = load_saying_warnings(load_model, args.model)
        rows = measured(args.measured) if args.measured else None
    except ValueError as exc:
        print(f"moonep simulate saved-bytes: {exc}", file=sys.stderr)
        return 2
    table = side_by_side(spec, rows, name=args.model)
    print(format_table(table))
    if args.json:
        write_json(args.json, table)
    return 0


def _usage(p) -> int:
    p.print_help(sys.stderr)
    return 2


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="k3",
        help="preset (k3, kimi-k2, deepseek-v3, llama3-405b, gpt3-175b, "
        "gpt-22b/175b/530b/1t), a config.json / ModelSpec JSON, or an HF model folder",
    )
    p.add_argument(
        "--hardware", default="h200", help="a100, h100, h800, h200, b200, gb200, b300, gb300 or a hardware JSON"
    )
    p.add_argument(
        "--mtp-layers", type=int, help="multi-token-prediction modules trained (default: the model's, e.g. HF config)"
    )
    mtp_help = "the MTP depths share one module's weights (Megatron's mtp_use_repeated_layer; default: the model's)"
    p.add_argument("--mtp-repeated-layer", action=argparse.BooleanOptionalAction, help=mtp_help)
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--topology", choices=("rail", "fat-tree"), default="rail", help="scale-out network")
    p.add_argument("--oversubscription", type=float, default=1.0, help="leaf-to-spine oversubscription")
    p.add_argument("--nodes-per-leaf", type=int, default=32, help="nodes per leaf / rail scalable unit")


def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=int, help="sequence length (default: the model's)")
    p.add_argument("--global-batch-tokens", type=int, help="tokens per step (default 16M or seq x GPUs)")
    p.add_argument("--precision", choices=("bf16", "fp8"), default=Default("bf16"))
    p.add_argument(
        "--dispatcher",
        choices=("moonep", "classic", "deepep"),
        default="moonep",
        help="MoE dispatch: moonep, classic all-to-all, deepep (one copy per destination node)",
    )
    p.add_argument("--maxvio", type=float, default=0.0, help="routing skew (busiest EP rank / mean - 1)")
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument(
        "--grad-reduce",
        choices=("auto", "step", "microbatch"),
        default="auto",
        help="DP gradient reduction: once a step (Megatron DDP, FSDP no_sync) or after every micro-batch (FSDP, "
        "Megatron-FSDP, DeepSpeed ZeRO-2/3); auto: every micro-batch when --zero >= 2",
    )


def _parallel_args(p: argparse.ArgumentParser) -> None:
    _job_args(p)
    for flag in ("--tp", "--pp", "--ep", "--cp"):
        p.add_argument(flag, type=int, default=1)
    p.add_argument("--dp", type=int, help="data parallel size (default GPUs / (TP CP PP))")
    p.add_argument("--vpp", type=int, default=1, help="virtual stages per rank (interleaved schedule)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--recompute", choices=("none", "selective", "selective+act", "full"), default="selective")
    p.add_argument("--schedule", choices=("1f1b", "interleaved", "dualpipe"), default="1f1b")
    p.add_argument("--no-sequence-parallel", action="store_true", help="TP without sequence parallelism")
    p.add_argument(
        "--etp", type=int, default=0, help="expert tensor parallel size (0: = TP); EP x ETP folds over TPxCPxDP"
    )
    p.add_argument(
        "--recompute-modules",
        default="",
        metavar="M1,M2",
        help="extra recomputed modules (Megatron names): " + ", ".join(RECOMPUTE_MODULES),
    )
    p.add_argument("--activation-dtype", choices=("auto", "bf16", "fp8"), default="auto", help="saved GEMM inputs")
    p.add_argument("--offload-fraction", type=float, default=0.0, help="share of saved activations sent to host")
    p.add_argument(
        "--pp-first-layers", type=int, help="layers of the first model chunk (default even; 0: embedding only)"
    )
    p.add_argument("--pp-last-layers", type=int, help="layers of the last model chunk (default even; 0: LM head only)")
    p.add_argument(
        "--microbatch-group",
        type=int,
        default=0,
        help="contiguous micro-batches N per virtual stage, in [PP, micro-batches] (0: PP; interleaved only)",
    )
    p.add_argument("--moe-capacity-factor", type=float, default=0.0, help="token-dropping capacity (0: dropless)")
    p.add_argument(
        "--moe-pad-expert-input-to-capacity", action="store_true", help="pad each expert's input to its capacity"
    )
    p.add_argument("--moment-dtype", choices=("fp32", "bf16"), default="fp32", help="Adam m and v")
    p.add_argument("--main-grads-dtype", choices=("fp32", "bf16"), default="fp32", help="gradient buffer")
    p.add_argument(
        "--attn-res-impl",
        choices=("moonep", "release"),
        default="moonep",
        help="what a Block AttnRes mix keeps (moonep: sources by reference; release: fp32 stacks)",
    )
    p.add_argument(
        "--moe-probs",
        choices=("swiglu", "combine"),
        default="swiglu",
        help="where routing probabilities multiply (swiglu: inside the activation; combine: expert outputs kept)",
    )
    p.add_argument(
        "--attn-out-cache",
        choices=("bf16", "e5m6", "fp8"),
        default="bf16",
        help="dtype of the one cached copy of the attention output (DeepSeek-V3: e5m6)",
    )
    p.add_argument(
        "--activation-fp8-input-store",
        action="store_true",
        help="keep SwiGLU inputs in fp8 for the backward (Megatron activation_func_fp8_input_store; DeepSeek-V3)",
    )
    speed_args(p)


def _usage_error(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 2


def _run(args) -> int:
    try:
        spec, hw, cluster, par = setup(args)
        check_layout(spec, hw, par, args.gpus)
    except UsageError as exc:
        return _usage_error(exc)
    res = simulate(spec, hw, par, args.gpus, cluster, engine=args.engine)
    out = _clean(res.to_dict())
    out["assumptions"] = assumptions(args, spec, par, hw)
    print(format_assumptions(out["assumptions"]))
    if args.inference_context is not None:
        inf = inference_memory(spec, batch=args.inference_batch, context=args.inference_context, tp=par.tp, ep=par.ep)
        out["inference_memory_gib"] = {k: (v / GIB if "per_" not in k else v) for k, v in inf.items()}
    print(format_result(res))
    if res.feasible and args.plots:
        for path in write_plots(spec, hw, par, args.gpus, res, args.plots, cluster).values():
            print(f"wrote {path}")
    if args.json:
        write_json(args.json, out)
        print(f"wrote {args.json}")
    return 0 if res.feasible else 1


def _clean(d: dict) -> dict:
    """NaN is not JSON: write null."""
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in d.items()}


def _search(args) -> int:
    try:
        spec, hw, cluster, base = setup(args)
        space = SearchSpace(
            schedules=choice_list("--schedules", args.schedules, SCHEDULES),
            recompute=choice_list("--recompute-modes", args.recompute_modes, RECOMPUTE_MODES),
            micro_batch=int_list("--micro-batches", args.micro_batches),
        )
    except UsageError as exc:
        return _usage_error(exc)
    except ValueError as exc:
        return _usage_error(UsageError(str(exc)))
    report = search(
        spec, hw, args.gpus, base, cluster, space, top=args.top, event_top=args.event_top, max_seconds=args.max_seconds
    )
    report["results"] = [_clean(r) for r in report["results"]]
    report["assumptions"] = assumptions(args, spec, base, hw)
    print(format_assumptions(report["assumptions"]))
    print(format_search(report))
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0 if report["feasible"] else 1


def _whatif(args) -> int:
    try:
        spec, hw, cluster, par = setup(args)
        check_layout(spec, hw, par, args.gpus)
        slow = parse_slow(args.slow, par)
        links = parse_links(args.link, par, hw.gpus_per_node, cluster)
    except UsageError as exc:
        return _usage_error(exc)
    out = whatif(spec, hw, par, args.gpus, cluster, rank_slowdown=slow, links=links, engine=args.engine)
    print(json.dumps(out, indent=2))
    if args.json:
        write_json(args.json, out)
    return 0 if out.get("feasible") else 1


def _calibrate(args) -> int:
    from simulator.calibrate import CalibrationSizes, calibrate  # heavy: torch, kept out of --help

    try:
        check_sizes(args)  # --world-size 0 ran a 1-rank calibration; --seq-len 0 fell back to the model's own
        if not args.model and (args.seq_len is not None or args.micro_batch != 1):
            raise ValueError("--seq-len and --micro-batch size a --model's calibration: pass --model too")
        sizes = (
            CalibrationSizes.from_model(args.model, args.seq_len, args.micro_batch)
            if args.model
            else CalibrationSizes()
        )
    except (ValueError, OSError) as exc:
        return _usage_error(exc)
    profile = calibrate(world_size=args.world_size, quick=args.quick, backend=args.backend, sizes=sizes)
    m = profile["measured"]
    print(
        f"{profile['name']}: GEMM {m['gemm_tflops']:.3f} TFLOP/s, attention {m['attention_tflops']:.3f} "
        f"TFLOP/s, copy {m['copy_tbps'] * 1e3:.1f} GB/s, all-to-all {m['all_to_all_gbps_per_rank']:.2f} "
        f"GB/s per rank ({m['world_size']} ranks)"
    )
    if profile["host"]:
        h = profile["host"]
        print(
            f"host: {h['op_fwd_us']:.1f}/{h['op_bwd_us']:.1f} us per forward/backward op at {h['ref_elements']} "
            f"elements, KDA call {h['kda_us'] / 1e3:.2f} ms, all-to-all call {h['a2a_call_us']:.0f} us, "
            f"{h['effective_cores']:.2f} effective cores for {h['ranks']} ranks ({h['cores']} cores)"
        )
    write_json(args.out, profile)
    print(f"wrote {args.out} (use it as --hardware {args.out})")
    return 0
