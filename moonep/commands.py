"""The moonep package's own commands for ``moonep.cli``: bench target ``ep``. argparse-only imports here."""
from __future__ import annotations

import argparse


def register(commands, bench) -> None:
    p = bench.add_parser("ep", help="MoonEP layer vs the classic all-to-all dispatcher over maxvio")
    p.add_argument("--world-size", type=int, default=4, help="local ranks (default 4)")
    p.add_argument("--maxvio", default="0,1,2,4,8", help="comma-separated maxvio targets")
    p.add_argument("--backend", default="torch", choices=["torch", "mpi"])
    p.add_argument("--quick", action="store_true", help="tiny shapes, one iteration (schema checks)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plot", help="write a time-vs-maxvio plot (PNG) here")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from . import bench
    from .cli import write_json

    maxvios = [float(v) for v in args.maxvio.split(",") if v.strip()]
    report = bench.run(args.world_size, maxvios, quick=args.quick, backend=args.backend)
    print(report["note"])
    print(f"{'maxvio':>6} {'cap':>6} {'ours rows':>9} {'base rows':>9} {'ours ms':>8} {'base ms':>8} {'ratio':>6} "
          f"{'busy ratio':>10}  fwd stages ms (dispatch/expert/combine) ours | base")
    for e in report["results"]:
        stages = lambda who: "/".join(f"{e[f'{who}_{s}_s'] * 1e3:.1f}" for s in ("dispatch", "expert", "combine"))  # noqa: E731
        print(f"{e['maxvio']:>6g} {e['cap']:>6} {e['ours_max_rows']:>9} {e['baseline_max_rows']:>9} "
              f"{e['ours_layer_s'] * 1e3:>8.2f} {e['baseline_layer_s'] * 1e3:>8.2f} {e['ratio']:>6.2f} "
              f"{e['busy_ratio']:>10.2f}  {stages('ours')} | {stages('baseline')}")
    if args.json:
        write_json(args.json, report)
    if args.plot:
        bench.plot(report, args.plot)
    return 0
