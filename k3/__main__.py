"""``python -m k3``: the k3 package's commands alone (no package above it is imported)."""

from k3.cli import register
from moonep_base import run_package

if __name__ == "__main__":
    raise SystemExit(run_package(register, prog="python -m k3"))
