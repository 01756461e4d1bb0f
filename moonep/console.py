"""The ``moonep`` console script: one command line that gathers every package's ``cli.py``.

It only gathers: each package owns its commands in ``<package>/cli.py`` (``register(commands, bench)``, see
``moonep_base``) and runs them alone as ``python -m <package>``, without this module or the ``moonep`` package.
The package ``cli`` modules import only argparse at module level and are imported by name here, so
``moonep --help`` stays fast and a partial install simply has fewer commands.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from collections.abc import Sequence

from moonep_base import build_parser as _build_parser
from moonep_base import run

PACKAGES = ("collectives", "planner", "cp_kda", "moonep", "k3", "simulator", "tools")
DESCRIPTION = (
    "MoonEP toolkit: balanced expert parallelism, context-parallel KDA, capacity simulator and straggler tools."
)


def _cli_module(package: str):
    name = f"{package}.cli"
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except ModuleNotFoundError:  # the package itself is absent (a partial install): it adds no commands
        return None
    return importlib.import_module(name)


def build_parser(packages: Sequence[str] = PACKAGES, prog: str = "moonep") -> argparse.ArgumentParser:
    """The argparse tree of ``packages``' commands (``bench`` holds every benchmark target)."""
    modules = [m for m in map(_cli_module, packages) if m is not None]
    return _build_parser([m.register for m in modules], prog, DESCRIPTION)


def main(argv: Sequence[str] | None = None, packages: Sequence[str] = PACKAGES, prog: str = "moonep") -> int:
    """Entry point of the ``moonep`` console script."""
    return run(build_parser(packages, prog), argv)


if __name__ == "__main__":
    raise SystemExit(main())
