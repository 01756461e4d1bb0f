"""Host-bound (eager CPU) pricing: the op census against the real k3 code, HostSpec checks, time sharing."""

import dataclasses

import pytest

from simulator import ParallelConfig, simulate
from simulator.calibrate import merge_profiles
from simulator.hardware import HostSpec, load_hardware
from simulator.host import census, share_factor, stretch
from simulator.specs import load_model

HOST = {
    "timing": "shared_wall",
    "cores": 2,
    "effective_cores": 2.0,
    "ranks": 4,
    "op_fwd_tiny_us": 3.0,
    "op_bwd_tiny_us": 3.0,
    "op_nograd_tiny_us": 2.0,
    "op_fwd_us": 12.0,
    "op_bwd_us": 8.0,
    "ref_elements": 16384,
    "kda_us": 10000.0,
    "kda_tiny_us": 5000.0,
    "kda_elements": 8192,
    "kda_tiny_elements": 512,
    "a2a_call_us": 500.0,
    "all_reduce_call_us": 800.0,
    "checked_all_reduce_call_us": 1500.0,
    "all_gather_call_us": 700.0,
    "a2a_us_per_mb": 200.0,
    "all_reduce_us_per_mb": 300.0,
}
CPU = {
    "name": "test cpu",
    "bf16_tflops": 0.06,
    "hbm_gib": 16.0,
    "hbm_tbps": 0.04,
    "nvlink_gbps": 0.5,
    "nic_gbps": 0.5,
    "gpus_per_node": 8,
    "host": HOST,
    "efficiency": {"gemm": 1.0, "grouped_gemm": 1.0, "attention": 0.5, "hbm": 1.0, "nvlink": 1.0, "network": 1.0},
}


def _tiny(ranks: int) -> ParallelConfig:
    return ParallelConfig(
        ep=ranks, dp=ranks, micro_batch=16 // ranks, seq_len=64, global_batch_tokens=1024, recompute="none"
    )


def _count_step(comm):
    """Framework ops of one tiny-K3 training step on this rank, outside the KDA kernel and collectives."""
    import tempfile

    from torch.utils._python_dispatch import TorchDispatchMode

    import cp_kda.chunk
    import cp_kda.gate
    from k3.data import batch
    from k3.model import token_loss_sum
    from k3.train import TrainConfig, Trainer

    skip = [0]

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += skip[0] == 0
            return func(*args, **(kwargs or {}))

    def muted(fn):  # ops inside the calibrated kernels and collectives are priced separately
        def run(*a, **k):
            skip[0] += 1
            try:
                return fn(*a, **k)
            finally:
                skip[0] -= 1

        return run

    for cls in (cp_kda.chunk._KDAChunkFunction, cp_kda.gate._GateFunction):
        cls.forward, cls.backward = staticmethod(muted(cls.forward)), staticmethod(muted(cls.backward))
    for name in ("all_to_all_single", "all_gather", "all_reduce"):
        setattr(comm, name, muted(getattr(comm, name)))
    with tempfile.TemporaryDirectory() as tmp:
        tc = TrainConfig(world_size=comm.world_size, progress=False, run_dir=tmp, max_data_bytes=1 << 18)
        tr = Trainer(comm, tc)
        tr.step(0)
        inputs, targets = tr.local(batch(tr.corpus.train, tc.seed, 1, tc.global_batch, tc.seq_len))
        with Count():
            loss = token_loss_sum(tr.model, inputs, targets)
        fwd, Count.n = Count.n, 0
        with Count():
            (loss / tc.global_batch).backward()
        bwd, Count.n = Count.n, 0
        with Count():
            tr.opt.step()
        return fwd, bwd, Count.n


@pytest.mark.spawns
@pytest.mark.parametrize("ranks", [1, 2])
def test_census_matches_the_k3_implementation(ranks):
    """The constants in simulator.host were counted on k3's code; a change there shows up here."""
    from collectives import launch

    fwd, bwd, opt = launch(_count_step, ranks, timeout=120.0)
    spec = load_model("k3-tiny")
    c = census(spec, _tiny(ranks))
    kinds = spec.layer_kinds()
    assert sum(c.fwd_ops[k] for k in kinds) + c.ends_fwd == pytest.approx(fwd, rel=0.10)
    assert sum(c.bwd_ops[k] for k in kinds) + c.ends_bwd == pytest.approx(bwd, rel=0.10)
    # step_ops also holds gradient packing, clipping and balancing, which opt.step() does not run
    assert c.opt_ops == pytest.approx(opt, rel=0.10) and c.step_ops > c.opt_ops


