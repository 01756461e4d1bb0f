"""The EP data path on the device: layout = the numpy twin, static shapes (meta device), a host-read budget.

- ``moonep.layout`` (tensor ops) builds the same row maps as ``moonep.reference`` (numpy, ``Plan.route``), for
  plans from the CPU kernel and from the device kernel (numba's CUDA simulator here).
- The layout runs on ``device="meta"`` tensors: no data there, so a host read or a data-dependent shape raises.
- One MoE layer forward + backward on real gloo ranks reads tensor data into Python once: the step's split
  table (``Buffer._read_step``). The CPU kernels' entries (zero-copy numpy views of the planner's counts and of
  the send layout's inputs; on CUDA the device kernel and the tensor ops replace them) are the exemptions.
- The compiled CPU send layout (``moonep.layout_cpu``) equals the tensor-op layout entry for entry.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import planner
from collectives import launch
from moonep import layout, layout_cpu, reference
from moonep.buffer import Buffer, resolve_device
from moonep.hostreads import CPU_KERNEL_ENTRIES, HostReads

STEP_READ = "moonep/buffer.py"


@st.composite
def routings(draw):
    """(R, E, K, [topk_idx [s_r, K] per rank]): masked slots, duplicate experts in a token, skew, empty ranks."""
    R = draw(st.integers(1, 5))
    epn = draw(st.integers(1, 4))
    E, K = R * epn, draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    hot = draw(st.floats(0.0, 0.95))
    rng = np.random.default_rng(seed)
    idx = []
    for _ in range(R):
        s = int(rng.integers(0, 40))
        ids = rng.integers(0, E, size=(s, K))
        ids[rng.random((s, K)) < hot] = int(rng.integers(E))  # one hot expert (duplicates inside tokens too)
        ids[rng.random((s, K)) < 0.2] = -1
        idx.append(ids)
    return R, E, K, idx


def counts_of(idx: list[np.ndarray], E: int) -> np.ndarray:
    return np.stack([np.bincount(i[i >= 0], minlength=E) for i in idx])


def check_send_side(host_plan, dev_plan, rank: int, ids: np.ndarray):
    """Device send layout == numpy twin on the routed slots; returns the device layout."""
    want = reference.send_layout(host_plan, rank, ids)
    got = layout.send_layout(dev_plan, rank, torch.from_numpy(ids))
    n, U = want.slot_pos.size, want.uniq_token.size
    assert np.array_equal(got.slot_splits.numpy(), want.slot_splits)
    assert np.array_equal(got.uniq_splits.numpy(), want.uniq_splits)
    for f in ("slot_pos", "dest_row", "uniq_local"):
        assert np.array_equal(getattr(got, f)[:n].numpy(), getattr(want, f)), f
    assert np.array_equal(got.uniq_token[:U].numpy(), want.uniq_token)
    return got


@settings(max_examples=150, deadline=None)
@given(routings(), st.booleans())
def test_device_layout_equals_numpy_twin(case, device_kernel: bool):
    """Catches any slot sent to another row, a wrong dedup, or a receive map that differs from the host's."""
    R, E, K, idx = case
    T = counts_of(idx, E)
    host = planner.plan(T)
    if device_kernel:
        from planner.device import plan_with_device_kernel

        dev = plan_with_device_kernel(torch.from_numpy(T))
    else:
        dev = planner.plan(torch.from_numpy(T))
    sent = [check_send_side(host, dev, r, idx[r]) for r in range(R)]
    for q in range(R):  # what rank q receives: each source's chunk for q, in source order
        meta, tables = [], []
        for lay in sent:
            before = int(lay.slot_splits[:q].sum())
            n = int(lay.slot_splits[q])
            meta.append(torch.stack((lay.dest_row[before : before + n], lay.uniq_local[before : before + n]), 1))
        meta = torch.cat(meta)
        tables = reference.recv_layout(meta.numpy(), host.send_counts[:, q])
        uniq_in = torch.stack([lay.uniq_splits[q] for lay in sent])
        row, uniq = layout.recv_layout(meta[:, 0], meta[:, 1], dev.send_counts[:, q], uniq_in)
        assert np.array_equal(row.numpy(), tables[0]) and np.array_equal(uniq.numpy(), tables[1])
        assert np.array_equal(uniq_in.numpy(), tables[2])


@settings(max_examples=150, deadline=None)
@given(routings(), st.sampled_from(["exact", "slack", "padded"]))
def test_compiled_cpu_layout_equals_the_tensor_layout(case, kind: str):
    """The compiled CPU send layout (what Buffer runs on CPU) gives every table of the tensor-op layout, entry for
    entry, masked and padding entries included: masked slots, duplicate experts, a hot expert, empty ranks."""
    R, E, K, idx = case
    T = torch.from_numpy(counts_of(idx, E))
    p = planner.plan(T, **{"exact": {}, "slack": {"slack": 0.3}, "padded": {"token_padding": 4}}[kind])
    for r in range(R):
        ids = torch.from_numpy(idx[r])
        want, got = layout.send_layout(p, r, ids), layout_cpu.send_layout_cpu(p, r, ids)
        for f in ("slot_pos", "dest_row", "uniq_local", "uniq_token", "slot_splits", "uniq_splits"):
            assert torch.equal(getattr(got, f), getattr(want, f).long()), (f, getattr(got, f), getattr(want, f))


