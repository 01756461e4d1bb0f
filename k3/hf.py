"""``load_hf_checkpoint``: released-layout weights (sharded safetensors + ``model.safetensors.index.json``).

Names follow the release's text model (``model.layers.N.self_attn.q_proj.weight``,
``model.layers.N.block_sparse_moe.experts.J.w1.weight``, ...; a ``language_model.`` prefix of the multimodal
wrapper is accepted). Routed experts may be MXFP4-packed (compressed-tensors ``mxfp4-pack-quantized``):
``<name>.weight_packed`` uint8 ``[out, in/2]`` (two E2M1 codes per byte, low nibble first) and
``<name>.weight_scale`` uint8 ``[out, in/32]`` (E8M0: 2^(s - 127)); they are dequantised on load. That packing
order is our reading of the format, not verified against the released shards. The AttnRes names
(``attn_res_proj``/``attn_res_norm``, ``mlp_res_proj``/``mlp_res_norm``, ``output_attn_res_proj``) are likewise
inferred. Everything is checked (files, names, shapes) before the first tensor is copied: a corrupt or
incomplete checkpoint raises ``ValueError`` and leaves the model untouched.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError, safe_open

from .moe import LatentMoE

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
GROUP = 32  # MXFP4 block size


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed uint8 [out, in/2], scale uint8 [out, in/32] -> fp32 [out, in]."""
    lo, hi = (packed & 0x0F).long(), (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)  # [out, in]
    values = E2M1[codes]
    exps = torch.pow(2.0, scale.float() - 127.0).repeat_interleave(GROUP, dim=1)
    return values * exps


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (packed, scale), nearest E2M1 code per value after a per-group power-of-two scale."""
    out, n = w.shape
    g = w.reshape(out, n // GROUP, GROUP)
    amax = g.abs().amax(-1).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # largest value maps to <= 6
    scaled = g / torch.pow(2.0, exp)[..., None]
    codes = (scaled.reshape(out, n)[..., None] - E2M1).abs().argmin(-1)  # [out, in]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def hf_names(model) -> dict[str, tuple[torch.Tensor, int | None]]:
    """Release name -> (our tensor, expert row or None) for every parameter and router bias of ``model``."""
    out: dict[str, tuple[torch.Tensor, int | None]] = {
        "model.embed_tokens.weight": (model.embed_tokens.weight, None),
        "model.norm.weight": (model.norm.weight, None),
        "lm_head.weight": (model.lm_head.weight, None),
        "model.output_attn_res_proj.weight": (model.output_attn_res.proj, None),
        "model.output_attn_res_norm.weight": (model.output_attn_res.norm, None),
    }
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        for name, p in layer.self_attn.named_parameters():
            out[
                pre
                + "self_attn."
                + (name if name.endswith(".weight") else name + ("" if name in ("A_log", "dt_bias") else ".weight"))
            ] = (p, None)
        for sub in ("attn", "mlp"):
            q = getattr(layer, f"{sub}_res")
            out[pre + f"{sub}_res_proj.weight"], out[pre + f"{sub}_res_norm.weight"] = (q.proj, None), (q.norm, None)
        out[pre + "input_layernorm.weight"] = (layer.input_layernorm.weight, None)
        out[pre + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, None)
        if isinstance(layer.mlp, LatentMoE):
            moe, mp = layer.mlp, pre + "block_sparse_moe."
            out[mp + "gate.weight"] = (moe.gate.weight, None)
            out[mp + "gate.e_score_correction_bias"] = (moe.gate.e_score_correction_bias, None)
            for n in ("routed_expert_down_proj", "routed_expert_up_proj", "routed_expert_norm"):
                out[mp + n + ".weight"] = (getattr(moe, n).weight, None)
            for n, p in moe.shared_experts.named_parameters() if moe.shared_experts is not None else ():
                out[mp + "shared_experts." + n] = (p, None)
            first = moe.ep_rank * moe.epn
            for j in range(moe.epn):
                for w in ("w1", "w2", "w3"):
                    out[mp + f"experts.{first + j}.{w}.weight"] = (getattr(moe, w), j)
        else:
            for n, p in layer.mlp.named_parameters():
                out[pre + "mlp." + n] = (p, None)
    return out


def _read_index(path: str) -> dict[str, str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        raise ValueError(f"{path}: no model.safetensors.index.json")
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise ValueError(f"{index}: not a safetensors index ({exc})") from exc
    weight_map = {k.removeprefix("language_model."): v for k, v in weight_map.items()}
    missing = sorted({v for v in weight_map.values() if not os.path.exists(os.path.join(path, v))})
    if missing:
        raise ValueError(f"{path}: shard files missing: {missing[:3]}")
    return weight_map


def _fetch(path: str, weight_map: dict[str, str], name: str) -> torch.Tensor:
    stored = name if name in weight_map else None
    with safe_open(os.path.join(path, weight_map[name]), "pt") as f:
        keys = set(f.keys())
        key = stored if stored in keys else "language_model." + name
        if key not in keys:
            raise ValueError(f"{weight_map[name]}: index lists {name} but the shard does not hold it")
        return f.get_tensor(key)


def load_hf_checkpoint(model, path: str) -> list[str]:
    """Load a released-layout checkpoint folder into ``model`` (any EP rank: its own experts only).

    Returns the loaded release names. Raises ValueError naming the first problem, before copying anything.
    """
    weight_map = _read_index(path)
    targets = hf_names(model)
    staged: list[tuple[torch.Tensor, int | None, torch.Tensor, str]] = []
    for name, (dst, row) in targets.items():
        shape = dst.shape[1:] if row is not None else dst.shape
        try:
            if name in weight_map:
                src = _fetch(path, weight_map, name)
            elif name.removesuffix(".weight") + ".weight_packed" in weight_map:
                base = name.removesuffix(".weight")
                src = mxfp4_dequantize(
                    _fetch(path, weight_map, base + ".weight_packed"), _fetch(path, weight_map, base + ".weight_scale")
                )
            else:
                raise ValueError(f"{path}: tensor {name} is missing")
        except SafetensorError as exc:
            raise ValueError(f"{path}: unreadable shard for {name}: {exc}") from exc
        if name.endswith("A_log") and src.dim() == 1 and src.numel() > shape[0]:
            # the release stores A_log with more entries than KDA heads (128 for 96); the first ones are used
            src = src[: shape[0]]
        if name.endswith("_res_proj.weight") or name.endswith("conv1d.weight"):
            src = src.reshape(shape) if src.numel() == torch.Size(shape).numel() else src
        if tuple(src.shape) != tuple(shape):
            raise ValueError(f"{path}: {name} has shape {tuple(src.shape)}, expected {tuple(shape)}")
        staged.append((dst, row, src, name))
    with torch.no_grad():
        for dst, row, src, _ in staged:
            (dst[row] if row is not None else dst).copy_(src)
    return [name for *_, name in staged]


__all__ = ["load_hf_checkpoint", "hf_names", "mxfp4_dequantize", "mxfp4_quantize"]