def test_host_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="effective_cores"):
        HostSpec(**{**HOST, "effective_cores": 5.0})
    with pytest.raises(ValueError, match="a2a_call_us"):
        HostSpec(**{**HOST, "a2a_call_us": -1.0})
    with pytest.raises(ValueError, match="older `moonep simulate calibrate`"):
        HostSpec(**{**HOST, "timing": "solo_cpu"})
    with pytest.raises(ValueError, match="unknown HostSpec"):
        load_hardware({**CPU, "host": {**HOST, "typo": 1}})


HOST_TIMED_KEYS = ("host", "kda", "ep", "dp")
"""Breakdown parts priced from calibrated host times, measured with all ``ranks`` busy (already time-shared)."""


def test_ranks_beyond_the_cores_time_share():
    """Host times were calibrated with 4 ranks busy, so they hold at 4 ranks whatever the effective cores and halve
    at 2 ranks on 2 cores; GEMM FLOPs (a solo rate) take twice as long on 1 effective core as on 2."""
    hw = load_hardware(CPU)
    assert stretch(hw, _tiny(2)) == 1.0 and stretch(hw, _tiny(4)) == 2.0
    assert share_factor(hw, _tiny(4)) == 1.0 and share_factor(hw, _tiny(2)) == 0.5
    two = simulate("k3-tiny", CPU, _tiny(4), 4)
    one = simulate("k3-tiny", {**CPU, "host": {**HOST, "effective_cores": 1.0}}, _tiny(4), 4)
    assert two.feasible and sum(two.breakdown.values()) == pytest.approx(two.step_time_s, rel=1e-9)
    assert two.breakdown["gemm"] > 0 and one.breakdown["gemm"] == pytest.approx(2 * two.breakdown["gemm"])
    for key in HOST_TIMED_KEYS:
        assert two.breakdown[key] > 0 and one.breakdown[key] == pytest.approx(two.breakdown[key], rel=1e-9), key
    # the optimizer is no-grad ops (host-timed) plus Newton-Schulz FLOPs (stretched)
    assert two.breakdown["optimizer"] < one.breakdown["optimizer"] < 2 * two.breakdown["optimizer"]
    assert two.breakdown["elementwise"] == 0  # the per-op cost holds the data movement
    # the same costs calibrated at 2 ranks (no sharing in them) cost twice as much at 4 local ranks
    at2 = simulate("k3-tiny", {**CPU, "host": {**HOST, "ranks": 2}}, _tiny(4), 4)
    for key in HOST_TIMED_KEYS:
        assert at2.breakdown[key] == pytest.approx(2 * two.breakdown[key], rel=1e-9), key
    assert at2.breakdown["gemm"] == pytest.approx(two.breakdown["gemm"], rel=1e-9)


def test_host_costs_follow_the_profile():
    """Slower framework ops or collectives in the profile make the step slower, by that part only."""
    base = simulate("k3-tiny", CPU, _tiny(4), 4)
    slow_ops = simulate("k3-tiny", {**CPU, "host": {**HOST, "op_fwd_us": 24.0, "op_bwd_us": 16.0}}, _tiny(4), 4)
    slow_a2a = simulate("k3-tiny", {**CPU, "host": {**HOST, "a2a_call_us": 1000.0}}, _tiny(4), 4)
    assert slow_ops.breakdown["host"] > 1.5 * base.breakdown["host"]
    assert slow_ops.breakdown["ep"] == pytest.approx(base.breakdown["ep"])
    assert slow_a2a.breakdown["ep"] > base.breakdown["ep"] and slow_a2a.breakdown["host"] == base.breakdown["host"]


def test_gpu_presets_have_no_host_term():
    par = ParallelConfig(pp=16, ep=64, dp=256, seq_len=8192, global_batch_tokens=64 * 2**20, recompute="full")
    res = simulate("k3", "h200", par, 4096)
    assert res.feasible and res.breakdown["host"] == 0.0


def test_merge_profiles_averages_numbers():
    a = {"name": "x", "bf16_tflops": 1.0, "host": {**HOST, "effective_cores": 1.0}}
    b = {"name": "y", "bf16_tflops": 3.0, "host": {**HOST, "effective_cores": 2.0}}
    m = merge_profiles(a, b)
    assert m["bf16_tflops"] == 2.0 and m["host"]["effective_cores"] == 1.5 and m["name"] == "x"
    assert m["host"]["ranks"] == 4 and dataclasses.is_dataclass(load_hardware({**CPU, "host": m["host"]}).host)
