"""Measure what a layer keeps for its backward, term by term, on CPU (the check behind ``simulator.act_terms``).

Stand-in layers (a Llama-style GQA + SwiGLU layer, a DeepSeek-V3-style MLA + MoE layer, any ``ModelSpec`` softmax
layer kind) are written with custom autograd Functions that keep exactly what the fused GPU kernels Megatron / TE
run keep (``act_terms``' module docstring): ``_FlashAttn`` q, k, v, o and the fp32 lse; ``_RMSNorm`` its input and
an fp32 rstd per row; ``_SwiGLU`` its input ``[n, 2F]`` (and the probability when it multiplies inside);
``_Rope`` nothing; ``_Permute`` an int32 row map. GEMMs are ``F.linear`` (autograd keeps the input and the weight).

``SavedCounter`` runs a forward under ``torch.autograd.graph.saved_tensors_hooks``: every storage autograd keeps is
counted once (``untyped_storage().data_ptr()``, whole ``nbytes()``), parameters and views of them not at all, and
charged to a term: the label a stand-in put on the tensor (``label``), else the innermost ``term`` block running.
Forward only: the Functions' backwards are not needed to count what they keep.

This module imports torch: only tests and a CLI load it; the planner never does.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from simulator.layers import KDA_CHUNK
from simulator.modelspec import ModelSpec

_ACTIVE: list[SavedCounter] = []


class SavedCounter:
    """Context manager: ``bytes[term]`` every storage saved for backward during the block, each once."""

    def __init__(self, params) -> None:
        self.bytes: dict[str, int] = {}
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._seen: set[int] = set()
        self._labels: dict[int, str] = {}
        self._stack: list[str] = ["other"]
        self._keep: list[torch.Tensor] = []  # saved tensors stay alive: no address is reused while counting

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._params or ptr in self._seen or storage.nbytes() == 0:
            return t
        self._seen.add(ptr)
        self._keep.append(t)
        name = self._labels.get(ptr, self._stack[-1])
        self.bytes[name] = self.bytes.get(name, 0) + storage.nbytes()
        return t

    def __enter__(self) -> SavedCounter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.pop()
        self._hooks.__exit__(*exc)


def label(t: torch.Tensor, name: str) -> torch.Tensor:
    """Charge ``t``'s storage to term ``name`` when it is saved (whoever saves it)."""
    if _ACTIVE:
        _ACTIVE[-1]._labels.setdefault(t.untyped_storage().data_ptr(), name)
    return t


@contextlib.contextmanager
def term(name: str):
    """Storages first saved inside the block (and not labelled) are charged to ``name``."""
    if not _ACTIVE:
        yield
        return
    _ACTIVE[-1]._stack.append(name)
    try:
        yield
    finally:
        _ACTIVE[-1]._stack.pop()


class _RMSNorm(torch.autograd.Function):
    """Fused RMSNorm: keeps its input and an fp32 rstd per row."""

    @staticmethod
    def forward(ctx, x, w):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        ctx.save_for_backward(x, w, rstd)
        return (xf * rstd).to(x.dtype) * w


class _FlashAttn(torch.autograd.Function):
    """Flash attention (causal): keeps q, k, v [n, heads, d], its output o and the fp32 lse [heads, n]."""

    @staticmethod
    def forward(ctx, q, k, v):
        n, nh = q.shape[0], q.shape[1]
        rep = nh // k.shape[1]
        qh, kh, vh = q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float()
        kh, vh = kh.repeat_interleave(rep, 0), vh.repeat_interleave(rep, 0)
        s = qh @ kh.transpose(1, 2) / q.shape[-1] ** 0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)  # [heads, n] fp32
        o = (torch.exp(s - lse.unsqueeze(-1)) @ vh).transpose(0, 1).contiguous().to(q.dtype)
        label(o, "attn_out")
        label(lse, "lse")
        ctx.save_for_backward(q, k, v, o, lse)
        return o


class _Rope(torch.autograd.Function):
    """Fused RoPE (+ split): writes each output as its own contiguous tensor, keeps nothing (cos/sin are fixed)."""

    @staticmethod
    def forward(ctx, *parts):
        return tuple(p.contiguous().clone() for p in parts)


class _SwiGLU(torch.autograd.Function):
    """SwiGLU over ``[n, 2F]`` (gate half first), optionally times a per-row probability (``weighted_bias_swiglu``):
    keeps its input and the probability."""

    @staticmethod
    def forward(ctx, x, probs=None):
        g, u = x.float().chunk(2, -1)
        y = F.silu(g) * u
        if probs is not None:
            y = y * probs.unsqueeze(-1)
        ctx.save_for_backward(x, probs)
        return y.to(x.dtype)


