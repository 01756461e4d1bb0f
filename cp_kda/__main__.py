"""``python -m cp_kda``: the cp_kda package's commands alone (no package above it is imported)."""

from cp_kda.cli import register
from moonep_base import run_package

if __name__ == "__main__":
    raise SystemExit(run_package(register, prog="python -m cp_kda"))
