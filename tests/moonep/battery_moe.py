"""MoE-layer numerics and bad-input checks for the launched battery (see battery.py).

The MoE reference is a single-process dense layer holding ALL experts: every rank regenerates all ranks'
tokens from the seed, runs a plain loop-over-experts MoE on them, and compares its own rows and its own
experts' grads (router / shared-expert grads are all-reduced first, as data parallelism would).
"""

from __future__ import annotations

import copy

import torch

import moonep
from moonep.buffer import Buffer
from moonep.moe import SharedExpert, SigmoidTopKRouter
from moonep.reference import dense_moe
from tests.moonep.battery import num_experts, routing

H, F, S = 8, 4, 8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (normwise over the tensor; 0 when both vanish)."""
    scale = float(b.abs().max()) or 1.0
    return float((a - b).abs().max()) / scale


def _layer_params(seed: int, E: int, K: int, shared: bool, bias_hot: float):
    g = torch.Generator().manual_seed(seed)
    router = SigmoidTopKRouter(H, E, K)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g) / H**0.5)
        router.bias[:K] = bias_hot  # selection-only bias: hot > 0 routes every token to experts 0..K-1
    w13 = torch.randn(E, H, 2 * F, generator=g) / H**0.5
    w2 = torch.randn(E, F, H, generator=g) / F**0.5
    sh = None
    if shared:
        sh = SharedExpert(H, F)
        with torch.no_grad():
            sh.w13.copy_(torch.randn(H, 2 * F, generator=g))
            sh.w2.copy_(torch.randn(F, H, generator=g))
    return router, w13, w2, sh


def check_moe(
    comm, K: int, bias_hot: float, sizes: list[int], layers: int = 1, shared: bool = False, tp: int = 1
) -> str | None:
    """Forward, input grads, router grads and EVERY expert's grads equal the dense reference (fp32, 1e-5)."""
    R, r = comm.world_size, comm.rank
    E = num_experts(R)
    epn = E // R
    buf = Buffer(comm, S=max(sizes), H=H, K=K, E=E, token_padding=tp)
    params = [_layer_params(11 + i, E, K, shared, bias_hot) for i in range(layers)]
    moes, refs = [], []
    for router, w13, w2, sh in params:
        m = moonep.MoE(comm, H=H, F=F, E=E, K=K, S=max(sizes), router=copy.deepcopy(router), buffer=buf)
        m.shared = copy.deepcopy(sh)
        with torch.no_grad():
            m.w13.copy_(w13[r * epn : (r + 1) * epn])
            m.w2.copy_(w2[r * epn : (r + 1) * epn])
        moes.append(m)
        refs.append(
            (copy.deepcopy(router), w13.clone().requires_grad_(), w2.clone().requires_grad_(), copy.deepcopy(sh))
        )
    xs = [torch.randn(n, H, generator=torch.Generator().manual_seed(100 + q)) for q, n in enumerate(sizes)]
    gs = [torch.randn(n, H, generator=torch.Generator().manual_seed(200 + q)) for q, n in enumerate(sizes)]
    total = sum(sizes) if len(set(sizes)) > 1 else None
    x = xs[r].clone().requires_grad_()
    y = x
    for m in moes:
        y = m(y, total_num_tokens=total)
    (y * gs[r]).sum().backward()
    X = torch.cat(xs).requires_grad_()
    Y = X
    for router, w13, w2, sh in refs:
        Y = dense_moe(Y, router, w13, w2, sh)
    (Y * torch.cat(gs)).sum().backward()
    lo = sum(sizes[:r])
    problems = {
        "out": _rel(y.detach(), Y.detach()[lo : lo + sizes[r]]),
        "x.grad": _rel(x.grad, X.grad[lo : lo + sizes[r]]),
    }
    for i, (m, (router, w13, w2, sh)) in enumerate(zip(moes, refs)):
        rg = comm.all_reduce(m.router.weight.grad.clone(), "sum")
        problems[f"layer{i}.router.grad"] = _rel(rg, router.weight.grad)
        problems[f"layer{i}.w13.grad"] = _rel(m.w13.grad, w13.grad[r * epn : (r + 1) * epn])
        problems[f"layer{i}.w2.grad"] = _rel(m.w2.grad, w2.grad[r * epn : (r + 1) * epn])
        if sh is not None:
            for name in ("w13", "w2"):
                got = comm.all_reduce(getattr(m.shared, name).grad.clone(), "sum")
                problems[f"layer{i}.shared.{name}.grad"] = _rel(got, getattr(sh, name).grad)
    bad = {k: v for k, v in problems.items() if not v <= 1e-5}
    if bad:
        return f"relative errors above 1e-5: {bad}"
    if bias_hot and R > 1 and moes[0].last_plan.global_plan.num_replicas == 0:
        return "hot routing made no replicas: the check would not exercise prefetch/reduce_grad"
    return None


