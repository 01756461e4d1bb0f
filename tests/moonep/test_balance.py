"""Cost-aware and bounded-slack balancing in the EP layer, over real gloo ranks: the same function as the exact
plan (outputs and every gradient), rows inside the bound, the weight exchanges skipped on every rank when the plan
has no replica, the host-read budget kept, and the cost model measured on the group."""

from __future__ import annotations

import pytest
import torch

import moonep
import planner
from collectives import launch
from moonep import expert_math
from moonep.hostreads import CPU_KERNEL_ENTRIES, HostReads

pytestmark = pytest.mark.spawns  # every test here starts processes: make test-fast leaves them out

H, F, K, S = 8, 8, 2, 32


def _layer(comm, seed: int, **balance) -> moonep.MoE:
    torch.manual_seed(seed)
    moe = moonep.MoE(comm, H=H, F=F, E=4 * comm.world_size, K=K, S=S, **balance)
    with torch.no_grad():
        moe.router.bias[0] = 5.0  # a hot expert: the exact plan replicates it
    return moe


def _step(moe: moonep.MoE, comm) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """(output, grads of x and every parameter, all-to-all calls) of one forward + backward."""
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(100 + comm.rank), requires_grad=True)
    calls = [0]
    names = ("all_to_all_single", "all_to_all_single_start")  # blocking and started exchanges alike
    originals = [getattr(comm, n) for n in names]

    def counting(fn):
        def counted(*args, **kwargs):
            calls[0] += 1
            return fn(*args, **kwargs)

        return counted

    for n, fn in zip(names, originals):
        setattr(comm, n, counting(fn))
    try:
        y = moe(x)
        (y * torch.arange(H, dtype=y.dtype)).sum().backward()
    finally:
        for n in names:
            delattr(comm, n)
    return y.detach(), [x.grad] + [p.grad for p in moe.parameters()], calls[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (fp32: only the summation order differs between plans)."""
    return float((a - b).abs().max()) / (float(b.abs().max()) or 1.0)


def _compare_rank(comm, balance: dict) -> dict:
    y0, g0, calls0 = _step(_layer(comm, 0), comm)
    moe = _layer(comm, 0, **balance)
    y1, g1, calls1 = _step(moe, comm)
    plan = moe.last_plan.global_plan
    total = int(plan.caps.sum())
    return {
        "out": _rel(y1, y0),
        "grad": max(_rel(a, b) for a, b in zip(g1, g0)),
        "rows": int(plan.caps.max()),
        "exact_rows": -(-total // comm.world_size),
        "bound": planner.row_bound(total, comm.world_size, moe.buffer.max_slack),
        "replicas": plan.num_replicas,
        "calls": (calls0, calls1),
    }


BALANCES = {
    "slack": {"slack": 0.25},
    "cost-no-copies": {"cost": planner.CostModel(row_seconds=0.0, copy_seconds=1.0, max_slack=64.0)},  # none pays
    "cost-rows": {"cost": planner.CostModel(row_seconds=1.0, copy_seconds=1e-9, max_slack=0.5, candidates=3)},
}


@pytest.mark.parametrize(
    "world_size,case", [(2, "slack"), (2, "cost-no-copies"), (2, "cost-rows"), (3, "slack"), (3, "cost-no-copies")]
)
def test_balanced_layer_computes_the_exact_function(world_size: int, case: str):
    balance = BALANCES[case]
    got = launch(_compare_rank, world_size, timeout=30, job_timeout=240, balance=balance)
    assert got["out"] < 1e-5 and got["grad"] < 1e-5, got
    assert got["rows"] <= got["bound"], got
    calls_exact, calls_ours = got["calls"]
    if got["replicas"] == 0:  # the weight push and the grad reduce (one exchange each, both projections) skipped
        assert calls_ours == calls_exact - 2, got
    else:
        assert calls_ours == calls_exact, got


def test_free_copies_keep_the_exact_plan_and_costly_copies_drop_them():
    got = launch(
        _compare_rank,
        2,
        timeout=30,
        job_timeout=120,
        balance={"cost": planner.CostModel(row_seconds=1, copy_seconds=0)},
    )
    assert got["replicas"] > 0 and got["rows"] == got["exact_rows"]
    got = launch(
        _compare_rank,
        2,
        timeout=30,
        job_timeout=120,
        balance={"cost": planner.CostModel(row_seconds=0, copy_seconds=1)},
    )
    assert got["replicas"] == 0


def _reads_rank(comm) -> int:
    moe = _layer(comm, 0, cost=planner.CostModel(row_seconds=1.0, copy_seconds=3.0))
    x = torch.randn(S, H, requires_grad=True)
    moe(x).sum().backward()  # warm-up
    with HostReads(exempt=CPU_KERNEL_ENTRIES) as reads:
        moe(x).sum().backward()
    return reads.count


def test_cost_aware_layer_keeps_one_host_read():
    assert launch(_reads_rank, 2, timeout=30, job_timeout=120) == 1


def _measure_rank(comm) -> list[tuple[float, float]]:
    cost = moonep.measure_cost_model(comm, H=16, F=32, tokens=64, reps=2)
    mine = torch.tensor([cost.row_seconds, cost.copy_seconds], dtype=torch.float64)
    every = torch.empty(2 * comm.world_size, dtype=torch.float64)
    comm.all_gather(every, mine)
    return [tuple(v) for v in every.view(-1, 2).tolist()]


def test_measured_cost_model_is_the_same_on_every_rank():
    models = launch(_measure_rank, 2, timeout=30, job_timeout=120)
    assert models[0] == models[1] and models[0][0] > 0 and models[0][1] > 0, models


def _measure_mid_step_rank(comm) -> float:
    """A layer whose shapes share the cost probe's pools (E = 2R, same H and F): its grads with a measurement
    between its forward and backward, against the same step undisturbed."""
    grads = []
    for measure in (False, True):
        torch.manual_seed(0)
        moe = moonep.MoE(comm, H=H, F=F, E=2 * comm.world_size, K=K, S=S)
        with torch.no_grad():
            moe.router.bias[0] = 5.0  # the exact plan replicates: the shared pools hold this step's replicas
        x = torch.randn(S, H, generator=torch.Generator().manual_seed(comm.rank))
        y = moe(x)
        if measure:
            moonep.measure_cost_model(comm, H=H, F=F, tokens=S, reps=1)
        y.square().sum().backward()
        grads.append([p.grad for p in moe.parameters()])
    worst = torch.tensor([max(_rel(a, b) for a, b in zip(*grads))], dtype=torch.float64)
    return comm.all_reduce(worst, "max").item()


def test_measuring_between_forward_and_backward_leaves_the_step_exact():
    """The probe pushes into the pools a layer's step may be using; the step pushes its replicas again."""
    assert launch(_measure_mid_step_rank, 2, timeout=30, job_timeout=120) < 1e-6


def test_one_rank_prices_rows_and_no_copy():
    (model,) = launch(_measure_rank, 1, timeout=30, job_timeout=60)
    assert model[0] > 0 and model[1] == 0.0, model


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"slack": -1.0}, "slack must be in"),
        ({"cost": "cheap"}, "cost must be a planner.CostModel"),
        ({"slack": 0.1, "cost": planner.CostModel(row_seconds=1, copy_seconds=1)}, "not both"),
    ],
)
def test_bad_balance_options_are_named(kwargs, words):
    assert words in launch(_bad_rank, 1, timeout=30, job_timeout=60, kwargs=kwargs)


