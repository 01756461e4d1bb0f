"""Measure what a layer keeps for its backward, term by term, on CPU (the check behind ``simulator.act_terms``).

Stand-in layers (a Llama-style GQA + SwiGLU layer, a DeepSeek-V3-style MLA + MoE layer, a Megatron Mamba-2
mixer, any ``ModelSpec`` softmax layer kind) are built from ``simulator.fused_standins``' autograd Functions, which
keep exactly what the fused GPU kernels keep: ``FlashAttn`` q, k, v, o and the fp32 lse; ``RMSNorm`` its input and
an fp32 rstd per row; ``SwiGLU`` its input ``[n, 2F]`` (and the probability when it multiplies inside); ``Rope``
nothing; ``Permute`` an int32 row map. GEMMs are ``F.linear`` (autograd keeps the input and the weight).

This module imports torch: only tests and a CLI load it; the planner never does.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from simulator.fused_standins import (
    ChunkKDA,
    FlashAttn,
    GroupRMSNorm,
    MambaSplitConv1dScan,
    Permute,
    RMSNorm,
    RMSNormGated,
    Rope,
    SavedCounter,
    ShortConv,
    SwiGLU,
    Unpermute,
    label,
    term,
)
from simulator.layers import KDA_CHUNK
from simulator.modelspec import ModelSpec


def _kda(spec: ModelSpec, p: dict, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """FLA's KDA layer (``fla/layers/kda.py``) with K3's full-rank output gate, on norm output ``x`` [n, H]."""
    n, nh, d = x.shape[0], spec.kda_heads, spec.kda_head_dim
    q, k, v = (ShortConv.apply(label(F.linear(x, p[w]), "kda_conv_in"), p["c" + w]) for w in ("kq", "kk", "kv"))
    g = label(F.linear(label(F.linear(x, p["fa"]), "kda_gate"), p["fb"]), "kda_gate")
    beta = label(F.linear(x, p["b"]), "kda_beta")
    heads = (n, nh, d)
    o = ChunkKDA.apply(q.view(heads), k.view(heads), v.view(heads), g.view(heads), beta, chunk)
    gate = label(F.linear(x, p["g"]), "kda_out").view(heads)
    y = RMSNormGated.apply(label(o, "kda_out"), gate, p["on"]).reshape(n, nh * d)
    return F.linear(label(y, "kda_out_proj_in"), p["o"])


def _w(*shape: int, random: bool = False) -> torch.nn.Parameter:
    """A bf16 weight; values only matter for the router (which experts a token picks), so the rest is zero."""
    w = torch.randn(*shape, dtype=torch.bfloat16) * shape[-1] ** -0.5 if random else torch.zeros(*shape)
    return torch.nn.Parameter(w.to(torch.bfloat16))


def build_params(spec: ModelSpec, kind: tuple[str, str]) -> dict[str, torch.nn.Parameter]:
    """Weights of one stand-in layer of ``spec`` (bf16; experts as ``[E, out, in]`` stacks)."""
    h, nh = spec.hidden, spec.num_heads
    p = {"n1": _w(h), "n2": _w(h)}
    if kind[0] == "mamba":
        di, gn = spec.mamba_inner, spec.mamba_groups * spec.mamba_d_state
        p.update(mi=_w(spec.mamba2_in_proj, h), mc=_w(di + 2 * gn, spec.mamba_d_conv), mn=_w(di), mo=_w(h, di))
        return _ffn_params(spec, kind, p)
    if kind[0] == "kda":
        dd, d = spec.kda_heads * spec.kda_head_dim, spec.kda_head_dim
        p.update({w: _w(dd, h) for w in ("kq", "kk", "kv", "g")}, o=_w(h, dd), fa=_w(d, h), fb=_w(dd, d))
        p.update({"c" + w: _w(dd, spec.kda_conv) for w in ("kq", "kk", "kv")}, b=_w(spec.kda_heads, h), on=_w(d))
        return _ffn_params(spec, kind, p)
    if kind[0] == "mla":
        dqk, dv = spec.qk_nope_dim + spec.qk_rope_dim, spec.v_head_dim
        ql, kvl = spec.q_lora_rank, spec.kv_lora_rank
        p.update(kva=_w(kvl + spec.qk_rope_dim, h), kvn=_w(kvl), kvb=_w(nh * (spec.qk_nope_dim + dv), kvl))
        p.update({"qa": _w(ql, h), "qn": _w(ql), "qb": _w(nh * dqk, ql)} if ql else {"q": _w(nh * dqk, h)})
    else:
        dv = spec.dhead
        p["qkv"] = _w((nh + 2 * spec.kv_heads) * dv, h)
    p["o"] = _w(h, nh * dv)
    if spec.attn_output_gate:
        p["g"] = _w(nh * dv, h)
    return _ffn_params(spec, kind, p)


def _ffn_params(spec: ModelSpec, kind: tuple[str, str], p: dict) -> dict[str, torch.nn.Parameter]:
    h = spec.hidden
    if kind[1] == "none":
        return p
    if kind[1] == "dense":
        p.update(fc1=_w(2 * spec.ffn_hidden, h), fc2=_w(h, spec.ffn_hidden))
        return p
    e, fe, de = spec.num_experts, spec.moe_ffn_hidden, spec.moe_latent_dim or h
    p.update(router=_w(e, h, random=True), e1=_w(e, 2 * fe, de), e2=_w(e, de, fe))
    if spec.moe_latent_dim:
        p.update(down=_w(de, h), up=_w(h, de))
    if spec.shared_width:
        fs = spec.shared_width
        p.update(s1=_w(2 * fs, h), s2=_w(h, fs))
    return p


def _attention(spec: ModelSpec, kind: str, p: dict, x: torch.Tensor) -> torch.Tensor:
    n, nh = x.shape[0], spec.num_heads
    if kind == "kda":
        return _kda(spec, p, x, KDA_CHUNK)
    if kind == "mamba":  # Megatron's MambaMixer: in_proj, the fused conv + scan + gate, the grouped norm, out_proj
        zxbcdt = label(F.linear(x, p["mi"]), "mamba_in_proj_out")
        y = label(MambaSplitConv1dScan.apply(zxbcdt, p["mc"], spec.mamba_inner), "mamba_norm_in")
        with term("mamba_norm_in"):
            y = GroupRMSNorm.apply(y, p["mn"], spec.mamba_groups)
        return F.linear(label(y, "mamba_out_proj_in"), p["mo"])
    if kind == "mla":
        dn, dr, dv, kvl = spec.qk_nope_dim, spec.qk_rope_dim, spec.v_head_dim, spec.kv_lora_rank
        if spec.q_lora_rank:
            with term("q_lora"):
                qn = RMSNorm.apply(F.linear(x, p["qa"]), p["qn"])
            q = F.linear(label(qn, "q_lora_norm_out"), p["qb"])
        else:
            q = F.linear(x, p["q"])
        ckv = F.linear(x, p["kva"])  # [n, kvl + dr]: compressed KV and the shared rope key
        with term("kv_lora"):
            kvn = RMSNorm.apply(ckv[:, :kvl], p["kvn"])
        kv = F.linear(label(kvn, "kv_lora_norm_out"), p["kvb"]).view(n, nh, dn + dv)
        k = torch.cat([kv[..., :dn], ckv[:, None, kvl:].expand(n, nh, dr)], -1)
        with term("qkv"):
            q, k, v = Rope.apply(q.view(n, nh, dn + dr), k, kv[..., dn:])
    else:
        d, kvh = spec.dhead, spec.kv_heads
        qkv = F.linear(x, p["qkv"])
        with term("qkv"):
            q, k, v = Rope.apply(*qkv.split([nh * d, kvh * d, kvh * d], -1))
        q, k, v = q.view(n, nh, d), k.view(n, kvh, d), v.view(n, kvh, d)
    for t in (q, k, v):
        label(t, "qkv")
    o = FlashAttn.apply(q, k, v).view(n, -1)
    if spec.attn_output_gate:
        with term("attn_gate"):
            gated = label(o * torch.sigmoid(F.linear(x, p["g"])), "attn_gated")
        return F.linear(gated, p["o"])
    return F.linear(o, p["o"])


def _ffn(spec: ModelSpec, kind: str, p: dict, x: torch.Tensor, moe_probs: str) -> torch.Tensor:
    if kind == "dense":
        with term("ffn_act_in"):
            a = SwiGLU.apply(F.linear(x, p["fc1"]))
        return F.linear(label(a, "ffn_act_out"), p["fc2"])
    k = spec.top_k
    with term("router"):  # fp32 sigmoid scores, top-k, normalised gathered scores (DeepSeek-V3's router)
        scores = torch.sigmoid(F.linear(x, p["router"]).float())
        idx = scores.detach().topk(k, -1).indices
        top = scores.gather(1, idx)
        probs = top / top.sum(-1, keepdim=True)
    order = idx.reshape(-1).argsort(stable=True)
    xin = F.linear(x, p["down"]) if spec.moe_latent_dim else x
    with term("perm_map"):
        xp, pp, row_map = Permute.apply(xin, probs, order)
    label(pp, "probs")
    counts = torch.bincount(idx.reshape(-1)[order], minlength=spec.num_experts).tolist()
    label(xp, "expert_in")
    with term("expert_act_in"):
        h1 = torch.cat([F.linear(r, p["e1"][e]) for e, r in enumerate(xp.split(counts))])
        a = SwiGLU.apply(h1, pp if moe_probs == "swiglu" else None)
    label(a, "expert_act_out")
    y = torch.cat([F.linear(r, p["e2"][e]) for e, r in enumerate(a.split(counts))])
    label(y, "expert_out")
    out = Unpermute.apply(y, row_map, k, pp if moe_probs == "combine" else None)
    if spec.moe_latent_dim:
        out = F.linear(label(out, "latent_up_in"), p["up"])
    if spec.shared_width:
        with term("shared_act_in"):
            sa = SwiGLU.apply(F.linear(x, p["s1"]))
        out = out + F.linear(label(sa, "shared_act_out"), p["s2"])
    return out


CHECKPOINTED_FFN = {"dense": "mlp", "moe": "moe"}
"""Megatron's recompute module that checkpoints a whole FFN block of each kind (normal checkpointing: the block
keeps only its input and runs again in the backward)."""


def layer_forward(spec: ModelSpec, kind: tuple, p: dict, x: torch.Tensor, moe_probs="swiglu", checkpoint_ffn=False):
    """One pre-norm layer on tokens ``x`` [n, H]: x + attn(norm(x)), then + ffn(norm(.)); ``checkpoint_ffn`` runs
    the FFN block as Megatron's ``tensor_parallel.checkpoint`` does (a reentrant checkpoint: inputs saved, the
    forward without autograd)."""
    if kind[0] != "none":  # a single-block hybrid layer holds one of the two blocks
        with term("norm_in"):
            h = RMSNorm.apply(x, p["n1"])
        x = x + _attention(spec, kind[0], p, label(h, "attn_norm_out"))
    if kind[1] == "none":
        return x
    with term("norm_in"):
        h = RMSNorm.apply(x, p["n2"])
    args = (spec, kind[1], p, label(h, "ffn_norm_out"), moe_probs)
    return x + (torch.utils.checkpoint.checkpoint(_ffn, *args, use_reentrant=True) if checkpoint_ffn else _ffn(*args))


def measure_layer(spec: ModelSpec, kind: tuple[str, str], tokens=16, moe_probs="swiglu", recompute_modules=()) -> dict:
    """Saved bytes per token by term of one stand-in layer of ``spec`` over ``tokens`` tokens; of the
    ``recompute_modules``, the FFN block's checkpoint (``CHECKPOINTED_FFN``) is run, the others ignored."""
    torch.manual_seed(0)
    p = build_params(spec, kind)
    x = torch.randn(tokens, spec.hidden, dtype=torch.bfloat16, requires_grad=True)
    checkpoint_ffn = CHECKPOINTED_FFN.get(kind[1]) in recompute_modules
    with SavedCounter(p.values()) as saved:
        out = layer_forward(spec, kind, p, x, moe_probs, checkpoint_ffn)
    del out
    return {name: b / tokens for name, b in saved.bytes.items()}