def check_classic(comm, bias_hot: float) -> str | None:
    """The benchmark's baseline dispatcher is a second twin: forward and grads equal the dense reference."""
    from moonep.baseline import classic_moe

    R, r = comm.world_size, comm.rank
    E, K = num_experts(R), 2
    epn = E // R
    router, w13, w2, _ = _layer_params(5, E, K, False, bias_hot)
    X = torch.randn(S * R, H, generator=torch.Generator().manual_seed(7)).requires_grad_()
    G = torch.randn(S * R, H, generator=torch.Generator().manual_seed(8))
    W13, W2 = w13.clone().requires_grad_(), w2.clone().requires_grad_()
    (dense_moe(X, router, W13, W2) * G).sum().backward()
    x = X.detach()[r * S : (r + 1) * S].clone().requires_grad_()
    my13, my2 = (
        w13[r * epn : (r + 1) * epn].clone().requires_grad_(),
        w2[r * epn : (r + 1) * epn].clone().requires_grad_(),
    )
    idx, tw = router(x)
    y = classic_moe(comm, x, topk_idx=idx, topk_weights=tw, w13=my13, w2=my2, E=E)
    (y * G[r * S : (r + 1) * S]).sum().backward()
    with torch.no_grad():
        Y = dense_moe(X, router, w13, w2)
    problems = {
        "out": _rel(y.detach(), Y[r * S : (r + 1) * S]),
        "x.grad": _rel(x.grad, X.grad[r * S : (r + 1) * S]),
        "w13.grad": _rel(my13.grad, W13.grad[r * epn : (r + 1) * epn]),
        "w2.grad": _rel(my2.grad, W2.grad[r * epn : (r + 1) * epn]),
    }
    bad = {k: v for k, v in problems.items() if not v <= 1e-5}
    return f"classic baseline differs from the dense reference: {bad}" if bad else None


def moe_checks(comm) -> dict:
    R = comm.world_size
    return {
        "classic_baseline_random": lambda: check_classic(comm, 0.0),
        "classic_baseline_hot": lambda: check_classic(comm, 100.0),
        "moe_random": lambda: check_moe(comm, 2, 0.0, [S] * R),
        "moe_all_to_experts_0_to_K": lambda: check_moe(comm, 2, 100.0, [S] * R, tp=2),
        "moe_every_token_to_one_expert": lambda: check_moe(comm, 1, 100.0, [S] * R),
        "moe_varlen_shared": lambda: check_moe(comm, 2, 0.0, [3 + 2 * q for q in range(R)], shared=True),
        "moe_two_layers_shared_pools": lambda: check_moe(comm, 2, 100.0, [6] * R, layers=2),
    }


def _bad(comm, case: str) -> str | None:
    """Rank R-1 passes a bad argument; every rank must raise ValueError naming that rank and the problem."""
    R, r = comm.world_size, comm.rank
    E, K, s = num_experts(R), 2, 5
    buf = Buffer(comm, S=s, H=6, K=K, E=E)
    x, w, idx = routing("random", R, r, s, K, E, 9)
    tpe, total = None, None
    culprit = r == R - 1
    key = {
        "id_too_big": "outside",
        "id_negative": "outside",
        "id_float": "integer",
        "hidden_shape": "hidden",
        "hidden_dtype": "hidden",
        "hidden_device": "hidden",
        "s_gt_S": "exceeds",
        "tpe_mismatch": "slots_per_expert",
        "total_differs": "total_num_tokens",
        "nan_weights": "NaN",
        "combine_shape": "expert_out",
    }[case]
    if culprit:
        if case == "id_too_big":
            idx[0, 0] = E
        elif case == "id_negative":
            idx[1, 1] = -2
        elif case == "id_float":
            idx = idx.float()
        elif case == "hidden_shape":
            x = torch.zeros(s, 7)
        elif case == "hidden_dtype":
            x = x.double()
        elif case == "hidden_device":
            x = torch.empty(s, 6, device="meta")
        elif case == "s_gt_S":
            x, w, idx = routing("random", R, r, s + 1, K, E, 9)
        elif case == "tpe_mismatch":
            tpe = torch.bincount(idx.reshape(-1), minlength=E)
            tpe[0] += 1
        elif case == "nan_weights":
            w[2, 0] = float("nan")
    if case == "total_differs":
        total = R * s + (1 if culprit else 0)
    verdict = f"{case}: no error raised"
    try:
        recv, recv_w, cu, plan = buf.dispatch(
            x, topk_idx=idx, topk_weights=w, slots_per_expert=tpe, total_num_tokens=total
        )
        if case == "combine_shape":
            buf.combine(plan, recv[:-1] if culprit else recv)
            verdict = f"{case}: combine raised no error"
    except ValueError as exc:
        msg = str(exc)
        verdict = None
        if f"rank {R - 1}" not in msg or key not in msg:
            verdict = f"{case}: message does not name rank {R - 1} and '{key}': {msg}"
    # every rank (whatever its verdict) checks that the group is still in step: a good round trip works
    x, w, idx = routing("random", R, r, s, K, E, 9)
    recv, _, _, plan = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    out, _ = buf.combine(plan, recv)
    if not torch.allclose(out, x * K):
        return f"{case}: the round trip after the error is wrong"
    return verdict


def bad_input_checks(comm) -> dict:
    cases = (
        "id_too_big",
        "id_negative",
        "id_float",
        "hidden_shape",
        "hidden_dtype",
        "hidden_device",
        "s_gt_S",
        "tpe_mismatch",
        "total_differs",
        "nan_weights",
        "combine_shape",
    )
    return {f"bad_{c}": (lambda c=c: _bad(comm, c)) for c in cases}
