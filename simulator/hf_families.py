"""What differs between the Hugging Face MoE families once their field names are read: nested configs (DBRX),
which layers are MoE (DeepSeek, Qwen-MoE, ERNIE-4.5, Jamba, Llama-4), which are Mamba (Jamba), fixed parts
that no field states (Llama-4's shared expert, gpt-oss' sinks and router bias, MiniCPM-5's attention gate), the
families refused as not expressible, and the model's own name.

Each rule is the one in the family's transformers modeling code (``modeling_<family>.py``, transformers 5.x), or
in DeepSeek's released remote code for ``moe_layer_freq``; see ``simulator/README.md`` ("HF configs").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from simulator.hf_layer_kinds import MOE_MLP_KINDS, RECURRENT, bool_field, mlp_kinds

DBRX_TOP = {"d_model": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers"}
DBRX_TOP |= {"max_seq_len": "max_position_embeddings"}
DBRX_ATTN = {"kv_n_heads": "num_key_value_heads"}
DBRX_FFN = {"ffn_hidden_size": "moe_intermediate_size", "moe_num_experts": "num_local_experts"}
DBRX_FFN |= {"moe_top_k": "num_experts_per_tok"}
DBRX_NO_COST = ("attn_pdrop", "clip_qkv", "rope_theta", "ffn_act_fn", "moe_jitter_eps", "moe_loss_weight")
DBRX_NO_COST += ("moe_normalize_expert_weights", "uniform_expert_assignment", "model_type")
"""DBRX nested fields that change the loss, the numerics or the routing rule, not the step's cost."""


def flatten(c: dict) -> dict:
    """DBRX's ``attn_config`` / ``ffn_config`` and short names as the flat names the reader knows; a nested field
    it does not know is kept under ``ffn_config.NAME`` so the unknown-MoE-field check names it. Other configs
    are returned as they are."""
    if not isinstance(c.get("ffn_config"), dict) and not isinstance(c.get("attn_config"), dict):
        return c
    out = {DBRX_TOP.get(k, k): v for k, v in c.items() if k not in ("ffn_config", "attn_config")}
    for part, names in (("attn_config", DBRX_ATTN), ("ffn_config", DBRX_FFN)):
        nested = c.get(part) or {}
        if not isinstance(nested, dict):
            raise ValueError(f"HF config: field {part!r} must be an object, got {nested!r}")
        for k, v in nested.items():
            if k in names:
                out[names[k]] = v
            elif k not in DBRX_NO_COST:
                out[f"{part}.{k}"] = v
    return out


def moe_layer_ids(c: dict, get: Callable[..., Any], layers: int) -> tuple[tuple[int, ...], dict[str, str]]:
    """0-based MoE layer indices under every placement rule the config states (each restricts), and the HF
    fields that stated them (for messages). Rules: DeepSeek/Kimi ``i >= first_k_dense_replace and i %
    moe_layer_freq == 0``; Qwen-MoE ``(i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers``; ERNIE-4.5
    ``(i + 1) % moe_layer_interval == 0 and start <= i <= end``; Jamba ``i % expert_layer_period ==
    expert_layer_offset``; Llama-4 ``moe_layers`` or every ``interleave_moe_layer_step``-th layer; AfMoE / LFM2-MoE
    ``i >= num_dense_layers``; transformers 5.x ``mlp_layer_types[i]`` sparse."""
    ids, said = set(range(layers)), {}

    def keep(field: str, rule: Callable[[int], bool]) -> None:
        if field in c and c[field] is not None:
            ids.intersection_update([i for i in range(layers) if rule(i)])
            said[field] = f"{field}={c[field]}"

    k, freq = _int(get, "first_k_dense_replace", 0), _int(get, "moe_layer_freq", 1, low=1)
    keep("first_k_dense_replace", lambda i: i >= k)
    keep("moe_layer_freq", lambda i: i % freq == 0)
    step = _int(get, "decoder_sparse_step", 1, low=1)
    keep("decoder_sparse_step", lambda i: (i + 1) % step == 0)
    dense = _layer_list(c, "mlp_only_layers", layers)
    keep("mlp_only_layers", lambda i: i not in dense)
    start, every = _int(get, "moe_layer_start_index", 0), _int(get, "moe_layer_interval", 1, low=1)
    end = _int(get, "moe_layer_end_index", layers - 1)
    keep("moe_layer_start_index", lambda i: i >= start)
    keep("moe_layer_interval", lambda i: (i + 1) % every == 0)
    keep("moe_layer_end_index", lambda i: i <= end)
    period, offset = _period(get, "expert_layer_period", "expert_layer_offset")
    keep("expert_layer_period", lambda i: i % period == offset)
    first_moe = _int(get, "num_dense_layers", 0)
    keep("num_dense_layers", lambda i: i >= first_moe)
    kinds = mlp_kinds(c, layers)
    if kinds is not None:  # transformers 5.x prices layers by this list alone: the other rules must agree with it
        sparse = {i for i in range(layers) if kinds[i] in MOE_MLP_KINDS}
        if said and ids != sparse:
            raise ValueError(f"HF config: mlp_layer_types and {', '.join(said.values())} disagree on the MoE layers")
        keep("mlp_layer_types", lambda i: i in sparse)
    if isinstance(c.get("moe_layers"), list):
        listed = _layer_list(c, "moe_layers", layers)
        keep("moe_layers", lambda i: i in listed)
    else:
        inter = _int(get, "interleave_moe_layer_step", 1, low=1)
        keep("interleave_moe_layer_step", lambda i: (i + 1) % inter == 0)
    if not ids:
        raise ValueError(f"HF config: no layer is MoE under {', '.join(said.values())}")
    return tuple(sorted(ids)), said


