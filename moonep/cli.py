"""The one command line, ``moonep``, with a subcommand per capability.

Each package contributes its commands from ``<package>/cli.py``, which defines
``register(commands, bench)``: ``commands`` and ``bench`` are argparse sub-parser actions, so a package adds
top-level commands (``moonep plan``) and benchmark targets (``moonep bench planner``). Every leaf parser sets
``func=handler`` with ``handler(args) -> int``. ``python -m <package>`` builds the same parser with that package
alone. Package ``cli`` modules import only argparse at module level, so ``moonep --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from typing import Any, Sequence

PACKAGES = ("collectives", "planner", "cp_kda", "moonep", "k3", "simulator", "tools")


def _cli_module(package: str):
    name = f"{package}.cli"
    if package == "moonep":
        name = "moonep.commands"
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except ModuleNotFoundError:  # the package itself is absent (a partial install): it adds no commands
        return None
    return importlib.import_module(name)


def build_parser(packages: Sequence[str] = PACKAGES, prog: str = "moonep") -> argparse.ArgumentParser:
    """The argparse tree: one ``commands`` level, with ``bench`` holding every benchmark target."""
    parser = argparse.ArgumentParser(prog=prog, description="MoonEP toolkit: balanced expert parallelism, "
                                     "context-parallel KDA, capacity simulator and straggler tools.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench_parser = commands.add_parser("bench", help="benchmarks (JSON output with --json)")
    bench = bench_parser.add_subparsers(dest="target", metavar="TARGET")
    bench_parser.set_defaults(func=lambda args: _missing(bench_parser))
    for package in packages:
        module = _cli_module(package)
        if module is not None:
            module.register(commands, bench)
    return parser


def _missing(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None, packages: Sequence[str] = PACKAGES, prog: str = "moonep") -> int:
    """Entry point of the ``moonep`` console script and of every ``python -m <package>``."""
    parser = build_parser(packages, prog)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return int(func(args) or 0)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON atomically (temp file + rename), so readers never see half a file."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
