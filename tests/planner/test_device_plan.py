"""The device planner (numba-cuda kernel) gives the CPU kernel's plans field by field.

Without a GPU the kernel runs under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, tests/conftest.py), a
few threads per block so that every strided stage is shared; with one (``make gpu-check``) it runs on the
device. ``test_kernel_compiles_to_ptx`` compiles the same source with numba-cuda's real compiler (NVVM) for
sm_90, so code the simulator accepts but a GPU would not (allocation, unsupported calls) fails here too.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import TensorPlan, plan
from planner.device import flow_rows, plan_with_device_kernel
from planner.synthetic import zipf_counts
from tests.planner.loads import FAMILIES, Case, cases, make_counts

pytestmark = pytest.mark.gpu  # on CPU under numba's CUDA simulator; on the GPU under make gpu-check

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("NUMBA_ENABLE_CUDASIM") == "0" else "cpu"
FIELDS = (
    "slots_per_expert",
    "caps",
    "alloc",
    "donor",
    "experts_to_copy",
    "send_counts",
    "cu_seqlens",
    "flows",
    "recv_rows",
)


def assert_same_plan(host, dev: TensorPlan) -> None:
    """Every field of the numpy plan equals the device plan's, and the route pieces equal ``Plan._pieces``."""
    got = dev.to_plan()
    for f in FIELDS:
        assert np.array_equal(getattr(host, f), getattr(got, f)), f"{f}: {getattr(host, f)} != {getattr(got, f)}"
    end, start, dest, row0 = host._pieces
    pieces = dev.pieces.cpu().numpy()
    P = int(dev.totals[1])
    assert end.size == P and np.array_equal(pieces[:P], np.stack((end, start, dest, row0), axis=1))
    assert (pieces[P:] == 2**63 - 1).all()  # padding rows sort after every real piece


def device_plan(T, threads=None, **kw) -> TensorPlan:
    return plan_with_device_kernel(torch.as_tensor(T, device=DEVICE), threads=threads, **kw)


@settings(max_examples=120, deadline=None)
@given(cases(max_R=7, max_epn=4, max_scale=80), st.sampled_from([1, 3, 4]))
def test_device_kernel_equals_cpu_kernel(case: Case, threads: int):
    """Catches any stage of the kernel that differs from the CPU kernel: tie-breaks, padding, flows, pieces."""
    T = case.counts()
    assert_same_plan(
        plan(T, token_padding=case.token_padding), device_plan(T, threads, token_padding=case.token_padding)
    )


@settings(max_examples=60, deadline=None)
@given(cases(max_R=6, max_epn=3, max_scale=60), st.integers(0, 2**31 - 1))
def test_sticky_device_plan_equals_cpu(case: Case, seed: int):
    """A sticky plan (previous = last step's plan on another load) keeps the same pairs and slots."""
    T = case.counts()
    before = make_counts(FAMILIES[seed % len(FAMILIES)], case.R, case.epn, case.scale, seed)
    prev = plan(before)
    assert_same_plan(plan(T, previous=prev), device_plan(T, previous=prev))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_at_k3_like_shapes(family: str):
    """Larger R and epn than the property test (R = 16, epn = 8), each adversarial family."""
    for seed in range(2):
        T = make_counts(family, 16, 8, 300, seed)
        assert_same_plan(plan(T, token_padding=8), device_plan(T, token_padding=8))


