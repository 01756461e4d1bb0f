"""Which mixer each layer of a Hugging Face config runs: transformers 5.x ``layer_types`` and the single-block
hybrid fields, read into the kinds the simulator prices, and refused, naming the field, where a kind is not one
of them. A hybrid is never priced as all softmax attention.

Priced: ``full_attention``; ``sliding_attention`` (``sliding_window``); ``chunked_attention`` (Llama-4: a query
sees its own ``attention_chunk_size`` chunk, priced as a window of the chunk: exact up to one chunk of sequence,
at most the chunk's worth of keys above it); ``linear_attention`` where it is KDA (K3 / Kimi Linear:
``linear_attn_config.kda_layers``, or Kimi Linear's transformers 5.x ``linear_num_heads`` / ``linear_head_dim``
/ ``linear_conv_kernel_dim``) or Mamba-2 (Granite-4: ``mamba_n_heads``); Mamba via Jamba's ``attn_layer_period``
/ ``attn_layer_offset`` or Bamba's ``attn_layer_indices``. Other linear attentions (Gated DeltaNet, lightning
attention), DeepSeek's indexed sparse attention, convolution layers and single-block hybrids (Nemotron-H, Zamba:
one Mamba, attention, MLP or MoE block per layer) have no cost model here and are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ATTENTION = ("full_attention", "sliding_attention", "chunked_attention")
"""``layer_types`` kinds priced as softmax attention."""
SINGLE_BLOCK = ("layers_block_type", "hybrid_override_pattern")
PER_LAYER = ("per_layer_config", "num_attention_heads_per_layer")
"""Per-layer overrides that give some layers another shape: not expressible with one shape per kind."""
"""Fields of hybrids whose layers hold one block each (a mixer or an FFN, not both), which ``ModelSpec`` cannot
express: every layer there is a mixer followed by an FFN."""
MOE_MLP_KINDS = ("sparse", "moe")
"""``mlp_layer_types`` entries that are routed-expert layers (``dense`` is a plain MLP)."""


def layer_kinds(c: dict, layers: int) -> list[str] | None:
    """``layer_types`` checked to hold one kind name per layer (LFM2's ``full_attn_idxs`` read as attention on
    those layers and convolution on the others), or None when the config has neither."""
    types = c.get("layer_types")
    idxs = c.get("full_attn_idxs")
    if types is None and isinstance(idxs, list):
        types = ["full_attention" if i in idxs else "conv" for i in range(layers)]
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != layers or not all(isinstance(t, str) for t in types):
        raise ValueError(f"HF config: field 'layer_types' must list one kind per layer ({layers}), got {_brief(types)}")
    return types


def windowed_layers(get: Callable[..., Any], types: list[str]) -> tuple[int, tuple[int, ...]]:
    """(window, 0-based layers using it): sliding-window layers with ``sliding_window``, or Llama-4's chunked
    layers with ``attention_chunk_size``; a config with both kinds has two windows, which is not expressible."""
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    chunked = tuple(i for i, t in enumerate(types) if t == "chunked_attention")
    if sliding and chunked:
        raise ValueError("HF config: layer_types mixes sliding_attention and chunked_attention: two windows")
    if chunked:
        return int(get("attention_chunk_size") or 0), chunked
    return (int(get("sliding_window") or 0), sliding) if sliding else (0, ())


def kda_from_layer_types(c: dict, get: Callable[..., Any], types: list[str] | None) -> dict:
    """Kimi Linear's transformers 5.x fields as the released ``linear_attn_config`` (KDA on its
    ``linear_attention`` layers, 1-based as in the release); {} for any other config."""
    if c.get("model_type") != "kimi_linear" or not types or "linear_attention" not in types:
        return {}
    return {
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "num_heads": int(get("linear_num_heads") or 0),
        "head_dim": int(get("linear_head_dim") or 0),
        "short_conv_kernel_size": int(get("linear_conv_kernel_dim") or 4),
    }


def check_mixers(c: dict, types: list[str] | None, kda: tuple[int, ...], mamba: tuple[int, ...]) -> None:
    """Raise, naming the HF field, when a layer's mixer is one the spec would price as something else."""
    for key in SINGLE_BLOCK:
        if c.get(key):
            raise ValueError(
                f"HF config: field {key!r} ({_brief(c[key])}) describes one block per layer (Mamba, attention, MLP "
                "or MoE, as in Nemotron-H / Zamba), which is not expressible: every simulated layer is a mixer "
                "followed by an FFN"
            )
    for key in PER_LAYER:
        v = c.get(key)
        if v and not (isinstance(v, list) and len(set(map(str, v))) == 1):
            raise ValueError(
                f"HF config: field {key!r} ({_brief(v)}) gives layers their own shape or mixer, which is not "
                "expressible: every layer of a kind has one shape here"
            )
    if types is not None:
        unknown = sorted(set(types) - set(ATTENTION) - {"linear_attention", "mamba"})
        if unknown:
            raise ValueError(
                f"HF config: layer_types kinds {unknown} have no cost model (priced: {', '.join(ATTENTION)}, and "
                "linear_attention when it is KDA or Mamba-2): refusing to price those layers as full attention"
            )
        linear = tuple(i for i, t in enumerate(types) if t in ("linear_attention", "mamba"))
        if linear != tuple(sorted(set(kda) | set(mamba))):
            what = "no KDA or Mamba-2 description" if not kda and not mamba else f"KDA / Mamba layers {kda + mamba}"
            raise ValueError(
                f"HF config: layer_types marks layers {list(linear)} linear_attention but the config gives {what} "
                "(linear_attn_config.kda_layers, mamba_n_heads): only KDA and Mamba-2 linear attention are priced, "
                "so refusing to price them as softmax attention"
            )
    ssm = sorted(k for k in c if k.startswith(("mamba_", "ssm_")) and c[k] not in (None, False, 0))
    if ssm and not mamba and "attn_layer_period" not in c:
        raise ValueError(
            f"HF config: Mamba fields {ssm[:4]} but no Mamba layer placement this reader knows (Jamba's "
            "attn_layer_period / attn_layer_offset): refusing to price the model as attention only"
        )


def mlp_kinds(c: dict, layers: int) -> tuple[str, ...] | None:
    """``mlp_layer_types`` (transformers 5.x: ``dense`` or ``sparse`` per layer) checked, or None."""
    kinds = c.get("mlp_layer_types")
    if kinds is None:
        return None
    if not isinstance(kinds, list) or len(kinds) != layers or not all(isinstance(k, str) for k in kinds):
        raise ValueError(
            f"HF config: field 'mlp_layer_types' must list one kind per layer ({layers}), got {_brief(kinds)}"
        )
    unknown = sorted(set(kinds) - set(MOE_MLP_KINDS) - {"dense"})
    if unknown:
        raise ValueError(f"HF config: mlp_layer_types kinds {unknown} have no cost model (known: dense, sparse, moe)")
    return tuple(kinds)


def _brief(v: Any) -> str:
    """A value for a one-line message: a long list as its length and distinct entries."""
    if isinstance(v, list) and len(v) > 6:
        return f"{len(v)} entries of {sorted({str(x) for x in v})[:6]}"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
