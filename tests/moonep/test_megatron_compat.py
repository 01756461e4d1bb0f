"""moonep.compat.megatron.MoonEPTokenDispatcher called in Megatron's stage order on real gloo ranks.

One launch per world size (1, 2, 4) runs every check. The expert is a per-expert linear map applied to the
dispatched tokens over the dispatcher's [2*epn] weight view, times ``permuted_probs`` (Megatron's experts apply
the probs). Each rank compares its output, its input and probs grads and its own experts' weight grads with a
single-process dense reference that regenerates every rank's inputs and holds all experts (fp32, 1e-5 relative).
"""

import functools
import importlib.util

import pytest
import torch

from collectives import launch
from tests.distributed import run_checks

H, EPN, K, TOL = 6, 3, 2, 1e-5
CASES = ("random", "one_expert", "hot", "fewer", "varlen_3d", "grow", "padded")
BAD = {  # case -> what every rank's message must start with (after "MoonEPTokenDispatcher: rank <last>: ")
    "bad_map_shape": "routing_map must be a bool tensor of shape",
    "bad_map_dtype": "routing_map must be a bool tensor of shape",
    "bad_probs_nan": "probs holds NaN or infinite values",
    "bad_too_many": "routing_map selects more than moe_router_topk",
    "bad_hidden": "hidden_states must be a tensor whose last dimension",
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both vanish)."""
    return float((a - b).abs().max()) / (float(b.abs().max()) or 1.0)


def _inputs(case: str, rank: int, R: int):
    """Rank ``rank``'s tokens: (x [s, H] or [s, 1, H], routing_map [s, E] bool, probs [s, E], upstream grad)."""
    g = torch.Generator().manual_seed(1000 * CASES.index(case) + rank)
    E = EPN * R
    s = {"varlen_3d": 3 + 2 * rank, "grow": 13}.get(case, 7)
    x = torch.randn(s, H, generator=g)
    scores = torch.rand(s, E, generator=g) + 0.1
    chosen = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)])
    if case in ("one_expert", "hot"):
        chosen[:, 0] = 0  # every token to expert 0 (hot: plus one more)
    rm = torch.zeros(s, E, dtype=torch.bool).scatter_(1, chosen, True)
    if case == "one_expert":
        rm = torch.zeros_like(rm)
        rm[:, 0] = True
    if case == "fewer":  # tokens with K, 1 and 0 selected experts
        for t in range(s):
            rm[t, chosen[t, t % (K + 1) :]] = False
    probs = torch.where(rm, scores, torch.zeros_like(scores))
    probs = probs / probs.sum(1, keepdim=True).clamp(min=1e-6)
    shape = (s, 1, H) if case == "varlen_3d" else (s, H)
    return x.view(shape), rm, probs, torch.randn(shape, generator=g)


def _weights(R: int) -> torch.Tensor:
    return torch.randn(EPN * R, H, H, generator=torch.Generator().manual_seed(7)) / H**0.5


def _dense(case: str, R: int):
    """Reference holding all experts: per-rank (out, x.grad, probs.grad) and the all-expert weight grad."""
    W = _weights(R).requires_grad_()
    per_rank, loss = [], 0.0
    for i in range(R):
        x, rm, probs, G = _inputs(case, i, R)
        x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
        x2 = x.reshape(-1, H)
        out = sum((rm[:, e] * probs[:, e])[:, None] * (x2 @ W[e]) for e in range(EPN * R)).view(x.shape)
        loss = loss + (out * G).sum()
        per_rank.append((out, x, probs))
    loss.backward()
    return [(o.detach(), x.grad, p.grad) for o, x, p in per_rank], W.grad


def _megatron_order(d, x, rm, probs, W_local, G):
    """The six stages as Megatron's MoELayer calls them, a linear expert in between, then backward."""
    h, p = d.dispatch_preprocess(x, rm, probs)
    h, p = d.token_dispatch(h, p)
    h, tokens_per_expert, permuted_probs = d.dispatch_postprocess(h, p)
    h, (W,) = d.expert_weights(h, W_local)
    groups = torch.split(h, tokens_per_expert.tolist())
    y = torch.cat([xg @ W[g] for g, xg in enumerate(groups)]) * permuted_probs[:, None]
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(y)))
    (out * G).sum().backward()
    return out, tokens_per_expert, h.shape[0]


