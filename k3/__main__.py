from moonep.cli import main

raise SystemExit(main(packages=["k3"], prog="python -m k3"))
