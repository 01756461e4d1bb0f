"""``load_hf_checkpoint``: released-layout weights (sharded safetensors + ``model.safetensors.index.json``).

Names follow the release's text model (``model.layers.N.self_attn.q_proj.weight``,
``model.layers.N.block_sparse_moe.experts.J.w1.weight``, ...; a ``language_model.`` prefix of the multimodal
wrapper is accepted). Routed experts may be MXFP4-packed (compressed-tensors ``mxfp4-pack-quantized``):
``<name>.weight_packed`` uint8 ``[out, in/2]`` (two E2M1 codes per byte, low nibble first) and
``<name>.weight_scale`` uint8 ``[out, in/32]`` (E8M0: 2^(s - 127)); they are dequantised on load. That packing
order is our reading of the format, not verified against the released shards. The AttnRes names
(``attn_res_proj``/``attn_res_norm``, ``mlp_res_proj``/``mlp_res_norm``, ``output_attn_res_proj``) are likewise
inferred.

The loader is strict, and checks everything before the first tensor is copied (a checkpoint that does not fit
raises ``ValueError`` naming the tensor or file, and leaves the model untouched):

- **names**: every tensor the model has, and every other EP rank's expert, must be in the index; every tensor
  in the index must be one of those. Missing and unexpected tensors are listed by name (a checkpoint of a larger
  model, with another layer or more experts, is refused). ``allow_extra=True`` drops the unexpected ones with a
  warning naming them (e.g. a multimodal release's vision tower).
- **shapes** are exact. The release's own layouts are converted explicitly, each only from its exact shape:
  KDA conv taps ``[D, 1, W]`` -> ``[D, W]``, AttnRes queries ``[1, d]`` -> ``[d]``, and ``A_log`` stored with
  more entries than KDA heads (its first entries). A tensor with the right element count in another layout
  (conv taps ``[W, D]``) is refused, never reshaped.
- **dtypes**: a float tensor of another float dtype is cast, with one warning listing the casts; an integer or
  bool tensor where the model holds a float is refused. MXFP4 parts must be uint8 with exactly
  ``[out, in/2]`` codes and ``[out, in/32]`` scales (a scale of one row would broadcast over every row).
- **files**: every shard the index names must resolve (``os.path.realpath``: ``..``, absolute paths and
  symlinks alike) inside the checkpoint folder; anything else is refused, never opened.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
from safetensors import SafetensorError, safe_open

from k3.moe import LatentMoE

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
GROUP = 32  # MXFP4 block size


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed uint8 [out, in/2], scale uint8 [out, in/32] -> fp32 [out, in]; ValueError for any other shapes (a
    scale of another shape would broadcast over rows or groups it does not belong to)."""
    out, half = packed.shape if packed.dim() == 2 else (-1, -1)
    if out < 0 or (2 * half) % GROUP or tuple(scale.shape) != (out, 2 * half // GROUP):
        raise ValueError(f"mxfp4: scale {tuple(scale.shape)} does not fit packed codes {tuple(packed.shape)}")
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
    """Release name (``language_model.`` dropped) -> the real path of its shard, every one inside ``path``."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        raise ValueError(f"{path}: no model.safetensors.index.json")
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{index}: not a safetensors index ({exc})") from exc
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map is not an object")
    root = os.path.realpath(path)
    shards = {}
    for name, file in weight_map.items():
        # realpath resolves ``..`` and symlinks alike: an index only ever names files inside its own folder
        full = os.path.realpath(os.path.join(root, file)) if isinstance(file, str) and file else ""
        if not full or os.path.commonpath([root, full]) != root:
            raise ValueError(f"{index}: {name} points to {file!r}, outside {path} (never followed)")
        shards[name.removeprefix("language_model.")] = full
    missing = sorted({os.path.relpath(v, root) for v in shards.values() if not os.path.exists(v)})
    if missing:
        raise ValueError(f"{path}: shard files missing: {missing[:3]}")
    return shards


def _fetch(shards: dict[str, str], name: str) -> torch.Tensor:
    with safe_open(shards[name], "pt") as f:
        keys = set(f.keys())
        key = name if name in keys else "language_model." + name
        if key not in keys:
            raise ValueError(f"{shards[name]}: the index lists {name} but the shard does not hold it")
        return f.get_tensor(key)


def _listed(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{names[:limit]}{more}"


def _other_ranks_experts(model) -> list[str]:
    """Release names of the routed experts other EP ranks hold: expected in the checkpoint, loaded there."""
    out = []
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, LatentMoE):
            moe = layer.mlp
            mine = range(moe.ep_rank * moe.epn, (moe.ep_rank + 1) * moe.epn)
            for j in (j for j in range(moe.E) if j not in mine):
                out += [f"model.layers.{i}.block_sparse_moe.experts.{j}.{w}.weight" for w in ("w1", "w2", "w3")]
    return out


def _sources(path: str, shards: dict[str, str], wanted: list[str], allow_extra: bool) -> dict[str, tuple[str, ...]]:
    """Name -> its stored key(s): ``(name,)``, or ``(packed, scale)`` for an MXFP4 tensor. ValueError listing every
    missing tensor and every one the model does not have (with ``allow_extra``: a warning naming those dropped)."""
    found, used, missing = {}, set(), []
    for name in wanted:
        base = name.removesuffix(".weight")
        packed = (base + ".weight_packed", base + ".weight_scale")
        keys = (name,) if name in shards else packed if all(k in shards for k in packed) else None
        if keys is None:
            missing.append(name)
        else:
            found[name] = keys
            used.update(keys)
    extra = sorted(set(shards) - used)
    if missing or (extra and not allow_extra):
        raise ValueError(
            f"{path}: {len(missing)} tensor(s) missing {_listed(missing)}, {len(extra)} this model does not have "
            f"{_listed(extra)} (a checkpoint of another model size or layout; allow_extra=True drops the extra ones)"
        )
    if extra:
        # stacklevel 3: the warning names the caller of load_hf_checkpoint (which calls this function)
        warnings.warn(
            f"{path}: allow_extra: dropping {len(extra)} tensor(s) this model does not have: {extra}", stacklevel=3
        )
    return found


def _float(path: str, name: str, src: torch.Tensor, shape: tuple, dtype: torch.dtype, cast: list) -> torch.Tensor:
    """A stored tensor in our layout: the release's known alternative layouts converted for their exact shapes only
    (nothing is reshaped by its element count); float to another float is cast (and listed in ``cast``), an integer
    or bool tensor for a float parameter is refused."""
    if src.dtype != dtype and not (src.dtype.is_floating_point and dtype.is_floating_point):
        raise ValueError(
            f"{path}: {name} is {src.dtype}, the model holds {dtype} there (only float is cast to another float; "
            f"an integer or bool tensor never is)"
        )
    if name.endswith("A_log") and src.dim() == 1 and len(shape) == 1 and src.numel() > shape[0]:
        # the release stores A_log with more entries than KDA heads (128 for 96); the first ones are used
        src = src[: shape[0]]
    elif name.endswith("conv1d.weight") and len(shape) == 2 and tuple(src.shape) == (shape[0], 1, shape[1]):
        src = src[:, 0, :]  # the release's Conv1d layout [D, 1, W]; ours is [D, W]
    elif name.endswith("_res_proj.weight") and len(shape) == 1 and tuple(src.shape) == (1, shape[0]):
        src = src[0]  # the release stores each AttnRes query as a [1, d] projection
    if tuple(src.shape) != tuple(shape):
        raise ValueError(f"{path}: {name} has shape {tuple(src.shape)}, expected {tuple(shape)}")
    if src.dtype != dtype:
        cast.append(f"{name} ({src.dtype} -> {dtype})")
    return src


def _mxfp4(path: str, name: str, packed: torch.Tensor, scale: torch.Tensor, shape: tuple) -> torch.Tensor:
    """An MXFP4 expert matrix of ``shape`` [out, in], its packed codes and scales checked exactly first."""
    out, n = shape
    want = {"weight_packed": (packed, (out, n // 2)), "weight_scale": (scale, (out, n // GROUP))}
    for part, (t, expected) in want.items():
        if n % GROUP or t.dtype != torch.uint8 or tuple(t.shape) != expected:
            raise ValueError(
                f"{path}: {name.removesuffix('.weight')}.{part} is {t.dtype} {tuple(t.shape)}, expected torch.uint8 "
                f"{expected} for a {tuple(shape)} MXFP4 matrix"
            )
    return mxfp4_dequantize(packed, scale)


def _stage(path: str, shards: dict, targets: dict, found: dict) -> list[tuple[torch.Tensor, int | None, torch.Tensor]]:
    """(destination, expert row, checked source) of every target, read and checked before anything is copied."""
    staged, cast = [], []
    for name, (dst, row) in targets.items():
        shape = tuple(dst.shape[1:] if row is not None else dst.shape)
        keys = found[name]
        try:
            tensors = [_fetch(shards, k) for k in keys]
        except SafetensorError as exc:
            raise ValueError(f"{path}: unreadable shard for {name}: {exc}") from exc
        if len(tensors) == 2:
            src = _mxfp4(path, name, *tensors, shape)
        else:
            src = _float(path, name, tensors[0], shape, dst.dtype, cast)
        staged.append((dst, row, src))
    if cast:
        warnings.warn(  # stacklevel 3: the caller of load_hf_checkpoint (which calls this function)
            f"{path}: {len(cast)} float tensor(s) cast to the model's dtype: {_listed(cast)}", stacklevel=3
        )
    return staged


def load_hf_checkpoint(model, path: str, *, allow_extra: bool = False) -> list[str]:
    """Load a released-layout checkpoint folder into ``model`` (any EP rank: its own experts only).

    Strict: every tensor the model has (and every other EP rank's expert) must be there with its exact shape,
    float where the model is float (another float dtype is cast, with a warning); a tensor the model does not
    have (a larger model's layer or expert) is an error, or with ``allow_extra`` a warning naming what is
    dropped. Returns the loaded release names. Raises ValueError naming the problem, before copying anything.
    """
    shards = _read_index(path)
    targets = hf_names(model)
    found = _sources(path, shards, [*targets, *_other_ranks_experts(model)], allow_extra)
    staged = _stage(path, shards, targets, found)
    with torch.no_grad():
        for dst, row, src in staged:
            (dst[row] if row is not None else dst).copy_(src)
    return list(targets)


__all__ = ["load_hf_checkpoint", "hf_names", "mxfp4_dequantize", "mxfp4_quantize"]