def _numerics(comm, d, case: str) -> str | None:
    R, r = comm.world_size, comm.rank
    x, rm, probs, G = _inputs(case, r, R)
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    W_local = _weights(R)[r * EPN : (r + 1) * EPN].clone().requires_grad_()
    out, tpe, rows = _megatron_order(d, x, rm, probs, W_local, G)
    ref, ref_gw = _dense(case, R)
    ref_out, ref_gx, ref_gp = ref[r]
    problems = []
    if out.shape != x.shape:
        problems.append(f"output shape {tuple(out.shape)} != input shape {tuple(x.shape)}")
    for name, got, want in (
        ("output", out, ref_out),
        ("x.grad", x.grad, ref_gx),
        ("probs.grad", probs.grad, ref_gp),
        ("expert grads", W_local.grad, ref_gw[r * EPN : (r + 1) * EPN]),
    ):
        if got is None or got.shape != want.shape:
            problems.append(f"{name} is {None if got is None else tuple(got.shape)}, want {tuple(want.shape)}")
        elif _rel(got, want) > TOL:
            problems.append(f"{name} differs: rel {_rel(got, want):.3g}")
    if tpe.numel() != 2 * EPN or int(tpe.sum()) != rows or (tpe % d.token_padding).any():
        problems.append(f"tokens_per_expert {tpe.tolist()} is not [2*epn] padded segments summing to {rows}")
    caps = d.plan.global_plan.caps
    if int(caps.max()) - int(caps.min()) > 1 or int(caps.sum()) != int(
        sum(_inputs(case, i, R)[1].sum() for i in range(R))
    ):
        problems.append(f"rows per rank {caps.tolist()} are not the balanced split of the routed slots")
    return "; ".join(problems) or None


def _bad_input(comm, d, case: str) -> str | None:
    """Only the last rank passes bad input; every rank must raise the same ValueError before any row moves."""
    R, r = comm.world_size, comm.rank
    x, rm, probs, _ = _inputs("random", r, R)
    if r == R - 1:
        if case == "bad_map_shape":
            rm = rm[:, :-1]
        elif case == "bad_map_dtype":
            rm = rm.float()
        elif case == "bad_probs_nan":
            probs = probs.clone()
            probs[2][rm[2]] = float("nan")
        elif case == "bad_too_many":
            rm = rm.clone()
            rm[0] = True
        elif case == "bad_hidden":
            x = torch.randn(x.shape[0], H + 1)
    try:
        d.token_dispatch(*d.dispatch_preprocess(x, rm, probs))
    except ValueError as exc:
        want = f"MoonEPTokenDispatcher: rank {R - 1}: {BAD[case]}"
        if not str(exc).startswith(want):
            return f"message {str(exc)!r} does not start with {want!r}"
        if r == R - 1 and "(" not in str(exc)[len(want) :]:
            return f"the failing rank's message has no detail: {exc}"
        return None
    return "no ValueError"


def _foreign_layout(comm, cfg) -> str | None:
    """Experts not in Megatron's contiguous per-rank layout are refused at construction."""
    from moonep.compat.megatron import MoonEPTokenDispatcher

    try:
        MoonEPTokenDispatcher(EPN, [comm.rank * EPN + 1, comm.rank * EPN], cfg, comm)
    except ValueError as exc:
        return None if "must own experts" in str(exc) else str(exc)
    return "no ValueError"


def megatron_checks(comm):
    from moonep.compat.megatron import MoonEPDispatcherConfig, MoonEPTokenDispatcher

    R, r = comm.world_size, comm.rank
    cfg = MoonEPDispatcherConfig(num_moe_experts=EPN * R, moe_router_topk=K, hidden_size=H)
    mine = list(range(r * EPN, (r + 1) * EPN))
    d = MoonEPTokenDispatcher(EPN, mine, cfg, comm)  # one dispatcher for all checks: its Buffer is reused/grown
    padded = MoonEPTokenDispatcher(EPN, mine, cfg, comm, token_padding=4, max_tokens=16)
    checks = {c: functools.partial(_numerics, comm, padded if c == "padded" else d, c) for c in CASES}
    checks.update({c: functools.partial(_bad_input, comm, d, c) for c in BAD})
    checks["recovers"] = functools.partial(_numerics, comm, d, "random")  # after the refused calls
    checks["grew"] = lambda: None if d.buffer.S == 13 and padded.buffer.S == 16 else f"S={d.buffer.S}"
    checks["foreign_layout"] = functools.partial(_foreign_layout, comm, cfg)
    verdicts = run_checks(comm, checks)
    if R == 2 and _have_megatron():  # the MoELayer check shares this launch (megatron imports take seconds)
        verdicts.update({f"layer_{k}": v for k, v in megatron_layer_check(comm).items()})
    return verdicts


@functools.cache
def job(world_size):
    return launch(megatron_checks, world_size, timeout=60, job_timeout=240)


@pytest.mark.spawns
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("check", [*CASES, *BAD, "recovers", "grew", "foreign_layout"])
def test_megatron_dispatcher(world_size, check):
    assert job(world_size)[check] is None, job(world_size)[check]


def test_constructor_needs_a_group():
    from moonep.compat import MoonEPDispatcherConfig, MoonEPTokenDispatcher  # the package exports them

    cfg = MoonEPDispatcherConfig(num_moe_experts=4, moe_router_topk=2, hidden_size=H)
    with pytest.raises(ValueError, match="needs pg_collection"):
        MoonEPTokenDispatcher(4, range(4), cfg)
    with pytest.raises(ValueError, match="Communicator or a torch ProcessGroup"):
        MoonEPTokenDispatcher(4, range(4), cfg, object())


