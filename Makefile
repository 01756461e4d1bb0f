# make demo: the main job, K3 (tiny) trained on 4 local CPU ranks with MoonEP (no server, no download).
# make test: the whole test suite. Both create .venv in the repo root when it is missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# A CPU build of torch that installs offline on our machines. GPU users: put your own CUDA build of torch
# into .venv first (or run `make TORCH=torch==2.14.1 test`); an installed torch is never replaced.
TORCH  ?= torch==2.13.0
PYTHON ?= python3

.PHONY: test demo roundtrip bench gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	touch $@

$(VENV)/.core: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.core
	$(PY) -m pip install --quiet -e ".[dev,mpi]"
	touch $@

demo: $(VENV)/.core
	$(VENV)/bin/moonep train --preset tiny --world-size 4 --steps 300 --run-dir out/k3-tiny

roundtrip: $(VENV)/.core
	$(VENV)/bin/moonep roundtrip --world-size 4 --json out/roundtrip.json

test: $(VENV)/.dev
	TQDM_DISABLE=1 MPLBACKEND=Agg $(PY) -m pytest -q

bench: $(VENV)/.dev
	$(VENV)/bin/moonep bench collectives --world-size 4 --json out/bench_collectives.json

# The test files holding every check that needs a GPU (those skip elsewhere), in one short run, with a Python
# that has a CUDA torch, this package's dependencies and pytest/hypothesis (nvidia-ml-py and nvshmem4py for
# those checks): `make gpu-check GPU_PY=python3`.
GPU_PY ?= $(PY)
GPU_TESTS = tests/k3/test_device.py tests/cp_kda/test_chunk.py tests/collectives/test_nvshmem.py \
	tests/planner/test_plan.py tests/tools/test_telemetry.py
gpu-check:
	TQDM_DISABLE=1 MPLBACKEND=Agg $(GPU_PY) -m pytest -q -rs $(GPU_TESTS)

clean:
	rm -rf $(VENV) out .pytest_cache
