from moonep.cli import main
if __name__ == "__main__":
    raise SystemExit(main(packages=["simulator"], prog="python -m simulator"))
