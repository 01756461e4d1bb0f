"""``moonep.integrations.torchtitan`` inside a real torchtitan 0.3 Qwen3-MoE model (tiny config built here, no
download) over 4 gloo ranks, against the unmodified model in one process: logits, loss, every gradient and one
SGD step, through both ways in (``parallelize`` on a built model, ``use_moonep`` on its config). EP 4 only (the
HF test covers EP 2 and 4; one launch keeps the added test time small).

On CPU: torchtitan's language-model attention backends (flex, varlen) need a GPU, so every ``inner_attention``
config is swapped to ``ScaledDotProductAttention`` (causal; ``positions`` and masks are not passed). torchtitan's
``GroupedExperts`` computes in bf16 (it casts x and the weights); the 1e-5 reference runs the same per-expert
formula in fp32 (``_fp32_experts``), and the stock bf16 model is checked within bf16 accuracy.
"""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn.functional as Fn

from collectives import launch
from tests.moonep.titan import integration as _tt

if sys.version_info < (3, 11):  # torchtitan 0.3 needs Python >= 3.11; make test installs it there, and only there
    pytest.skip("torchtitan 0.3 requires Python >= 3.11 (make test installs it on 3.11+)", allow_module_level=True)

V, D, HD, E, K, L, B, LR, TOL = 64, 16, 8, 8, 2, 5, 2, 0.5, 1e-5


def _config():
    """Tiny Qwen3-MoE (2 layers, 8 experts, top-2) from torchtitan's own builders, attention swapped to SDPA."""
    import torchtitan.models.qwen3 as q3  # heavy: torchtitan
    from torchtitan.models.common.attention import ScaledDotProductAttention  # heavy: torchtitan
    from torchtitan.models.common.embedding import Embedding  # heavy: torchtitan
    from torchtitan.models.common.linear import Linear  # heavy: torchtitan
    from torchtitan.models.common.rope import CosSinRoPE  # heavy: torchtitan

    layers = q3._build_qwen3_moe_layers(
        n_layers=2, dim=D, n_heads=2, n_kv_heads=1, head_dim=HD, moe_hidden_dim=8, num_experts=E, top_k=K,
        attn_backend="flex", moe_comm_backend="standard", rope=CosSinRoPE.Config(dim=HD, max_seq_len=64, theta=1e4),
    )  # fmt: skip
    cfg = q3.Qwen3Model.Config(
        vocab_size=V,
        dim=D,
        norm=q3._qwen3_norm(D),
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=D, param_init=q3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=D, out_features=V, param_init=q3._LINEAR_INIT),
        layers=layers,
    )
    for layer in cfg.layers:  # flex attention needs a GPU on this path; SDPA runs anywhere
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def _model():
    torch.manual_seed(0)  # the same weights on every rank
    model = _config().build()
    model.init_states()
    return model


def _fp32_experts(self, x_RD, tokens_per_expert_E):
    """torchtitan's GroupedExperts formula (rows sorted by expert) in fp32: silu(x w1^T) * (x w3^T) w2^T."""
    out, start = [], 0
    for e, n in enumerate(tokens_per_expert_E.tolist()):
        xs = x_RD[start : start + n]
        start += n
        out.append((Fn.silu(xs @ self.w1_EFD[e].t()) * (xs @ self.w3_EFD[e].t())) @ self.w2_EDF[e].t())
    return torch.cat(out)


def _fp32(model):
    from torchtitan.models.common.moe import GroupedExperts  # heavy: torchtitan

    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.forward = types.MethodType(_fp32_experts, m)
    return model


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, V, (B, L + 1), generator=torch.Generator().manual_seed(200 + rank))


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return logits, Fn.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))


def _rel(a, b) -> float:
    a = torch.zeros_like(b) if a is None else a
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _is_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _tt().WEIGHTS