def mamba_layer_ids(c: dict, get: Callable[..., Any], layers: int, types: list[str] | None) -> tuple[int, ...]:
    """Jamba: attention on layers ``i % attn_layer_period == attn_layer_offset``, Mamba on the others; Mamba-2
    hybrids (a ``mamba_n_heads`` field): Granite-4's ``layer_types`` Mamba layers (``linear_attention`` / ``mamba``
    in transformers 5.x; ``types``: the config's layer kinds), or Bamba's attention layers ``attn_layer_indices``
    and Mamba on the others."""
    if "attn_layer_period" in c or "attn_layer_offset" in c:
        period, offset = _period(get, "attn_layer_period", "attn_layer_offset")
        return tuple(i for i in range(layers) if i % period != offset)
    if not c.get("mamba_n_heads"):
        return ()
    if types is not None:
        return tuple(i for i, t in enumerate(types) if t in RECURRENT)
    attn = _layer_list(c, "attn_layer_indices", layers)
    return tuple(i for i in range(layers) if i not in attn)


def mamba_fields(c: dict, get: Callable[..., Any]) -> dict:
    """``ModelSpec`` Mamba fields from Jamba's ``mamba_*`` (dt rank ``"auto"`` = 0, resolved by the spec), or
    Mamba-2's ``mamba_n_heads`` / ``mamba_d_head`` / ``mamba_n_groups`` (heads x head width must be the inner
    width ``mamba_expand`` x hidden, as the HF mixers build it)."""
    heads = _int(get, "mamba_n_heads", 0)
    if heads:
        inner = _int(get, "mamba_expand", 2, low=1) * int(get("hidden_size"))
        if heads * _int(get, "mamba_d_head", inner // heads, low=1) != inner:
            raise ValueError(
                f"HF config: mamba_n_heads={heads} x mamba_d_head={get('mamba_d_head')} is not the Mamba inner "
                f"width mamba_expand x hidden_size = {inner}"
            )
        return {
            "mamba_heads": heads,
            "mamba_groups": _int(get, "mamba_n_groups", 1, low=1),
            "mamba_d_state": _int(get, "mamba_d_state", 128, low=1),
            "mamba_d_conv": _int(get, "mamba_d_conv", 4, low=1),
            "mamba_expand": _int(get, "mamba_expand", 2, low=1),
            "mamba_conv_bias": bool_field(c, "mamba_conv_bias", True),
            "mamba_proj_bias": bool_field(c, "mamba_proj_bias", False),
        }
    rank = c.get("mamba_dt_rank", "auto")
    return {
        "mamba_d_state": _int(get, "mamba_d_state", 16, low=1),
        "mamba_d_conv": _int(get, "mamba_d_conv", 4, low=1),
        "mamba_expand": _int(get, "mamba_expand", 2, low=1),
        "mamba_dt_rank": 0 if rank == "auto" else _int(get, "mamba_dt_rank", 0, low=1),
        "mamba_conv_bias": bool_field(c, "mamba_conv_bias", True),
        "mamba_proj_bias": bool_field(c, "mamba_proj_bias", False),
    }


GATED_ATTENTION = ("minicpm5_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_text")
"""Families whose softmax attention has a full-width sigmoid output gate that no field states (``q_gate_proj``)."""
NOT_EXPRESSIBLE = {
    "doge": "its experts are single-neuron embeddings looked up by product keys",
    "jetmoe": "its attention is a mixture of routed attention experts",
    "falcon_h1": "each layer runs attention and a Mamba-2 mixer side by side",
    "longcat_flash": "each layer runs two MLA attentions and two dense MLPs beside a shortcut-connected MoE whose "
    "zero-computation experts (zero_expert_num) make the work per token depend on the routing",
}
"""Families whose experts or layers the simulator cannot stand for: refused, not mispriced."""


def check_family(c: dict) -> None:
    """Raise for a ``NOT_EXPRESSIBLE`` family, naming its ``model_type``."""
    kind = str(c.get("model_type", ""))
    if kind in NOT_EXPRESSIBLE:
        raise ValueError(f"HF config: model_type {kind!r} is not expressible: {NOT_EXPRESSIBLE[kind]}")


def dense_ffn_width(c: dict, width: int) -> int:
    """The dense MLP's width as the model builds it: LFM2's ``block_auto_adjust_ff_dim`` takes two thirds of
    ``intermediate_size``, scales it by ``block_ffn_dim_multiplier`` and rounds up to ``block_multiple_of``."""
    if not c.get("block_auto_adjust_ff_dim"):
        return width
    width = int(2 * width / 3)
    mult = c.get("block_ffn_dim_multiplier")
    if mult is not None:
        step = int(c.get("block_multiple_of") or 1)
        width = step * ((int(float(mult) * width) + step - 1) // step)
    return width


EXPERT_WIDTH_IS_INTERMEDIATE = frozenset(
    [
        "aria_text",
        "cohere2_moe",
        "dbrx",
        "flex_olmo",
        "gpt_oss",
        "granitemoe",
        "granitemoe_swa",
        "granitemoehybrid",
        "granitemoeshared",
        "hunyuan_v1_moe",
        "jamba",
        "llama4_text",
        "minimax",
        "minimax_m2",
        "minimax_m3_vl_text",
        "mixtral",
        "olmoe",
        "openai_privacy_filter",
        "phimoe",
    ]
)
"""``model_type`` s whose routed experts are ``intermediate_size`` wide (they have no ``moe_intermediate_size``):
every such MoE family of transformers 5.25, read from its config classes (tests/simulator/test_hf_transformers_sweep.py
holds the list against the installed transformers). Another family without ``moe_intermediate_size`` is priced
the same way, with a warning that says so."""


def family_fixed(c: dict) -> dict:
    """Parts a family always has that no field states: Llama-4's one shared expert (``Llama4TextMoe``),
    gpt-oss' per-head sinks, router and expert biases, Ergo's 2-matrix squared-ReLU MLPs and experts, Qwen2-MoE's
    sigmoid gate on its shared expert."""
    kind = str(c.get("model_type", ""))
    if kind.startswith("llama4"):
        return {"num_shared_experts": 1}
    if kind == "gpt_oss":
        return {"attn_sinks": True, "router_bias": True, "expert_bias": True}
    if kind == "ergo":  # ErgoMLP, ErgoSharedExpert and the experts: up, squared ReLU, down
        return {"gated_ffn": False, "gated_experts": False}
    if kind == "qwen2_moe" or c.get("shared_expert_intermediate_size"):
        return {"shared_expert_gate": True}
    return {}


def model_name(cfg: dict) -> str:
    """The model's own name: ``_name_or_path`` when the file has one, else ``model_type`` and ``architectures``
    (``mixtral MixtralForCausalLM``), else ``hf``."""
    path = cfg.get("_name_or_path")
    if isinstance(path, str) and path.strip():
        return path.strip()
    kind = cfg.get("model_type") or (cfg.get("text_config") or {}).get("model_type") or ""
    archs = cfg.get("architectures") or []
    archs = "+".join(a for a in archs if isinstance(a, str)) if isinstance(archs, list) else ""
    return " ".join(p for p in (str(kind), archs) if p) or "hf"


def check_whole(key: str, v: Any) -> None:
    """ValueError naming HF field ``key`` unless ``v`` is a whole number (an int or an integral float, not a bool)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"HF config: field {key!r} must be a whole number, got {v!r}")


def _int(get: Callable[..., Any], key: str, default: int, low: int = 0) -> int:
    v = get(key)
    if v is None:
        return default
    check_whole(key, v)  # a field that may also be a word ("auto") skips the getter's check
    if v < low:
        raise ValueError(f"HF config: field {key!r} must be >= {low}, got {v!r}")
    return int(v)


def _period(get: Callable[..., Any], period_key: str, offset_key: str) -> tuple[int, int]:
    period, offset = _int(get, period_key, 1, low=1), _int(get, offset_key, 0)
    if offset >= period:
        raise ValueError(f"HF config: {offset_key}={offset} must be below {period_key}={period}")
    return period, offset


def _layer_list(c: dict, key: str, layers: int) -> set[int]:
    v = c.get(key) or []
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise ValueError(f"HF config: field {key!r} must be a list of layer indices, got {v!r}")
    if any(not 0 <= i < layers for i in v):
        raise ValueError(f"HF config: field {key!r} has indices outside 0..{layers - 1}: {v!r}")
    return set(v)