def _bad_rank(comm, kwargs) -> str:
    try:
        moonep.Buffer(comm, S=4, H=4, K=1, E=2, **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"


def _overlap_rank(comm) -> list[str]:
    """The forward's exchanges and expert segments in order: 'start:<rows>' and 'wait:<rows>' of every started
    all-to-all, 'own:<g>' / 'slot:<g>' when the expert math starts a group's segment."""
    moe = _layer(comm, 0)  # exact plan with a hot expert: replicas, so weights move
    events, start, project = [], comm.all_to_all_single_start, expert_math._project_in

    def logged(out, inp, *args, **kwargs):
        tag = f"{inp.shape[0]}x{inp[0].numel() if inp.shape[0] else 0}"
        pending = start(out, inp, *args, **kwargs)
        events.append(f"start:{tag}")
        wait = pending.wait

        def waited():
            events.append(f"wait:{tag}")
            wait()

        pending.wait = waited
        return pending

    def segment(layout, ws, g, *args):
        events.append(f"{'own' if g < moe.epn else 'slot'}:{g}")
        return project(layout, ws, g, *args)

    comm.all_to_all_single_start, expert_math._project_in = logged, segment
    try:
        moe(torch.randn(S, H))
    finally:
        del comm.all_to_all_single_start
        expert_math._project_in = project
    assert moe.last_plan.global_plan.num_replicas > 0
    return events


def _check_overlap(comm) -> str:
    events = _overlap_rank(comm)
    rows_landed = next(i for i, e in enumerate(events) if e.startswith("wait:") and e.endswith(f"x{H}"))
    push = next(i for i, e in enumerate(events) if i > rows_landed and e.startswith("start:"))
    tag = events[push].split(":")[1]  # a copy's both projections in one row; 0x0 on a rank that pushes none
    assert tag == "0x0" or tag.endswith(f"x{H * 2 * F + F * H}"), events
    push_waits = [i for i, e in enumerate(events) if e == f"wait:{tag}"]
    own = [i for i, e in enumerate(events) if e.startswith("own:")]
    slots = [i for i, e in enumerate(events) if e.startswith("slot:")]
    assert push_waits and rows_landed < push < own[0] <= own[-1] < push_waits[0], events
    assert all(i > push_waits[0] for i in slots), events
    return "ok"


def test_weight_push_flies_while_the_own_experts_compute():
    """The weight push (both projections of a copy in one row) starts once the token rows have landed and is
    waited for only after the expert step computed this rank's own experts, before its first replica slot (on
    every rank: a failed check on any rank fails the launch)."""
    assert launch(_check_overlap, 2, timeout=30, job_timeout=60) == "ok"