class _Permute(torch.autograd.Function):
    """Fused permutation of tokens [n, d] and probabilities [n, K] into expert order [n K, ...]: keeps an int32
    row map (the un-permutation reuses it)."""

    @staticmethod
    def forward(ctx, x, probs, order):
        row_map = order.to(torch.int32)
        ctx.save_for_backward(row_map)
        return x[order // probs.shape[1]], probs.reshape(-1)[order], row_map


class _Unpermute(torch.autograd.Function):
    """Sum of each token's routed copies back in token order; with ``probs`` (applied at the combine) keeps the
    expert output and the probabilities."""

    @staticmethod
    def forward(ctx, y, row_map, k, probs=None):
        ctx.save_for_backward(row_map, *(() if probs is None else (y, probs)))
        w = y.float() if probs is None else y.float() * probs.unsqueeze(-1)
        out = torch.zeros(y.shape[0] // k, y.shape[1], dtype=torch.float32)
        out.index_add_(0, row_map.long() // k, w)
        return out.to(y.dtype)


class _ShortConv(torch.autograd.Function):
    """FLA's fused causal short convolution with SiLU: keeps its input (the taps are a parameter)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        n, taps = x.shape[0], w.shape[1]
        pad = torch.cat([x.new_zeros(taps - 1, x.shape[1]), x]).float()
        return F.silu(sum(pad[i : i + n] * w[:, i].float() for i in range(taps))).to(x.dtype)


class _ChunkKDA(torch.autograd.Function):
    """FLA ``chunk_kda`` with the l2norm, gate and beta sigmoid in-kernel, q, k, v, g [n, h, d], beta [n, h]:
    keeps the normalised q, k and their fp32 rstd, v, the raw gate, beta and its fp32 sigmoid, and the bf16
    ``Aqk``, ``Akk`` [n, h, chunk]."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, chunk):
        q_rstd, k_rstd = (torch.rsqrt(t.float().pow(2).sum(-1) + 1e-6) for t in (q, k))
        qn, kn = (q.float() * q_rstd[..., None]).to(q.dtype), (k.float() * k_rstd[..., None]).to(k.dtype)
        b = torch.sigmoid(beta.float())
        aqk, akk = (q.new_zeros(q.shape[0], q.shape[1], chunk) for _ in range(2))
        for t in (qn, kn, q_rstd, k_rstd, v):
            label(t, "kda_qkv")
        label(aqk, "kda_intra"), label(akk, "kda_intra"), label(b, "kda_beta")
        ctx.save_for_backward(qn, q_rstd, kn, k_rstd, v, g, beta, b, aqk, akk)
        return (v.float() * b[..., None]).to(v.dtype)


class _RMSNormGated(torch.autograd.Function):
    """FLA's ``FusedRMSNormGated`` per head (sigmoid gate): keeps its input, the gate and an fp32 rstd per head."""

    @staticmethod
    def forward(ctx, o, gate, w):
        rstd = torch.rsqrt(o.float().pow(2).mean(-1) + 1e-6)
        label(rstd, "kda_out")
        ctx.save_for_backward(o, gate, w, rstd)
        return (o.float() * rstd[..., None] * w.float() * torch.sigmoid(gate.float())).to(o.dtype)


def _kda(spec: ModelSpec, p: dict, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """FLA's KDA layer (``fla/layers/kda.py``) with K3's full-rank output gate, on norm output ``x`` [n, H]."""
    n, nh, d = x.shape[0], spec.kda_heads, spec.kda_head_dim
    q, k, v = (_ShortConv.apply(label(F.linear(x, p[w]), "kda_conv_in"), p["c" + w]) for w in ("kq", "kk", "kv"))
    g = label(F.linear(label(F.linear(x, p["fa"]), "kda_gate"), p["fb"]), "kda_gate")
    beta = label(F.linear(x, p["b"]), "kda_beta")
    heads = (n, nh, d)
    o = _ChunkKDA.apply(q.view(heads), k.view(heads), v.view(heads), g.view(heads), beta, chunk)
    gate = label(F.linear(x, p["g"]), "kda_out").view(heads)
    y = _RMSNormGated.apply(label(o, "kda_out"), gate, p["on"]).reshape(n, nh * d)
    return F.linear(label(y, "kda_out_proj_in"), p["o"])


def _w(*shape: int, random: bool = False) -> torch.nn.Parameter:
    """A bf16 weight; values only matter for the router (which experts a token picks), so the rest is zero."""
    w = torch.randn(*shape, dtype=torch.bfloat16) * shape[-1] ** -0.5 if random else torch.zeros(*shape)
    return torch.nn.Parameter(w.to(torch.bfloat16))


def build_params(spec: ModelSpec, kind: tuple[str, str]) -> dict[str, torch.nn.Parameter]:
    """Weights of one stand-in layer of ``spec`` (bf16; experts as ``[E, out, in]`` stacks)."""
    h, nh = spec.hidden, spec.num_heads
    p = {"n1": _w(h), "n2": _w(h)}
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
    if kind == "mla":
        dn, dr, dv, kvl = spec.qk_nope_dim, spec.qk_rope_dim, spec.v_head_dim, spec.kv_lora_rank
        if spec.q_lora_rank:
            with term("q_lora"):
                qn = _RMSNorm.apply(F.linear(x, p["qa"]), p["qn"])
            q = F.linear(label(qn, "q_lora_norm_out"), p["qb"])
        else:
            q = F.linear(x, p["q"])
        ckv = F.linear(x, p["kva"])  # [n, kvl + dr]: compressed KV and the shared rope key
        with term("kv_lora"):
            kvn = _RMSNorm.apply(ckv[:, :kvl], p["kvn"])
        kv = F.linear(label(kvn, "kv_lora_norm_out"), p["kvb"]).view(n, nh, dn + dv)
        k = torch.cat([kv[..., :dn], ckv[:, None, kvl:].expand(n, nh, dr)], -1)
        with term("qkv"):
            q, k, v = _Rope.apply(q.view(n, nh, dn + dr), k, kv[..., dn:])
    else:
        d, kvh = spec.dhead, spec.kv_heads
        qkv = F.linear(x, p["qkv"])
        with term("qkv"):
            q, k, v = _Rope.apply(*qkv.split([nh * d, kvh * d, kvh * d], -1))
        q, k, v = q.view(n, nh, d), k.view(n, kvh, d), v.view(n, kvh, d)
    for t in (q, k, v):
        label(t, "qkv")
    o = _FlashAttn.apply(q, k, v).view(n, -1)
    if spec.attn_output_gate:
        with term("attn_gate"):
            gated = label(o * torch.sigmoid(F.linear(x, p["g"])), "attn_gated")
        return F.linear(gated, p["o"])
    return F.linear(o, p["o"])


def _ffn(spec: ModelSpec, kind: str, p: dict, x: torch.Tensor, moe_probs: str) -> torch.Tensor:
    if kind == "dense":
        with term("ffn_act_in"):
            a = _SwiGLU.apply(F.linear(x, p["fc1"]))
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
        xp, pp, row_map = _Permute.apply(xin, probs, order)
    label(pp, "probs")
    counts = torch.bincount(idx.reshape(-1)[order], minlength=spec.num_experts).tolist()
    label(xp, "expert_in")
    with term("expert_act_in"):
        h1 = torch.cat([F.linear(r, p["e1"][e]) for e, r in enumerate(xp.split(counts))])
        a = _SwiGLU.apply(h1, pp if moe_probs == "swiglu" else None)
    label(a, "expert_act_out")
    y = torch.cat([F.linear(r, p["e2"][e]) for e, r in enumerate(a.split(counts))])
    label(y, "expert_out")
    out = _Unpermute.apply(y, row_map, k, pp if moe_probs == "combine" else None)
    if spec.moe_latent_dim:
        out = F.linear(label(out, "latent_up_in"), p["up"])
    if spec.shared_width:
        with term("shared_act_in"):
            sa = _SwiGLU.apply(F.linear(x, p["s1"]))
        out = out + F.linear(label(sa, "shared_act_out"), p["s2"])
    return out


CHECKPOINTED_FFN = {"dense": "mlp", "moe": "moe"}
"""Megatron's recompute module that checkpoints a whole FFN block of each kind (normal checkpointing: the block
keeps only its input and runs again in the backward)."""


def layer_forward(spec: ModelSpec, kind: tuple, p: dict, x: torch.Tensor, moe_probs="swiglu", checkpoint_ffn=False):
    """One pre-norm layer on tokens ``x`` [n, H]: x + attn(norm(x)), then + ffn(norm(.)); ``checkpoint_ffn`` runs
    the FFN block as Megatron's ``tensor_parallel.checkpoint`` does (a reentrant checkpoint: inputs saved, the
    forward without autograd)."""
    with term("norm_in"):
        h = _RMSNorm.apply(x, p["n1"])
    x = x + _attention(spec, kind[0], p, label(h, "attn_norm_out"))
    with term("norm_in"):
        h = _RMSNorm.apply(x, p["n2"])
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


__all__ = ["CHECKPOINTED_FFN", "SavedCounter", "fit", "label", "layer_forward", "measure_layer", "scaled", "term"]
