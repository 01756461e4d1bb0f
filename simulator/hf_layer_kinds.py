"""Which mixer and FFN each layer of a Hugging Face config runs: transformers 5.x ``layer_types`` /
``mlp_layer_types`` (or what transformers derives when a published file states it another way), read into the
kinds the simulator prices, and refused, naming the field, where a kind is not one of them. A hybrid is never
priced as all softmax attention.

Priced: ``full_attention``; ``sliding_attention`` (``sliding_window``); ``chunked_attention`` (Llama-4: a query
sees its own ``attention_chunk_size`` chunk, priced as a window of the chunk: exact up to one chunk of sequence,
at most the chunk's worth of keys above it); ``linear_attention`` where it is a delta rule (KDA: K3 / Kimi
Linear's ``linear_attn_config.kda_layers`` or ``linear_num_heads`` / ``linear_head_dim``; Gated DeltaNet:
Qwen3-Next / Qwen3.5's ``linear_num_key_heads`` / ``linear_num_value_heads``) or Mamba-2 (Granite-4:
``mamba_n_heads``); Mamba via Jamba's ``attn_layer_period`` / ``attn_layer_offset`` or Bamba's
``attn_layer_indices``. Other linear attentions (lightning attention, Bailing's), DeepSeek's indexed sparse
attention, convolution layers and parallel hybrids (Falcon-H1, in ``hf_families``) have no cost model here and are
refused.

Single-block hybrids (Nemotron-H, the Nemotron 3 family) hold one block per layer, after its own pre-norm: a Mamba-2
mixer, softmax attention, an MoE or a plain MLP. A published ``config.json`` states the blocks as
``hybrid_override_pattern`` (``M`` Mamba-2, ``*`` attention, ``E`` MoE, ``-`` MLP; one character per layer);
transformers 5.x's ``NemotronHConfig`` as ``layers_block_type`` (``linear_attention``, ``full_attention``, ``moe``,
``mlp``; 4.x wrote ``mamba`` and ``attention``). Both become ``ModelSpec``'s mixer-only and FFN-only layers. As
``modeling_nemotron_h.py`` builds them: the Mamba-2 mixer's inner width is ``mamba_num_heads x mamba_head_dim``;
the MLP and the experts have an up and a down projection, no gate (squared ReLU); the router keeps an aux-free
selection bias; ``moe_latent_size`` puts the routed experts behind a down / up projection (LatentMoE).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ATTENTION = ("full_attention", "sliding_attention", "chunked_attention")
"""``layer_types`` kinds priced as softmax attention."""
RECURRENT = ("linear_attention", "mamba")
"""``layer_types`` kinds priced as a recurrent mixer (KDA, Gated DeltaNet or Mamba-2, from the config's fields)."""
EVERY_NTH_FULL = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
"""Families whose file may give ``full_attention_interval`` (default 4) instead of ``layer_types``: full attention
on every n-th layer, Gated DeltaNet on the others (transformers' config classes)."""
ALTERNATING = ("minimax",)
"""Families whose transformers config class alternates full and linear attention when no ``layer_types`` is given."""
PER_LAYER = ("per_layer_config", "num_attention_heads_per_layer")
"""Per-layer overrides that give some layers another shape: not expressible with one shape per kind."""
MOE_MLP_KINDS = ("sparse", "moe")
"""``mlp_layer_types`` entries that are routed-expert layers (``dense`` is a plain MLP)."""


def layer_kinds(c: dict, layers: int) -> list[str] | None:
    """``layer_types`` checked to hold one kind name per layer, or what transformers' config class derives when
    the file has none (``_derived_kinds``); None for a config with neither."""
    types = c.get("layer_types")
    if types is None:
        types = _derived_kinds(c, layers)
    return None if types is None else _kind_list("layer_types", types, layers)


def _kind_list(key: str, kinds: Any, layers: int) -> list[str]:
    """``kinds`` checked to be one kind name per layer (the HF field ``key``, for the message)."""
    if not isinstance(kinds, list) or len(kinds) != layers or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"HF config: field {key!r} must list one kind per layer ({layers}), got {_brief(kinds)}")
    return kinds


