"""``moonep.integrations.hf.parallelize`` on real transformers 5.x models (tiny random configs built here, no
download) over gloo ranks, against the unmodified model in one process: logits, loss, every gradient, one SGD
step, greedy ``generate()`` with a different number of new tokens on every rank (ranks that are done keep the
collective exchanges going) and the ``gather_state_dict`` round trip, for Qwen3-MoE, DeepSeek-V3, Qwen3-Next and
Mixtral at EP 2 and 4 (one launch per EP size runs every family). Inside torch's DDP the model is refused without
``moonep.ignore_in_ddp`` and runs with it. Bad models are refused with one line."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers  # the dev extra: make test installs it, so a missing install fails here instead of skipping

import moonep
from collectives import launch
from moonep.integrations import hf

V, L, B, LR = 64, 5, 2, 0.5
TOL = 1e-5


def _configs() -> dict:
    """Tiny configs of four families on the 5.x seam: 8 experts, top-2, 2 layers (DeepSeek: 1 dense + 1 MoE)."""
    common = {
        "vocab_size": V,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
    }
    common.update(max_position_embeddings=64, tie_word_embeddings=False)
    return {
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **common, num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2
        ),
        "deepseek_v3": transformers.DeepseekV3Config(
            **common,
            num_key_value_heads=2,
            moe_intermediate_size=8,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=4,
            rope_interleave=False,
        ),
        "qwen3_next": transformers.Qwen3NextConfig(  # gated-delta-net + full attention, gated shared expert
            **common,
            num_key_value_heads=1,
            head_dim=8,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=8,
            num_experts=8,
            num_experts_per_tok=2,
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"],
        ),
        "mixtral": transformers.MixtralConfig(  # GELU experts: act_fn reaches moonep as a non-SiLU gated activation
            **common, num_key_value_heads=1, head_dim=8, num_local_experts=8, num_experts_per_tok=2, hidden_act="gelu"
        ),
    }


def _model(cfg) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank, as from_pretrained would give
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # a visible correction bias, so DeepSeek's biased choice is exercised
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.1)
    return model


def _rel(a, b) -> float:
    """max |a - b| / max |b| (None grads read as zeros)."""
    if a is None and b is None:
        return 0.0
    a = torch.zeros_like(b) if a is None else a
    b = torch.zeros_like(a) if b is None else b
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(100 + rank))


def _reference(ref, R: int):
    """The unmodified model in one process: logits per rank's batch, and the SUM of every rank's loss backward
    (moonep's gradient convention), then one SGD step."""
    logits, losses = [], []
    for q in range(R):
        out = ref(_batch(q), labels=_batch(q))
        logits.append(out.logits.detach())
        losses.append(out.loss)
    sum(losses).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    return logits, [x.item() for x in losses], grads


def _family_errors(comm, cfg) -> dict[str, float]:
    """Every check of one family on this rank: the worst relative error per quantity."""
    R, r = comm.world_size, comm.rank
    model = _model(cfg)
    ref, original = copy.deepcopy(model), {k: v.clone() for k, v in model.state_dict().items()}
    hf.parallelize(model, comm)
    err = {}
    saved = hf.gather_state_dict(model, comm)  # the round trip: bit-equal to the original layout and names
    assert saved.keys() == original.keys(), sorted(saved.keys() ^ original.keys())
    err["state_dict"] = max(
        float((saved[k] - v).abs().max()) if saved[k].shape == v.shape else 1.0 for k, v in original.items()
    )
    prompt = _batch(r)[:, :3]
    kw = {"max_new_tokens": 2 + r, "do_sample": False, "pad_token_id": 0}  # rank r is done after 2 + r tokens
    got, want = model.generate(prompt, **kw), ref.generate(prompt, **kw)
    err["generate"] = float((got != want).sum()) if got.shape == want.shape else float("inf")
    ref_logits, ref_losses, ref_grads = _reference(ref, R)
    out = model(_batch(r), labels=_batch(r))
    err["logits"], err["loss"] = _rel(out.logits, ref_logits[r]), abs(float(out.loss) - ref_losses[r])
    out.loss.backward()
    mine, epn = slice(r * 8 // R, (r + 1) * 8 // R), 8 // R
    for n, p in model.named_parameters():
        if getattr(p, "_moonep_expert", False):  # this rank's slice of the experts: the full gradient already
            assert p.shape[0] == epn
            err[n] = _rel(p.grad, ref_grads[n][mine])
        else:  # replicated: the sum over ranks (what DDP with a summing reduction would hand the optimizer)
            p.grad = comm.all_reduce(torch.zeros_like(p) if p.grad is None else p.grad, "sum")
            err[n] = _rel(p.grad, ref_grads[n])
    torch.optim.SGD(model.parameters(), lr=LR).step()
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        want = ref_params[n][mine] if getattr(p, "_moonep_expert", False) else ref_params[n]
        err["step:" + n] = _rel(p.detach(), want.detach())
    return err


def _ddp_verdicts(comm, cfg) -> list[str]:
    """A parallelized model inside torch's DDP: refused on the first forward without ``ignore_in_ddp`` (DDP would
    broadcast rank 0's experts and average their grads), runs with it."""
    out = []
    for ignore in (False, True):
        model = hf.parallelize(_model(cfg), comm)
        if ignore:
            moonep.ignore_in_ddp(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=comm.group)
        try:
            ddp(_batch(comm.rank), labels=_batch(comm.rank)).loss.backward()
            out.append("ran")
        except ValueError as e:
            out.append(str(e))
    return out


def _hf_rank(comm) -> dict:
    """All families; the worst error of each family over every rank (all-reduced max); DDP verdicts (Mixtral)."""
    worst = {"ddp": _ddp_verdicts(comm, _configs()["mixtral"])}
    for family, cfg in _configs().items():
        err = _family_errors(comm, cfg)
        names = sorted(err)
        vals = comm.all_reduce(torch.tensor([err[n] for n in names], dtype=torch.float64), "max")
        worst[family] = dict(zip(names, vals.tolist()))
    return worst


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.parametrize("R", [2, 4])
def test_hf_models_expert_parallel_equal_the_unmodified_model(R):
    worst = launch(_hf_rank, R, timeout=60, job_timeout=400)
    refused, ran = worst.pop("ddp")
    assert "DistributedDataParallel replicates expert parameters" in refused and "ignore_in_ddp" in refused, refused
    assert ran == "ran", ran
    assert set(worst) == {"qwen3_moe", "deepseek_v3", "qwen3_next", "mixtral"}
    for family, err in worst.items():
        assert err["generate"] == 0 and err["state_dict"] == 0, (family, err["generate"], err["state_dict"])
        assert sum(".experts." in n for n in err) >= 4, sorted(err)  # expert grads and steps were compared
        bad = {n: e for n, e in err.items() if e > TOL}
        assert not bad, (family, bad)


class _Comm:  # the argument checks run before any exchange: a world size is all they read
    def __init__(self, world_size: int) -> None:
        self.world_size, self.rank = world_size, 0


def test_bad_models_are_refused_with_one_line():
    mixtral = transformers.AutoModelForCausalLM.from_config(_configs()["mixtral"])
    with pytest.raises(ValueError, match=r"E=8 experts, not a multiple of the EP size R=3"):
        hf.parallelize(mixtral, _Comm(3))
    hf.parallelize(mixtral, _Comm(2))  # builds no Buffer before the first forward
    with pytest.raises(ValueError, match=r"MixtralForCausalLM is already expert-parallel \(model.layers.0.mlp\)"):
        hf.parallelize(mixtral, _Comm(2))  # a second call would slice the slice
    dense = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3Config(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    )
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM has no MoE block"):
        hf.parallelize(dense, _Comm(2))
    gpt = transformers.AutoModelForCausalLM.from_config(
        transformers.GptOssConfig(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            num_local_experts=4,
        )
    )
    with pytest.raises(ValueError, match=r"GptOssExperts\) is not on the 5.x fused seam"):
        hf.parallelize(gpt, _Comm(2))