def test_uneven_caps_and_slots():
    """Caller caps and fewer replica slots run the same stages, and fail with the same error."""
    T = zipf_counts(6, 18, 2, 50, 1.4, 7)
    total = int(T.sum())
    caps = [total // 6] * 5 + [total - 5 * (total // 6)]
    assert_same_plan(plan(T, caps=caps), device_plan(T, caps=caps))
    T = make_counts("home_heavy", 4, 3, 60, 0)  # rank 2 needs two replica slots
    assert_same_plan(plan(T, slots_per_rank=2), device_plan(T, slots_per_rank=2))
    with pytest.raises(ValueError) as want:
        plan(T, slots_per_rank=1)
    with pytest.raises(ValueError) as got:
        device_plan(T, slots_per_rank=1)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("bad", ["negative", "too_large", "caps_sum", "uneven_caps"])
def test_errors_match_the_cpu_kernel(bad: str):
    """Each kernel error code, with its (a, b), becomes the numpy path's ValueError word for word."""
    T = zipf_counts(4, 8, 2, 30, 1.2, 1)
    caps = None
    if bad == "negative":
        T[2, 5], T[3, 1] = -1, -4
    elif bad == "too_large":
        T[1, 6] = 2**31
    elif bad == "caps_sum":
        caps = [1, 2, 3, 4]
    else:
        total = int(T.sum())
        caps = [total, 0, 0, 0]
    with pytest.raises(ValueError) as want:
        plan(T, caps=caps)
    with pytest.raises(ValueError) as got:
        device_plan(T, caps=caps)
    assert str(got.value) == str(want.value)


def test_deferred_errors_stay_in_err():
    """defer_errors leaves the code in ``err`` (no read); raise_if_invalid raises it."""
    T = torch.tensor([[1, -2], [0, 3]])
    p = plan(T, defer_errors=True)
    assert p.err.tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match="non-negative"):
        p.raise_if_invalid()
    with pytest.raises(ValueError, match="non-negative"):
        plan(T)


def test_tables_have_static_shapes():
    """Table shapes depend on (R, E, slots) only: the same for two loads, and on the meta device."""
    R, E = 4, 12
    shapes = []
    for T in (zipf_counts(R, E, 2, 40, 2.0, 0), np.zeros((R, E), np.int64)):
        p = plan(torch.from_numpy(T))
        shapes.append({k: tuple(v.shape) for k, v in vars(p).items() if isinstance(v, torch.Tensor)})
    meta = plan(torch.empty(R, E, dtype=torch.int64, device="meta"))
    shapes.append({k: tuple(v.shape) for k, v in vars(meta).items() if isinstance(v, torch.Tensor)})
    assert shapes[0] == shapes[1] == shapes[2]
    assert shapes[0]["flows"] == (flow_rows(R, E, E // R), 4) and meta.device.type == "meta"


def test_tensor_input_refuses_topology_and_float_counts():
    T = torch.ones(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="host planner"):
        plan(T, topology=1)
    with pytest.raises(ValueError, match="integer counts"):
        plan(T.float())


def compile_ptx(module: str, kernel: str, sig: str, checks: str) -> list[str]:
    """Compile ``module.kernel`` for sm_90 with numba-cuda's real compiler (NVVM, no GPU) in a fresh process;
    ``sig``: the argument types in terms of a2/a1/b2/i/nt; returns the printed ``checks`` on the PTX."""
    code = (
        "import types\n"
        "import numba.cuda.dispatcher as nd\n"
        "from numba import cuda, types as nt\n"
        # device functions ask the current GPU for its compute capability: name sm_90 instead
        "nd.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))\n"
        f"from {module} import {kernel}\n"
        "a2, a1, b2, i = nt.int64[:, :], nt.int64[:], nt.int32[:, :], nt.int64\n"
        f"ptx, _ = cuda.compile_ptx({kernel}.py_func, ({sig}), cc=(9, 0))\n"
        f"print({checks})\n"
    )
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


@pytest.mark.spawns
def test_kernel_compiles_to_ptx():
    """numba-cuda's compiler (NVVM, no GPU needed) accepts the kernel for sm_90: no simulator-only code."""
    sig = (
        "a2, a1, nt.boolean, nt.int64, a1, a2, nt.boolean, b2, b2, a2, a1, a1, a2, a2, a2, a2, a1, a1,"
        " a1, a1, a1, a2, a2, a1, a1, a1, a1, a1, a1, a1"
    )
    assert compile_ptx("planner._device_kernel", "plan_kernel", sig, "'bar.sync' in ptx, 'atom.' in ptx") == [
        "True",
        "True",
    ]
