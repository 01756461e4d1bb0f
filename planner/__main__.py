"""``python -m planner``: the planner package's commands alone (no package above it is imported)."""

from moonep_base import run_package
from planner.cli import register

if __name__ == "__main__":
    raise SystemExit(run_package(register, prog="python -m planner"))