def _derived_kinds(c: dict, layers: int) -> list[str] | None:
    """Layer kinds a file states another way: Granite-4's ``layers_block_type`` (``mamba`` / ``attention``),
    LFM2's ``full_attn_idxs`` (convolutions elsewhere), Qwen3-Next / Qwen3.5's ``full_attention_interval``, and
    the alternating default of MiniMax; None when the family has no such rule."""
    block = c.get("layers_block_type")
    if isinstance(block, list):  # mixers only here: one with MLP / MoE blocks is a single-block hybrid
        return [{"attention": "full_attention"}.get(str(k), str(k)) for k in block]
    idxs = c.get("full_attn_idxs")
    if isinstance(idxs, list):
        return ["full_attention" if i in idxs else "conv" for i in range(layers)]
    kind = c.get("model_type")
    if kind in EVERY_NTH_FULL:
        n = c.get("full_attention_interval", 4)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"HF config: field 'full_attention_interval' must be an integer >= 1, got {n!r}")
        return ["linear_attention" if (i + 1) % n else "full_attention" for i in range(layers)]
    if kind in ALTERNATING:
        return ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(layers)]
    return None


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
    """The delta-rule layers of transformers 5.x fields as a ``linear_attn_config`` (1-based layers, as in K3's
    release): Kimi Linear's KDA (``linear_num_heads`` / ``linear_head_dim``), or Gated DeltaNet (Qwen3-Next,
    Qwen3.5, OLMo-Hybrid: ``linear_num_key_heads`` / ``linear_num_value_heads`` and their widths, one decay per
    value head: ``gate = "head"``); {} for any other config."""
    if not types or "linear_attention" not in types:
        return {}
    layers = [i + 1 for i, t in enumerate(types) if t == "linear_attention"]
    conv = int(get("linear_conv_kernel_dim") or 4)
    if c.get("model_type") == "kimi_linear":
        heads, dim = int(get("linear_num_heads") or 0), int(get("linear_head_dim") or 0)
        return {"kda_layers": layers, "num_heads": heads, "head_dim": dim, "short_conv_kernel_size": conv}
    if c.get("linear_num_value_heads") is None or c.get("linear_num_key_heads") is None:
        return {}
    return {
        "kda_layers": layers,
        "num_heads": int(get("linear_num_value_heads")),
        "head_dim": int(get("linear_value_head_dim") or 0),
        "key_heads": int(get("linear_num_key_heads")),
        "key_dim": int(get("linear_key_head_dim") or 0),
        "short_conv_kernel_size": conv,
        "gate": "head",
    }


def check_mixers(c: dict, types: list[str] | None, kda: tuple[int, ...], mamba: tuple[int, ...]) -> None:
    """Raise, naming the HF field, when a layer's mixer is one the spec would price as something else."""
    for key in PER_LAYER:
        v = c.get(key)
        if v and not (isinstance(v, list) and len(set(map(str, v))) == 1):
            raise ValueError(
                f"HF config: field {key!r} ({_brief(v)}) gives layers their own shape or mixer, which is not "
                "expressible: every layer of a kind has one shape here"
            )
    cycle = c.get("block_types")  # RecurrentGemma: a cycle of block kinds over the layers
    unknown = sorted({str(k) for k in cycle} - {"attention"}) if isinstance(cycle, list) else []
    if unknown:
        raise ValueError(
            f"HF config: block_types kinds {unknown} have no cost model (RecurrentGemma's RG-LRU blocks): refusing "
            "to price those layers as attention"
        )
    if types is not None:
        unknown = sorted(set(types) - set(ATTENTION) - set(RECURRENT))
        if unknown:
            raise ValueError(
                f"HF config: layer_types kinds {unknown} have no cost model (priced: {', '.join(ATTENTION)}, and "
                "linear_attention when it is a delta rule or Mamba-2): refusing to price those layers as full attention"
            )
        linear = tuple(i for i, t in enumerate(types) if t in RECURRENT)
        if linear != tuple(sorted(set(kda) | set(mamba))):
            what = "no delta-rule or Mamba-2 fields" if not kda and not mamba else f"such layers {kda + mamba}"
            raise ValueError(
                f"HF config: layer_types marks layers {list(linear)} linear_attention but the config gives {what} "
                "(linear_attn_config.kda_layers, linear_num_value_heads, mamba_n_heads): only KDA, Gated DeltaNet "
                "and Mamba-2 are priced, so refusing to price them as softmax attention"
            )
    ssm = sorted(k for k in c if k.startswith(("mamba_", "ssm_")) and c[k] not in (None, False, 0))
    if ssm and not mamba and "attn_layer_period" not in c:
        raise ValueError(
            f"HF config: Mamba fields {ssm[:4]} but no Mamba layer placement this reader knows (Jamba's "
            "attn_layer_period / attn_layer_offset): refusing to price the model as attention only"
        )
    linear = sorted(k for k in c if k.startswith("linear_num_") and c[k])
    if linear and not kda and types is None:
        raise ValueError(
            f"HF config: linear-attention fields {linear} but no linear_attention layers this reader places "
            "(layer_types, full_attention_interval): refusing to price the model as attention only"
        )
    if c.get("index_topk"):
        raise ValueError(
            f"HF config: index_topk={c['index_topk']}: indexed sparse attention (DeepSeek-V3.2) has no cost model: "
            "refusing to price it as full attention"
        )


