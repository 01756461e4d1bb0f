"""Single-block hybrids in Hugging Face configs (Nemotron-H, the Nemotron 3 family): each layer holds one block, a
Mamba-2 mixer, softmax attention, an MoE or a plain MLP, after its own pre-norm.

A published ``config.json`` states the blocks as ``hybrid_override_pattern`` (``M`` Mamba-2, ``*`` attention, ``E``
MoE, ``-`` MLP; one character per layer); transformers 5.x's ``NemotronHConfig`` as ``layers_block_type``
(``linear_attention``, ``full_attention``, ``moe``, ``mlp``; 4.x wrote ``mamba`` and ``attention``). Both become
``ModelSpec``'s mixer-only and FFN-only layers. As ``modeling_nemotron_h.py`` builds them: the Mamba-2 mixer's
inner width is ``mamba_num_heads x mamba_head_dim``; the MLP and the experts have an up and a down projection, no
gate (squared ReLU); the router keeps an aux-free selection bias; ``moe_latent_size`` puts the routed experts
behind a down / up projection (LatentMoE).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PATTERN = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
"""``hybrid_override_pattern`` characters and the block each names."""
BLOCK_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention"}
BLOCK_TYPES |= {"moe": "moe", "mlp": "mlp"}
"""``layers_block_type`` entries (transformers 5.x and 4.x names) and the block each names."""
FFN_BLOCKS = ("moe", "mlp")


def single_blocks(c: dict) -> list[str] | None:
    """One block name per layer (``PATTERN``'s values) when ``c`` describes a single-block hybrid, else None (a
    ``layers_block_type`` of mixers only is Granite-4's mixer-and-FFN layers, read by ``hf_layer_kinds``)."""
    pattern, listed = c.get("hybrid_override_pattern"), c.get("layers_block_type")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(PATTERN):
            raise ValueError(
                f"HF config: field 'hybrid_override_pattern' must be a string of {''.join(PATTERN)} (one block per "
                f"layer), got {pattern!r}"
            )
        return [PATTERN[ch] for ch in pattern]
    if not isinstance(listed, list) or not any(k in FFN_BLOCKS for k in listed):
        return None
    unknown = sorted({str(k) for k in listed} - set(BLOCK_TYPES))
    if unknown:
        raise ValueError(f"HF config: layers_block_type entries {unknown} are not blocks this reader knows")
    return [BLOCK_TYPES[k] for k in listed]


def with_layer_count(c: dict, blocks: list[str] | None) -> dict:
    """``c`` with ``num_hidden_layers`` set from the blocks when it is absent (transformers' ``NemotronHConfig``
    derives it and leaves it out of ``to_dict``); a stated count must agree with them."""
    if blocks is None:
        return c
    stated = c.get("num_hidden_layers")
    if stated is not None and stated != len(blocks):
        raise ValueError(
            f"HF config: num_hidden_layers={stated!r} but the block pattern lists {len(blocks)} layers (one block each)"
        )
    return {**c, "num_hidden_layers": len(blocks)}


def single_block_fields(c: dict, get: Callable[..., Any], blocks: list[str]) -> dict:
    """``ModelSpec`` fields of a single-block hybrid: which layers hold which block, the Mamba-2 mixer's sizes,
    2-matrix MLPs and experts."""
    where = {b: tuple(i for i, k in enumerate(blocks) if k == b) for b in PATTERN.values()}
    out: dict[str, Any] = {
        "mixer_only_layers": tuple(sorted(where["mamba"] + where["attention"])),
        "ffn_only_layers": tuple(sorted(where["moe"] + where["mlp"])),
        "mamba_layers": where["mamba"],
        "gated_ffn": False,
        "gated_experts": False,
    }
    if where["moe"]:
        out |= {"moe_layers": where["moe"], "first_k_dense": 0, "router_bias": True}
    if where["mamba"]:
        heads, width = int(get("mamba_num_heads") or 0), int(get("mamba_head_dim") or 0)
        if heads < 1 or width < 1:
            raise ValueError("HF config: Mamba-2 blocks (M) need mamba_num_heads and mamba_head_dim > 0")
        out |= {
            "mamba_heads": heads,
            "mamba_inner_dim": heads * width,
            "mamba_groups": int(get("n_groups") or 1),
            "mamba_d_state": int(get("ssm_state_size") or 128),
            "mamba_d_conv": int(get("conv_kernel") or 4),
            "mamba_conv_bias": bool(c.get("use_conv_bias", True)),
            "mamba_proj_bias": bool(c.get("use_bias", False)),
        }
    return out
