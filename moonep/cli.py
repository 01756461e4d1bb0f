"""The moonep package's own commands: bench target ``ep`` (``moonep bench ep``, ``python -m moonep bench ep``).

argparse and ``moonep_base`` (standard library only) are the only imports at module level, so ``moonep --help``
stays fast; the handler imports the rest. The console script that gathers every package lives in ``moonep.console``.
"""

from __future__ import annotations

import argparse
import sys

from moonep_base import write_json  # k3/train.py imports it from here too (k3 sits above moonep)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def register(commands, bench) -> None:
    p = bench.add_parser("ep", help="MoonEP layer vs the classic all-to-all dispatcher over maxvio")
    p.add_argument("--world-size", type=int, default=4, help="local ranks (default 4)")
    p.add_argument("--maxvio", default="0,1,2,4,8", help="comma-separated maxvio targets")
    p.add_argument("--backend", default="torch", choices=["torch", "mpi"])
    p.add_argument("--quick", action="store_true", help="tiny shapes, one iteration (schema checks)")
    p.add_argument(
        "--balance",
        default="cost",
        help="ours: 'cost' (a CostModel measured on the ranks chooses σ per step, up to --max-slack), "
        "'exact' (σ = 0), or a fixed slack σ such as 0.1 (default cost)",
    )
    p.add_argument("--max-slack", type=float, default=0.5, help="largest σ the cost choice may take (default 0.5)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plot", help="write a time-vs-maxvio plot (PNG) here")
    p.set_defaults(func=handler)


def parse_maxvios(text: str) -> list[float]:
    """``--maxvio`` "0,1,2" -> [0.0, 1.0, 2.0]; ValueError naming a value that is not a finite number >= 0."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"--maxvio: {part!r} is not a number (give e.g. 0,1,2,4,8)") from None
        if not 0 <= v < float("inf"):
            raise ValueError(f"--maxvio: {part} must be a finite number >= 0")
        out.append(v)
    if not out:
        raise ValueError("--maxvio: no value given (give e.g. 0,1,2,4,8)")
    return out


def handler(args: argparse.Namespace) -> int:
    from moonep import bench  # heavy: torch; --help stays light

    try:
        if args.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
        maxvios = parse_maxvios(args.maxvio)
        balance = bench.parse_balance(args.balance, args.max_slack)
    except ValueError as e:
        print(f"moonep bench ep: {e}", file=sys.stderr)
        return 2
    report = bench.run(args.world_size, maxvios, quick=args.quick, backend=args.backend, balance=balance)
    print(report["note"])
    print(
        f"{'maxvio':>6} {'cap':>6} {'ours rows':>9} {'base rows':>9} {'σ':>5} {'copies':>6} {'ours ms':>8} "
        f"{'base ms':>8} {'ratio':>6} {'vs flat':>7} {'busy ratio':>10}  fwd stages ms (dispatch/expert/combine) "
        f"ours | base; ours push/reduce ms"
    )
    for e in report["results"]:

        def stages(who: str, e: dict = e) -> str:
            return "/".join(f"{e[f'{who}_{s}_s'] * 1e3:.1f}" for s in ("dispatch", "expert", "combine"))

        print(
            f"{e['maxvio']:>6g} {e['cap']:>6} {e['ours_max_rows']:>9} {e['baseline_max_rows']:>9} "
            f"{e['ours_slack']:>5.3f} {e['ours_replicas']:>6} {e['ours_layer_s'] * 1e3:>8.2f} "
            f"{e['baseline_layer_s'] * 1e3:>8.2f} {e['ratio']:>6.2f} {_ratio(e['ratio_vs_classic_flat']):>7} "
            f"{e['busy_ratio']:>10.2f}  {stages('ours')} | {stages('baseline')}; "
            f"{e['ours_push_s'] * 1e3:.1f}/{e['ours_reduce_s'] * 1e3:.1f}"
        )
    print(f"ours over the sweep, max / min: {report['ours_max_over_min']:.2f}")
    if not any(e["maxvio"] == 0 for e in report["results"]):
        print("vs flat: needs maxvio 0 in --maxvio (the classic dispatcher without skew is the yardstick)")
    if args.json:
        write_json(args.json, report)
    if args.plot:
        bench.plot(report, args.plot)
    return 0
