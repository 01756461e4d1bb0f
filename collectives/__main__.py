"""``python -m collectives``: the collectives package's commands alone (no package above it is imported)."""

from collectives.cli import register
from moonep_base import run_package

if __name__ == "__main__":
    raise SystemExit(run_package(register, prog="python -m collectives"))
