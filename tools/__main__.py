from moonep.cli import main
if __name__ == "__main__":
    raise SystemExit(main(packages=["tools"], prog="python -m tools"))
