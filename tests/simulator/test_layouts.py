"""Issue 27 layouts: interleaving with N contiguous micro-batches, embedding-/head-only end chunks, ZeRO-2/3 at the
peak, the MTP module, token-dropping MoE; each new flag refused with its name."""

from dataclasses import replace

import pytest

from moonep.console import main
from simulator.analytic import simulate
from simulator.events import static_order
from simulator.hardware import load_hardware
from simulator.inflight import inflight_chunks
from simulator.memory import peak_memory, rank_memory
from simulator.parallel import ParallelConfig, stage_layers
from simulator.specs import load_model

H100 = load_hardware("h100")
LLAMA = load_model("llama3-405b")
PAPER = ParallelConfig(  # Llama 3 section 3.3: TP8 PP16 interleaved, 126 layers, one fewer on the first/last stage
    tp=8,
    pp=16,
    dp=128,
    vpp=8,
    schedule="interleaved",
    seq_len=8192,
    global_batch_tokens=2**24,
    recompute="none",
    zero_stage=2,
    pp_first_layers=0,
    pp_last_layers=0,
)


def test_llama3_405b_paper_layout_runs_and_fits():
    chunks = stage_layers(LLAMA, PAPER)
    assert len(chunks) == 128 and chunks[0] == () and chunks[-1] == ()
    per_rank = [sum(len(chunks[r + 16 * j]) for j in range(8)) for r in range(16)]
    assert per_rank[0] == per_rank[-1] == 7 and set(per_rank[1:-1]) == {8}
    res = simulate(LLAMA, H100, PAPER, 16384)
    assert res.feasible, res.reason
    ev = simulate(LLAMA, H100, PAPER, 16384, engine="event")
    assert abs(res.step_time_s / ev.step_time_s - 1) < 0.03
    # ZeRO-1 keeps the full fp32 gradient buffer next to the same activation peak: out of memory
    assert not simulate(LLAMA, H100, replace(PAPER, zero_stage=1), 16384).feasible


@pytest.mark.parametrize("dp,n", [(64, 16), (64, 32), (32, 32), (32, 64), (32, 40)])
def test_microbatch_group_warmup_memory_and_engines_agree(dp, n):
    par = replace(PAPER, dp=dp, microbatch_group=n, zero_stage=1)
    m, p, v = par.micro_batches, par.pp, par.vpp
    for r in (0, 7, 15):
        order = static_order(par, r)
        warm = next(i for i, op in enumerate(order) if op[0] == "B") - 1  # forwards before the first 1F1B pair
        assert warm == min(m * v, (p - r - 1) * 2 + (v - 1) * n)
        assert inflight_chunks(par, r) == min(m * v, warm + 1)
        assert sorted(order) == sorted([(k, mb, j) for k in "FB" for mb in range(m) for j in range(v)])
    a = simulate(LLAMA, H100, par, 128 * dp)
    e = simulate(LLAMA, H100, par, 128 * dp, engine="event")
    assert abs(a.step_time_s / e.step_time_s - 1) < 0.03
    base = replace(par, microbatch_group=0)  # N = PP keeps the fewest passes in flight
    assert peak_memory(LLAMA, H100, par)[1]["activations"] >= peak_memory(LLAMA, H100, base)[1]["activations"]


def test_zero_peak_grads_and_params():
    mem = [rank_memory(LLAMA, H100, replace(PAPER, zero_stage=z), 1) for z in (1, 2, 3)]
    assert mem[1]["grads"] < mem[0]["grads"] / 4  # at the activation peak only the first backward's gradients
    assert mem[1]["activations"] == pytest.approx(mem[0]["activations"])
    assert mem[2]["params"] < mem[1]["params"] / 2 and mem[2]["params"] > mem[1]["params"] / 128
    # ZeRO-3 gathers the weights again in every micro-batch's forward and backward: more DP time
    assert (
        simulate(LLAMA, H100, replace(PAPER, zero_stage=3)).breakdown["dp"]
        > simulate(LLAMA, H100, PAPER).breakdown["dp"]
    )


def test_gradients_reduced_every_micro_batch_stay_sharded_and_cost_dp_time():
    """``grad_reduce``: sharded gradients reduced after every micro-batch's backward (FSDP, Megatron-FSDP,
    DeepSpeed; ``auto`` with ZeRO >= 2) keep one layer unsharded instead of the accumulated ones, and send the
    buckets once per micro-batch; ZeRO-1 keeps its full buffer either way."""
    par = replace(PAPER, dp=64)
    step, every = (replace(par, grad_reduce=g) for g in ("step", "microbatch"))
    assert par.reduces_every_microbatch and not replace(par, zero_stage=1).reduces_every_microbatch
    mem = {g: rank_memory(LLAMA, H100, replace(par, grad_reduce=g), 1) for g in ("auto", "step", "microbatch")}
    assert mem["auto"] == mem["microbatch"] and mem["microbatch"]["activations"] == mem["step"]["activations"]
    h, kv = LLAMA.hidden, LLAMA.num_kv_heads * LLAMA.hidden // LLAMA.num_heads
    layer = h * (2 * h + 2 * kv + 3 * LLAMA.ffn_hidden) / 8  # q, o, GQA k, v and SwiGLU at TP 8 (norms aside)
    full = rank_memory(LLAMA, H100, replace(par, zero_stage=1), 1)["grads"]
    assert mem["microbatch"]["grads"] == pytest.approx(full / 64 + layer * par.grad_bytes, rel=1e-3)
    assert mem["step"]["grads"] > 5 * mem["microbatch"]["grads"]
    for z in (1, 3):  # ZeRO-1 has no sharded gradients; ZeRO-3 accumulating once walks like ZeRO-2
        a, b = (rank_memory(LLAMA, H100, replace(par, zero_stage=z, grad_reduce=g), 1) for g in ("step", "microbatch"))
        assert (a["grads"] == b["grads"]) if z == 1 else (a["grads"] > 5 * b["grads"])
    assert simulate(LLAMA, H100, every, 8192).breakdown["dp"] > 4 * simulate(LLAMA, H100, step, 8192).breakdown["dp"]
    ddp = [simulate(LLAMA, H100, replace(par, zero_stage=1, grad_reduce=g), 8192) for g in ("step", "microbatch")]
    assert ddp[1].breakdown["dp"] > ddp[0].breakdown["dp"]