def test_layout_runs_on_meta_tensors():
    """No data on meta: any host read or data-dependent shape in the layout raises; every shape is static."""
    R, E, K, s = 4, 16, 3, 10
    p = planner.plan(torch.empty(R, E, dtype=torch.int64, device="meta"))
    idx = torch.empty(s, K, dtype=torch.int64, device="meta")
    dest, row = layout.route_slots(p, 2, idx)
    lay = layout.send_layout(p, 2, idx)
    got = layout.recv_layout(
        torch.empty(7, dtype=torch.int32, device="meta"),
        torch.empty(7, dtype=torch.int32, device="meta"),
        p.send_counts[:, 1],
        lay.uniq_splits,
    )
    push, mine = layout.replica_maps(p, 1)
    assert dest.shape == row.shape == lay.slot_pos.shape == lay.uniq_token.shape == (s * K,)
    assert lay.slot_splits.shape == lay.uniq_splits.shape == (R,)
    assert got[0].shape == got[1].shape == (7,) and push.shape == (R * (E // R),) and mine.shape == (E // R,)
    assert all(t.device.type == "meta" for t in (dest, row, *got, push, mine, lay.uniq_local))


def _moe_step(comm, layers: int) -> tuple[list, int]:
    """One forward + backward of ``layers`` MoE layers under HostReads; returns this rank's counted reads."""
    import moonep

    torch.manual_seed(0)
    H, F, E, K, s = 8, 8, 4 * comm.world_size, 2, 16
    buf = Buffer(comm, S=s, H=H, K=K, E=E, check_reuse=False)
    moes = [moonep.MoE(comm, H=H, F=F, E=E, K=K, S=s, buffer=buf) for _ in range(layers)]
    x = torch.randn(s, H, generator=torch.Generator().manual_seed(comm.rank), requires_grad=True)
    for m in moes:  # a hot expert: the plan replicates, so prefetch_weight and reduce_grad move weights
        with torch.no_grad():
            m.router.bias[0] = 5.0
    moes[0](x).sum().backward()  # warm-up: numba compiles, pools are built
    with HostReads(exempt=CPU_KERNEL_ENTRIES) as reads:
        y = x
        for m in moes:
            y = m(y)
        y.sum().backward()
    replicas = moes[0].last_plan.global_plan.num_replicas
    return reads.where, replicas


@pytest.mark.spawns
@pytest.mark.parametrize("world_size,layers", [(2, 1), (2, 2), (3, 1)])
def test_one_host_read_per_moe_layer(world_size: int, layers: int):
    """The budget: one read of the split table per layer forward; the backward and the rest read nothing."""
    reads, replicas = launch(_moe_step, world_size, timeout=30, job_timeout=240, layers=layers)
    assert replicas > 0, "the load must replicate experts, so that prefetch and grad reduce run"
    assert len(reads) == layers, reads
    assert all(name == "Tensor.tolist" and STEP_READ in where.split(" <- ")[0] for name, where in reads), reads


def _device_rank(comm) -> list[str]:
    return [
        Buffer(comm, S=4, H=8, K=2, E=4).device.type,
        Buffer(comm, S=4, H=8, K=2, E=4, device="meta")._recv.device.type,
    ]


@pytest.mark.spawns
def test_buffer_device_follows_its_communicator():
    """device=None takes the communicator's device; an explicit device wins; 'cuda' names the current GPU."""
    assert launch(_device_rank, 2, timeout=20, job_timeout=60) == ["cpu", "meta"]

    class NoDevice:  # resolve_device is pure: a communicator without a device means the CPU
        world_size, rank = 2, 0

    assert resolve_device(NoDevice(), None) == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device(NoDevice(), "cuda") == torch.device("cuda", torch.cuda.current_device())


def _cuda_moe_step(comm) -> dict:
    """One MoE layer fwd+bwd on the GPU with sync debug mode "error" around all but the step's read."""
    import moonep
    from moonep.reference import dense_moe

    torch.manual_seed(0)
    H, F, E, K, s = 16, 16, 8, 2, 64
    m = moonep.MoE(comm, H=H, F=F, E=E, K=K, S=s)
    ref_router = m.router
    x = torch.randn(s, H)
    want = dense_moe(x, ref_router, m.w13.detach(), m.w2.detach())  # R = 1: this rank holds every expert
    m = m.cuda()
    xc = x.cuda().requires_grad_()
    m(xc).sum().backward()  # warm-up: compiles the device planner, builds pools
    read_step = Buffer._read_step

    def budgeted(self, *args):  # the one read the budget allows: outside the debug mode
        torch.cuda.set_sync_debug_mode(0)
        try:
            return read_step(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    Buffer._read_step = budgeted
    try:
        with HostReads(exempt=CPU_KERNEL_ENTRIES) as reads:
            torch.cuda.set_sync_debug_mode("error")
            y = m(xc)
            y.sum().backward()
            torch.cuda.set_sync_debug_mode(0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        Buffer._read_step = read_step
    return {"reads": reads.count, "device": str(y.device), "err": float((y.detach().cpu() - want).abs().max())}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_moe_layer_on_cuda_syncs_only_for_the_budgeted_read():
    """On the GPU: the device planner, layout, NCCL exchanges and expert step run with no sync but the one read."""
    out = launch(_cuda_moe_step, 1, timeout=60, job_timeout=300)
    assert out["device"].startswith("cuda") and out["reads"] == 1, out
    assert out["err"] < 1e-4, out
