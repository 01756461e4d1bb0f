"""Command line of the planner: ``moonep plan ...`` and ``moonep bench planner ...``.

    moonep plan --ranks 8 --experts 64 --topk 8 --tokens 4096 --synthetic zipf:1.2 --plot plan.png --json plan.json
    moonep plan --load counts.json --nodes 2
    moonep bench planner --json out.json [--quick]

Only argparse and ``moonep_base`` (standard library) are imported at module level (``moonep --help`` stays fast);
handlers import the rest.
"""

from __future__ import annotations

import argparse
import json
import sys

from moonep_base import write_json


def register(commands, bench) -> None:
    """Add ``plan`` to ``commands`` and the ``planner`` target to ``bench`` (argparse sub-parser actions)."""
    p = commands.add_parser("plan", help="plan one MoE layer's step and show per-rank load before and after")
    p.add_argument("--ranks", type=int, help="EP ranks R (synthetic load; checked against --load)")
    p.add_argument("--experts", type=int, help="routed experts E, a multiple of R")
    p.add_argument("--topk", type=int, default=8, help="experts per token K (synthetic load)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank S (synthetic load)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", help='JSON file: [R, E] counts, or {"slots_per_expert": [R, E]}')
    src.add_argument(
        "--synthetic",
        help="zipf:SKEW (slot counts) or router:SKEW (counts of top-k lists, K distinct "
        "experts per token), e.g. router:1.2; hot experts shared by all ranks",
    )
    p.add_argument("--nodes", type=int, help="split the ranks into this many nodes: topology-aware plan")
    p.add_argument("--token-padding", type=int, default=1, help="pad segments to this many rows")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic load")
    p.add_argument("--plot", help="write a before/after bar chart (PNG) here")
    p.add_argument("--json", help="write the result as JSON here")
    p.set_defaults(func=plan_command)

    b = bench.add_parser("planner", help="plan latency vs EPLB, sticky copies, topology inter-node bytes")
    b.add_argument("--json", help="write the result as JSON here")
    b.add_argument("--quick", action="store_true", help="small cases, few repeats (a smoke run for tests)")
    b.add_argument("--seed", type=int, default=0, help="seed of the synthetic loads")
    b.set_defaults(func=bench_command)

    d = bench.add_parser("device-planner", help="latency of plan() on tensor counts (CUDA events on a GPU)")
    d.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the counts live")
    d.add_argument("--json", help="write the result as JSON here")
    d.add_argument("--quick", action="store_true", help="one small shape, few repeats (a smoke run for tests)")
    d.set_defaults(func=device_bench_command)


def _read_load(path: str):
    """[R, E] int64 counts from a ``--load`` JSON file; ValueError naming the file and what is wrong in it."""
    from planner._inputs import as_counts  # heavy: numpy

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"--load {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # not UTF-8, or not JSON
        raise ValueError(f"--load {path}: not a JSON file ({exc})") from None
    if isinstance(data, dict):  # files written before the rename say "tokens_per_expert"
        key = next((k for k in ("slots_per_expert", "tokens_per_expert") if k in data), None)
        if key is None:
            raise ValueError(f"{path}: a JSON object needs the key 'slots_per_expert', got keys {sorted(data)[:8]}")
        data = data[key]
    if not isinstance(data, list) or not all(isinstance(row, list) for row in data):
        raise ValueError(f"{path}: expected an [R, E] list of lists of counts, got {type(data).__name__}")
    for r, row in enumerate(data):
        for e, v in enumerate(row):  # JSON true is not a count; a whole number past 64 bits has no dtype
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{path}: row {r}, column {e}: {json.dumps(v)[:40]} is not a count")
            if isinstance(v, int) and abs(v) >= 2**63:
                raise ValueError(f"{path}: row {r}, column {e}: {v} does not fit in 64 bits")
    return as_counts(data, path, 2)


def _load_counts(args):
    """[R, E] counts from --load or --synthetic; ValueError with the reason otherwise."""
    from planner.synthetic import synthetic_counts  # heavy: numba kernels

    if args.load:
        T = _read_load(args.load)
        for name, want, got in (("--ranks", args.ranks, T.shape[0]), ("--experts", args.experts, T.shape[1])):
            if want is not None and want != got:
                raise ValueError(f"{name}={want} but {args.load} has {got}")
        return T
    if args.ranks is None or args.experts is None:
        raise ValueError("--synthetic needs --ranks and --experts")
    for name, v in (("--ranks", args.ranks), ("--experts", args.experts), ("--tokens", args.tokens)):
        if v < 1:
            raise ValueError(f"{name}: must be >= 1, got {v}")
    if not 1 <= args.topk <= args.experts:
        raise ValueError(f"--topk: must be in [1, --experts={args.experts}], got {args.topk}")
    if args.seed < 0:
        raise ValueError(f"--seed: must be >= 0, got {args.seed}")
    return synthetic_counts(args.synthetic, args.ranks, args.experts, args.topk, args.tokens, args.seed)


