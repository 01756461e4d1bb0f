from moonep.cli import main

if __name__ == "__main__":
    raise SystemExit(main(packages=["cp_kda"], prog="python -m cp_kda"))
