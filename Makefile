# make demo: the main job, K3 (tiny) trained on 4 local CPU ranks with MoonEP (no server, no download).
# make test: ruff (lint + format check), pyright, then the whole test suite; make test-fast: ruff, then the tests
# that start no process (the edit loop). All three create .venv in the repo root when it is missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# A CPU build of torch that installs offline on our machines. GPU users: put your own CUDA build of torch
# into .venv first (or run `make TORCH=torch==2.14.1 test`); an installed torch is never replaced.
TORCH  ?= torch==2.13.0
PYTHON ?= python3
# pip byte-compiles what it installs on one core; compileall does it on every core (a new .venv builds about 15 s
# faster on 2). A file that does not compile for this Python is left to import from source, as pip leaves it.
BYTE_COMPILE = $(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true

.PHONY: test test-fast demo roundtrip bench gpu-check gpu-bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet --no-compile "$(TORCH)"
	touch $@

$(VENV)/.core: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install --quiet --no-compile -e .
	$(BYTE_COMPILE)
	touch $@

# Frameworks the adapter tests run inside, without their heavy dependency trees (--no-deps): megatron-core
# (tests/moonep/test_megatron_compat.py) and torchtitan 0.3 with the few packages its model code imports
# (spmd_types, tyro, docstring-parser, einops; triton for models.common; tests/moonep/test_torchtitan_integration.py).
# torchtitan needs Python >= 3.11: on 3.10 it is left out and its test skips, saying so.
FRAMEWORKS_PIP = megatron-core==0.16.1
TITAN_PIP = torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 einops==0.8.2 triton==3.9.0
# The dev environment holds the core one: built straight from .torch, it installs the project once and byte-compiles
# once, and stamps .core too (a new .venv/.dev in 102 and 108 s against 126 and 117 s through .core, both orders).
$(VENV)/.dev: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install --quiet --no-compile -e ".[dev,mpi]"
	$(PY) -m pip install --quiet --no-compile --no-deps $(FRAMEWORKS_PIP)
	if $(PY) -c "import sys; sys.exit(sys.version_info < (3, 11))"; then $(PY) -m pip install --quiet --no-compile --no-deps \
	  $(TITAN_PIP); else echo "make: torchtitan 0.3 needs Python >= 3.11: test_torchtitan_integration.py will skip"; fi
	$(BYTE_COMPILE)
	touch $(VENV)/.core $@

demo: $(VENV)/.core
	$(VENV)/bin/moonep train --preset tiny --world-size 4 --steps 300 --run-dir out/k3-tiny

roundtrip: $(VENV)/.core
	$(VENV)/bin/moonep roundtrip --world-size 4 --json out/roundtrip.json

# Every test in two runs: all but the solo ones on two pytest-xdist workers, one per core, each test file whole on
# one worker (its module fixtures stay shared), the longest files first (tests/conftest.py; --no-loadscope-reorder
# keeps that order). Spawning tests run two at a time this way too: their ranks leave the cores idle part of the
# time (start-up, waits on timeouts). Then, one at a time, those marked solo, whose verdicts rest on the times their
# ranks measure. In both runs a test that starts a process without the spawns mark fails (tests/conftest.py).
PYTEST = TQDM_DISABLE=1 MPLBACKEND=Agg $(PY) -m pytest -q
FAST_PYTEST = MOONEP_TEST_FAST=1 $(PYTEST) -n 2 --dist loadfile --no-loadscope-reorder
test: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright
	$(PYTEST) -m "not solo" -n 2 --dist loadfile --no-loadscope-reorder
	$(PYTEST) -m "spawns and solo"

# The edit loop: lint, then every test that starts no process (tests/conftest.py: @pytest.mark.spawns is left out,
# and a test that starts a process unmarked fails). make test runs everything, these included.
test-fast: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(FAST_PYTEST)

bench: $(VENV)/.dev
	$(VENV)/bin/moonep bench collectives --world-size 4 --json out/bench_collectives.json

# make gpu-check: every check that needs a GPU, on the real GPU, in one short run. It fails (non-zero) when CUDA is
# absent and when any test skips (tests/conftest.py turns skips into failures under MOONEP_GPU_CHECK=1), so a green
# run means every GPU check ran. CUDA is checked first, before anything is installed. Then it installs into
# GPU_PY's environment what the checks need: this package with its dev extra (pytest, hypothesis), nvidia-ml-py,
# flash-linear-attention, and numba-cuda and nvshmem4py built for torch's CUDA major (cu12 or cu13, from
# torch.version.cuda). GPU_PY must have a CUDA build of torch (`make gpu-check GPU_PY=/path/to/python`).
GPU_PY ?= $(PY)
GPU_TESTS = tests/k3/test_device.py tests/cp_kda/test_chunk.py tests/collectives/test_nvshmem.py \
	tests/planner/test_plan.py tests/tools/test_telemetry.py tests/planner/test_device_plan.py \
	tests/planner/test_device_slack.py \
	tests/moonep/test_device_path.py
GPU_PIP = nvidia-ml-py flash-linear-attention
gpu-check:
	@command -v "$(GPU_PY)" >/dev/null || { echo "gpu-check: no Python $(GPU_PY); pass GPU_PY=..." >&2; exit 1; }
	@$(GPU_PY) -c "import torch" 2>/dev/null || { echo "gpu-check: CUDA is absent: $(GPU_PY) has no torch" \
	  "(install a CUDA build of torch there)" >&2; exit 1; }
	@$(GPU_PY) -c "import sys, torch; sys.exit(0) if torch.cuda.is_available() else sys.exit( \
	  'gpu-check: CUDA is absent: torch.cuda.is_available() is False for $(GPU_PY) (torch ' + torch.__version__ \
	  + ', CUDA ' + str(torch.version.cuda) + '); run it on a GPU machine with a CUDA build of torch')"
	@cu=$$($(GPU_PY) -c "import torch; print(str(torch.version.cuda).split('.')[0])") && \
	  case "$$cu" in 12|13) ;; *) echo "gpu-check: torch is built for CUDA $$cu; nvshmem4py has cu12 and cu13 only" >&2; \
	  exit 1;; esac && \
	  echo "gpu-check: installing the GPU check dependencies for CUDA $$cu" && \
	  $(GPU_PY) -m pip install --quiet -e ".[dev]" $(GPU_PIP) "numba-cuda[cu$$cu]" "nvshmem4py-cu$$cu"
	@n=$$($(GPU_PY) -c "import torch; print(torch.cuda.device_count())") && \
	  if [ "$$n" -gt 1 ]; then sel="gpu and not single_gpu"; else sel="gpu and not multi_gpu"; fi && \
	  echo "gpu-check: $$n GPU(s): running the tests marked '$$sel'" && \
	  NUMBA_ENABLE_CUDASIM=0 MOONEP_GPU_CHECK=1 TQDM_DISABLE=1 MPLBACKEND=Agg $(GPU_PY) -m pytest -q -rs \
	  -m "$$sel" --continue-on-collection-errors $(GPU_TESTS)

# The prepared GPU measurement (run after gpu-check, same GPU_PY): the device planner's latency per plan with CUDA
# events at K3's shape (R=64, E=896; goal <= 100 us), checked against the numpy planner, as JSON.
gpu-bench:
	NUMBA_ENABLE_CUDASIM=0 $(GPU_PY) -m planner bench device-planner --device cuda --json out/device_planner.json

clean:
	rm -rf $(VENV) out .pytest_cache