def mlp_kinds(c: dict, layers: int) -> tuple[str, ...] | None:
    """``mlp_layer_types`` (transformers 5.x: ``dense`` or ``sparse`` per layer) checked, or None."""
    kinds = c.get("mlp_layer_types")
    if kinds is None:
        return None
    _kind_list("mlp_layer_types", kinds, layers)
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


PATTERN = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
"""``hybrid_override_pattern`` characters and the block each names."""
BLOCK_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention"}
BLOCK_TYPES |= {"moe": "moe", "mlp": "mlp"}
"""``layers_block_type`` entries (transformers 5.x and 4.x names) and the block each names."""
FFN_BLOCKS = ("moe", "mlp")
NO_EXPERTS = ("num_experts", "top_k", "moe_ffn_hidden", "num_shared_experts", "shared_ffn_hidden", "moe_latent_dim")
NO_EXPERTS += ("expert_groups", "groups_per_token")
"""``ModelSpec`` expert fields, zeroed for a pattern without an MoE block."""


def single_blocks(c: dict) -> list[str] | None:
    """One block name per layer (``PATTERN``'s values) when ``c`` describes a single-block hybrid, else None (a
    ``layers_block_type`` of mixers only is Granite-4's mixer-and-FFN layers, read by ``layer_kinds``)."""
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


def mtp_blocks(c: dict) -> str:
    """Each MTP module's blocks as ``PATTERN`` letters (Nemotron 3 Super: ``*E``, an attention and an MoE block)
    from ``mtp_hybrid_override_pattern`` or transformers 5.x's ``mtp_layers_block_type``; empty: none given."""
    pattern, listed = c.get("mtp_hybrid_override_pattern"), c.get("mtp_layers_block_type")
    if pattern is not None and (not isinstance(pattern, str) or set(pattern) - set(PATTERN)):
        raise ValueError(f"HF config: field 'mtp_hybrid_override_pattern' must be a string of {''.join(PATTERN)}")
    if pattern is None and listed is not None:
        if not isinstance(listed, list) or any(BLOCK_TYPES.get(str(k)) is None for k in listed):
            raise ValueError(
                f"HF config: field 'mtp_layers_block_type' lists blocks this reader does not know: {listed!r}"
            )
        letter = {name: ch for ch, name in PATTERN.items()}
        pattern = "".join(letter[BLOCK_TYPES[str(k)]] for k in listed)
    return pattern or ""


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
    if get("num_nextn_predict_layers"):  # transformers 5.x writes its default MTP blocks into files without MTP
        # Megatron-Bridge's Nemotron-H bridge repeats one module over the depths unless the file says otherwise
        out |= {"mtp_blocks": mtp_blocks(c), "mtp_repeated": bool_field(c, "mtp_use_repeated_layer", True)}
    if where["moe"]:
        out |= {"moe_layers": where["moe"], "first_k_dense": 0, "router_bias": True}
    else:  # no MoE block: expert fields a dense file carries (transformers' defaults) build nothing
        out |= dict.fromkeys(NO_EXPERTS, 0) | {"router_bias": False}
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


def bool_field(c: dict, key: str, default: bool) -> bool:
    """HF field ``key`` of ``c`` (``default`` when absent); anything but true or false is a ValueError naming it."""
    v = c.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"HF config: field {key!r} must be true or false, got {v!r}")
    return v