def plan_command(args: argparse.Namespace) -> int:
    """Plan, print a per-rank table, optionally write JSON and a bar chart. Exit code 0, 2 on bad input."""
    import numpy as np  # heavy: numpy; --help stays light

    from planner.core import plan  # heavy: numba kernels

    # heavy: numba kernels
    from planner.metrics import balance, home_loads, internode, load_balance, min_migration, unplanned_internode_rows

    try:
        T = _load_counts(args)
        topology = None
        if args.nodes:
            if args.nodes < 1 or T.shape[0] % args.nodes:
                raise ValueError(f"--nodes={args.nodes} must divide R={T.shape[0]}")
            topology = T.shape[0] // args.nodes
        p = plan(T, token_padding=args.token_padding, topology=topology)
    except (ValueError, OSError) as exc:
        print(f"moonep plan: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:  # e.g. --ranks 100000 --experts 100000: numpy's [R, E] tables
        print(f"moonep plan: the load is too large for this machine's memory ({exc})", file=sys.stderr)
        return 2
    before = home_loads(T)
    R = p.num_ranks
    replicas = [[int(e) for e in row if e >= 0] for row in p.experts_to_copy]
    print(f"{'rank':>5} {'before':>10} {'after':>10} {'donor':>6}  replicas")
    for r in range(R):
        print(f"{r:>5} {int(before[r]):>10} {int(p.recv_counts[r]):>10} {int(p.donor[r]):>6}  {replicas[r]}")
    result = {
        "R": R,
        "E": p.num_experts,
        "total_rows": int(T.sum()),
        "before": before.tolist(),
        "after": p.recv_counts.tolist(),
        "donor": p.donor.tolist(),
        "replicas": replicas,
        "num_replicas": p.num_replicas,
        "migrated_rows": p.migrated,
        "balance_before": load_balance(before),
        "balance_after": balance(p),
    }
    if R <= 256:
        result["min_migration"] = min_migration(T)
    if topology:
        node = np.arange(R) // topology
        result["internode"] = {
            "unplanned_routed_rows": unplanned_internode_rows(T, node),
            "topology_plan": internode(p, node),
            "plain_plan": internode(plan(T), node),
        }
    print(
        f"balance max/mean: before {result['balance_before']:.3f}, after {result['balance_after']:.3f}; "
        f"replicas {p.num_replicas}; migrated rows {p.migrated}"
        + (f" (flow minimum {result['min_migration']})" if "min_migration" in result else "")
    )
    if args.json:
        write_json(args.json, result)
    if args.plot:
        _plot(args.plot, before, p.recv_counts)
    return 0


def _plot(path: str, before, after) -> None:
    """Before/after rows per rank as grouped bars (matplotlib object API, no global state)."""
    import numpy as np  # heavy: numpy
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy: matplotlib
    from matplotlib.figure import Figure  # heavy: matplotlib

    R = len(before)
    fig = Figure(figsize=(max(6.0, 0.25 * R), 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x = np.arange(R)
    ax.bar(x - 0.2, before, 0.4, label="before (home experts)")
    ax.bar(x + 0.2, after, 0.4, label="after plan")
    ax.set_xlabel("rank")
    ax.set_ylabel("routed rows computed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def bench_command(args: argparse.Namespace) -> int:
    """Run the planner benchmark, print tables, write JSON."""
    from planner.bench import format_report, run  # heavy: numba kernels

    if args.seed < 0:  # numpy's own refusal is a traceback that does not name the flag
        print(f"error: --seed: must be >= 0, got {args.seed}", file=sys.stderr)
        return 2
    result = run(quick=args.quick, seed=args.seed)
    print(format_report(result))
    if args.json:
        write_json(args.json, result)
    return 0


def device_bench_command(args: argparse.Namespace) -> int:
    """Time the device planner, print a table, write JSON; exit 2 when the device is not there."""
    from planner.bench_device import format_report, run  # heavy: torch and the numba kernels

    try:
        result = run(args.device, quick=args.quick)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(result))
    if args.json:
        write_json(args.json, result)
    return 0
