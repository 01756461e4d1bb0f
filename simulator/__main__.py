"""``python -m simulator``: the simulator package's commands alone (no package above it is imported)."""

from moonep_base import run_package
from simulator.cli import register

if __name__ == "__main__":
    raise SystemExit(run_package(register, prog="python -m simulator"))
