"""Parameter counts: by arithmetic (``count_parameters``) and from a meta-device model (``count_model_parameters``).

Active parameters count what one token touches: every non-expert weight, the LM head and K of the E routed
experts per MoE layer, but NOT the input embedding (a lookup; the report's Table 1 convention). For ``full``:
2,779,484,476,000 total and 104,189,612,640 active (k3_architecture.md 3.2).
"""

from __future__ import annotations

from k3.config import K3Config


def kda_params(c: K3Config) -> int:
    """q/k/v/g/o projections, f_a/f_b, b_proj, three conv taps, dt_bias, A_log, o_norm."""
    lin, d = c.linear_attn_config, c.hidden_size
    D = lin.num_heads * lin.head_dim
    return (
        5 * d * D
        + d * lin.head_dim
        + lin.head_dim * D
        + d * lin.num_heads
        + 3 * D * lin.short_conv_kernel_size
        + D
        + lin.num_heads
        + lin.head_dim
    )


def mla_params(c: K3Config) -> int:
    """q_a (+norm), q_b, kv_a (+norm), kv_b, o and the output gate g."""
    d, h = c.hidden_size, c.num_attention_heads
    return (
        d * c.q_lora_rank
        + c.q_lora_rank
        + c.q_lora_rank * h * (c.qk_nope_head_dim + c.qk_rope_head_dim)
        + d * (c.kv_lora_rank + c.qk_rope_head_dim)
        + c.kv_lora_rank
        + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
        + 2 * d * h * c.v_head_dim
    )


def moe_params(c: K3Config) -> tuple[int, int]:
    """(total, routed-expert part) of one LatentMoE layer (router bias is a buffer and counted as in the report)."""
    d, L, F, E = c.hidden_size, c.routed_expert_hidden_size, c.moe_intermediate_size, c.num_experts
    routed = E * 3 * L * F
    other = E * d + E + 2 * d * L + L + 3 * d * c.num_shared_experts * F
    return routed + other, routed


def count_parameters(cfg: K3Config) -> dict[str, int]:
    """{"total", "active"} by arithmetic over the config."""
    c, d = cfg, cfg.hidden_size
    total = active = 0
    for i in range(c.num_hidden_layers):
        attn = kda_params(c) if c.layer_kind(i) == "kda" else mla_params(c)
        if c.is_moe(i):
            ffn, routed = moe_params(c)
            ffn_active = ffn - routed + routed * c.num_experts_per_token // c.num_experts
        else:
            ffn = ffn_active = 3 * d * c.intermediate_size
        total += attn + ffn + 6 * d  # 2 RMSNorm gains + 2 AttnRes (query + gain) per layer
        active += attn + ffn_active + 6 * d
    emb = head = c.vocab_size * d
    total += 3 * d + emb + head  # final norm + output AttnRes (query + gain)
    active += 3 * d + head
    return {"total": total, "active": active}


def count_model_parameters(cfg: K3Config) -> dict[str, int]:
    """{"total", "active"} from a ``K3Model`` built on the meta device (no memory, no communication).

    The router's ``e_score_correction_bias`` is a buffer (no gradient) but a checkpoint tensor, so it is counted.
    """
    import torch  # heavy: torch; the arithmetic above stays import-light

    from k3.model import K3Model  # heavy: the model (torch)

    model = K3Model(cfg, device=torch.device("meta"))
    total = routed = 0
    from moonep.parallel import is_expert  # heavy: with the model (torch); marked by LatentMoE

    for _, p in list(model.named_parameters()) + list(model.named_buffers()):
        total += p.numel()
        if is_expert(p):
            routed += p.numel()
    emb = model.embed_tokens.weight.numel()
    active = total - emb - routed + routed * cfg.num_experts_per_token // cfg.num_experts
    return {"total": total, "active": active}


__all__ = ["count_parameters", "count_model_parameters", "kda_params", "mla_params", "moe_params"]