def test_mtp_module_costs_time_and_weights_on_the_last_stage():
    spec = load_model("deepseek-v3")
    par = ParallelConfig(pp=8, ep=32, dp=32, seq_len=4096, global_batch_tokens=4096 * 512, recompute="full")
    with_mtp = replace(spec, mtp_layers=1)
    base, mtp = simulate(spec, H100, par), simulate(with_mtp, H100, par)
    assert mtp.step_time_s > base.step_time_s
    assert rank_memory(with_mtp, H100, par, 7)["params"] > rank_memory(spec, H100, par, 7)["params"]
    assert rank_memory(with_mtp, H100, par, 0)["params"] == rank_memory(spec, H100, par, 0)["params"]


def test_capacity_factor_sizes_experts_and_keeps_the_layer_overhead():
    """Dropping sizes the expert GEMMs and the copies moved; the per-layer overhead (launches; the fit cannot
    separate the host sync the fixed-size buffers remove) stays, so at c = 1 the MoE fixed term is the dropless
    one."""
    spec = load_model("deepseek-v3")
    par = ParallelConfig(pp=8, ep=32, dp=32, seq_len=4096, global_batch_tokens=4096 * 512, recompute="full")
    drop = simulate(spec, H100, par)
    low = simulate(spec, H100, replace(par, capacity_factor=0.5))
    one = simulate(spec, H100, replace(par, capacity_factor=1.0))
    pad = simulate(spec, H100, replace(par, capacity_factor=2.0, pad_to_capacity=True))
    assert low.breakdown["grouped_gemm"] < one.breakdown["grouped_gemm"] < pad.breakdown["grouped_gemm"]
    assert low.breakdown["moe_fixed"] < one.breakdown["moe_fixed"] == pytest.approx(drop.breakdown["moe_fixed"])
    skew = replace(par, dispatcher="classic", maxvio=0.5)
    capped = simulate(spec, H100, replace(skew, capacity_factor=1.2))
    assert 0 < capped.breakdown["imbalance"] < simulate(spec, H100, skew).breakdown["imbalance"]


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"microbatch_group": -1}, "microbatch_group"),
        ({"capacity_factor": -0.5}, "--moe-capacity-factor"),
        ({"capacity_factor": float("nan")}, "--moe-capacity-factor"),
        ({"pad_to_capacity": True}, "--moe-pad-expert-input-to-capacity"),
        ({"pp_first_layers": -1}, "pp_first_layers"),
        ({"seq_len": 2**31}, r"seq_len must be an integer in \[1, 2147483647\]"),  # was priced: 10**20 GPUs ran
        ({"dp": 10**20}, r"dp must be an integer in \[1, 2147483647\]"),
        ({"global_batch_tokens": 2**53 + 1}, r"global_batch_tokens must be an integer in \[1, 9007199254740992\]"),
        ({"etp": 2**31}, r"etp must be an integer in \[0, 2147483647\]"),
        ({"grad_reduce": "never"}, "grad_reduce must be one of"),
        ({"overlap_grad_reduce": "no"}, "overlap_grad_reduce must be True or False, got 'no'"),  # was read as on
        ({"fp8_attention": 1}, "fp8_attention must be True or False"),
    ],
)
def test_bad_values_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ParallelConfig(**kwargs)


_JOB = ["simulate", "run", "--model", "qwen3-30b-a3b", "--gpus", "16", "--pp", "2", "--ep", "8"]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--microbatch-group", "-2"], "--microbatch-group"),
        (["--microbatch-group", "4"], "--microbatch-group"),
        (["--schedule", "interleaved", "--vpp", "2", "--microbatch-group", "1"], "--microbatch-group"),
        (["--moe-capacity-factor", "-1"], "--moe-capacity-factor"),
        (["--moe-capacity-factor", "inf"], "--moe-capacity-factor"),
        (["--moe-pad-expert-input-to-capacity"], "--moe-pad-expert-input-to-capacity"),
        (["--pp-first-layers", "-1"], "--pp-first-layers"),
        (["--mtp-layers", "-1"], "--mtp-layers"),
        (["--pp-first-layers", "0", "--pp-last-layers", "0"], "pp_first_layers 0 + pp_last_layers 0"),
    ],
)
def test_cli_bad_flag_is_one_line_exit_2(capsys, flags, needle):
    assert main([*_JOB, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err, err