def _errors(comm, model, ref, mine) -> dict[str, float]:
    """Logits, loss, grads (replicated ones summed over ranks), one SGD step: worst relative error each."""
    R, r = comm.world_size, comm.rank
    ref_out = [_loss(ref, _batch(q)) for q in range(R)]
    sum(loss for _, loss in ref_out).backward()  # moonep's convention: the sum of every EP rank's loss
    logits, loss = _loss(model, _batch(r))
    loss.backward()
    err = {"logits": _rel(logits, ref_out[r][0]), "loss": abs(loss.item() - ref_out[r][1].item())}
    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if _is_expert(n):
            err[n] = _rel(p.grad, refp[n].grad[mine])
        else:
            p.grad = comm.all_reduce(torch.zeros_like(p) if p.grad is None else p.grad, "sum")
            err[n] = _rel(p.grad, refp[n].grad)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    for n, p in model.named_parameters():
        err["step:" + n] = _rel(p.detach(), refp[n].detach()[mine] if _is_expert(n) else refp[n].detach())
    return err


def _tt_rank(comm) -> dict:
    R, r = comm.world_size, comm.rank
    mine = slice(r * E // R, (r + 1) * E // R)
    stock = _model()
    ref, built = _fp32(copy.deepcopy(stock)), _tt().parallelize(copy.deepcopy(stock), comm)
    with torch.no_grad():
        bf16 = {"stock_bf16_logits": _rel(built(_batch(r)[:, :-1]), stock(_batch(r)[:, :-1]))}
    cfg = _config()
    assert _tt().use_moonep(cfg, comm) == 2
    via_cfg = cfg.build()
    state = {k: v[mine] if _is_expert(k) else v for k, v in stock.state_dict().items()}
    via_cfg.load_state_dict(state, strict=True)
    out = {
        "parallelize": _errors(comm, built, ref, mine),
        "use_moonep": _errors(comm, via_cfg, _fp32(copy.deepcopy(stock)), mine),
    }
    out["bf16"] = bf16
    worst = {}
    for way, err in out.items():
        names = sorted(err)
        vals = comm.all_reduce(torch.tensor([err[n] for n in names], dtype=torch.float64), "max")
        worst[way] = dict(zip(names, vals.tolist()))
    return worst


@pytest.mark.spawns
@pytest.mark.slow
def test_torchtitan_qwen3_moe_expert_parallel_equals_the_unmodified_model():
    worst = launch(_tt_rank, 4, timeout=60, job_timeout=300)  # EP 4: every rank holds 2 of the 8 experts
    assert worst["bf16"]["stock_bf16_logits"] < 2e-2, worst["bf16"]  # stock torchtitan: bf16 expert GEMMs
    for way in ("parallelize", "use_moonep"):
        err = worst[way]
        assert sum(_is_expert(n) for n in err) == 12, sorted(err)  # 2 layers x (w1, w2, w3): grads and steps
        bad = {n: e for n, e in err.items() if e > TOL}
        assert not bad, (way, bad)


class _Comm:  # the argument checks run before any exchange: a world size and rank are all they read
    def __init__(self, world_size: int) -> None:
        self.world_size, self.rank = world_size, 0


def test_wrong_pairings_are_refused_with_one_line():
    from torchtitan.models.common.linear import Linear  # heavy: torchtitan

    with pytest.raises(ValueError, match="Config holds no RoutedExperts.Config"):
        _tt().use_moonep(Linear.Config(in_features=2, out_features=2), _Comm(2))
    with pytest.raises(ValueError, match="has no RoutedExperts"):
        _tt().parallelize(torch.nn.Linear(2, 2), _Comm(2))
    with pytest.raises(ValueError, match="E=8 is not a multiple of the EP size R=3"):
        _tt().MoonEPGroupedExperts(_tt().MoonEPGroupedExperts.Config(dim=D, hidden_dim=8, num_experts=E, comm=_Comm(3)))
    experts = _tt().MoonEPGroupedExperts(_tt().MoonEPGroupedExperts.Config(dim=D, hidden_dim=8, num_experts=E))
    with pytest.raises(TypeError, match="needs MoonEPTokenDispatcher beside it"):
        experts(torch.zeros(3, D), torch.tensor([3] + [0] * (E - 1)))  # torchtitan's stock dispatcher output