# ------------------------------------------------------------------------ inside megatron-core's MoELayer
def _megatron_layer(ep_group, solo_group, cfg, E: int):
    """A megatron-core MoELayer (SequentialMLP experts of ColumnParallel/RowParallelLinear) on CPU groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    pgc = ProcessGroupCollection()
    for name in ("tp", "cp", "tp_cp", "tp_dp_cp", "expt_tp", "pp", "expt_dp"):
        setattr(pgc, name, solo_group)
    pgc.ep = pgc.tp_ep = ep_group
    spec = MoESubmodules(
        experts=ModuleSpec(
            module=SequentialMLP,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        )
    )
    return MoELayer(cfg, spec, layer_number=1, pg_collection=pgc), pgc


def _layer_forward_backward(m, x, G):
    """MoELayer.forward's stages (route, preprocess, dispatch, experts, combine, postprocess), then backward.

    The router's gating is computed here in fp32 (megatron-core's gating moves its weight to CUDA); the
    routing itself (softmax top-k) is megatron's."""
    probs, routing_map = m.router.routing(x.view(-1, x.shape[-1]) @ m.router.weight.t())
    h, p = m.dispatch(*m.preprocess(x, probs, routing_map))
    out, _ = m.routed_experts_compute(h, p)
    out = m.postprocess(m.combine(out), None)
    (out * G).sum().backward()
    return out


def megatron_layer_check(comm) -> dict:
    """Swap MoonEPTokenDispatcher (+ SequentialExperts) into a megatron MoELayer; compare with megatron's own
    layer holding all experts on one rank (its allgather dispatcher) on every rank's tokens."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moonep.compat.megatron import MoonEPTokenDispatcher, SequentialExperts

    R, r = comm.world_size, comm.rank
    E, F = EPN * R, 4
    solo = [dist.new_group([i]) for i in range(R)][r]
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=1,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_ffn_hidden_size=F,
        ffn_hidden_size=F,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        expert_model_parallel_size=R,
    )
    layer, pgc = _megatron_layer(dist.group.WORLD, solo, cfg, E)
    ref, _ = _megatron_layer(solo, solo, dataclasses.replace(cfg, expert_model_parallel_size=1), E)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for q in ref.parameters():
            q.copy_(torch.randn(q.shape, generator=g) / 2)
        ref.router.weight[0] = 1.0  # with inputs offset by +1, expert 0 is hot: replicas are needed
        layer.router.weight.copy_(ref.router.weight)
        for i, ex in enumerate(layer.experts.local_experts):
            for q, w in zip(ex.parameters(), ref.experts.local_experts[r * EPN + i].parameters()):
                q.copy_(w)
    inputs = [(torch.randn(8, 1, H, generator=g) + 1, torch.randn(8, 1, H, generator=g)) for _ in range(R)]
    want = [(_layer_forward_backward(ref, x.requires_grad_(), G).detach(), x) for x, G in inputs]
    layer.token_dispatcher = MoonEPTokenDispatcher(layer.num_local_experts, layer.local_expert_indices, cfg, pgc)
    layer.experts = SequentialExperts(layer.experts, layer.token_dispatcher)
    x, G = inputs[r][0].detach().clone().requires_grad_(), inputs[r][1]
    out = _layer_forward_backward(layer, x, G)
    router_grad = layer.router.weight.grad.clone()
    comm.all_reduce(router_grad, "sum")  # replicated router: its grad is a per-rank partial sum

    def numerics():
        pairs = [
            ("output", out, want[r][0]),
            ("x.grad", x.grad, want[r][1].grad),
            ("router grad", router_grad, ref.router.weight.grad),
        ]
        for i, ex in enumerate(layer.experts.experts.local_experts):
            mine = ref.experts.local_experts[r * EPN + i]
            pairs += [
                (f"expert {r * EPN + i} {n}", q.grad, w.grad)
                for (n, q), w in zip(ex.named_parameters(), mine.parameters())
            ]
        bad = [
            f"{n}: {'no grad' if a is None else f'rel {_rel(a, b):.3g}'}"
            for n, a, b in pairs
            if a is None or _rel(a, b) > TOL
        ]
        return "; ".join(bad) or None

    def replicas():
        used = int((layer.token_dispatcher.plan.global_plan.experts_to_copy >= 0).sum())
        return None if R == 1 or used else "the hot expert was not replicated: the check proves little"

    return run_checks(comm, {"numerics": numerics, "replicas": replicas})


def _have_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:
        return False


@pytest.mark.spawns
@pytest.mark.skipif(not _have_megatron(), reason="megatron-core is not installed (CPU wheel: pip install --no-deps)")
@pytest.mark.parametrize("check", ["numerics", "replicas"])
def test_inside_megatron_moe_layer(check):
    assert job(2)[f"layer_{check}"] is None, job(2)[f"layer_{check}"]