def scaled(spec: ModelSpec, m: int, base: int = 64) -> ModelSpec:
    """``spec`` with every width (hidden, heads, LoRA ranks, FFN, expert width and count, latent) at ``m / base``
    of its own; head dims and top-k kept (per-token bytes are then linear in ``m``)."""

    def w(x: int) -> int:
        return max(1, x * m // base) if x else 0

    heads, kv = w(spec.num_heads), spec.kv_heads
    return replace(
        spec,
        hidden=w(spec.hidden),
        num_heads=heads,
        num_kv_heads=max(1, kv * heads // spec.num_heads) if spec.num_kv_heads else 0,
        q_lora_rank=w(spec.q_lora_rank),
        kv_lora_rank=w(spec.kv_lora_rank),
        ffn_hidden=w(spec.ffn_hidden),
        moe_ffn_hidden=w(spec.moe_ffn_hidden),
        num_experts=max(spec.top_k, w(spec.num_experts)),
        moe_latent_dim=w(spec.moe_latent_dim),
        head_dim=spec.dhead,
        kda_heads=w(spec.kda_heads),
        mamba_inner_dim=w(spec.mamba_inner) if spec.mamba_layers else spec.mamba_inner_dim,  # heads, groups kept
        expert_groups=0,
        groups_per_token=0,
    )


def fit(spec: ModelSpec, kind: tuple[str, str], widths=(1, 2, 3), base: int = 64, **options):
    """Per term: bytes per token at ``spec``'s own widths, linear from the first two ``widths`` (each ``m / base``
    of the real widths), and the worst relative miss of that line at the third width; ``options`` go to
    ``measure_layer`` (``moe_probs``, ``recompute_modules``)."""
    runs = [measure_layer(scaled(spec, m, base), kind, **options) for m in widths]
    out, worst = {}, 0.0
    for name in set().union(*runs):
        y = [r.get(name, 0.0) for r in runs]
        slope = (y[1] - y[0]) / (widths[1] - widths[0])
        line = [y[0] + slope * (m - widths[0]) for m in widths]
        if y[2]:
            worst = max(worst, abs(line[2] / y[2] - 1))
        out[name] = y[0] + slope * (base - widths[0])
    return out, worst


__all__ = ["CHECKPOINTED_FFN", "SavedCounter", "fit", "layer_forward", "measure_layer", "scaled"]
