"""``K3Model``: the Kimi K3 text decoder, single-device code (k3_architecture.md 2.1).

Axes: ``B`` sequences, ``T`` tokens, ``d`` hidden, ``V`` vocabulary. Parallelism is applied from outside
(``k3.parallelize``: ``apply_ep`` attaches a ``moonep.Buffer`` to the MoE layers, ``apply_cp`` a CP communicator to
the attention layers); nothing here imports ``collectives``. Building on ``device="meta"`` allocates nothing and
touches neither.

There is no ordinary residual add: every sublayer reads a depth-softmax mix (Block AttnRes) of the completed
block sums and the running partial sum of the current block.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from k3.attnres import AttnResQuery
from k3.config import K3Config
from k3.kda import KDALayer
from k3.layers import RMSNorm, SiTUMLP
from k3.mla import GatedMLA
from k3.moe import LatentMoE


class DecoderLayer(nn.Module):
    """One K3 layer: AttnRes -> norm -> KDA|MLA, AttnRes -> norm -> dense MLP|LatentMoE."""

    def __init__(self, cfg: K3Config, index: int, *, ep_size: int = 1, ep_rank: int = 0, device=None) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.index, self.block_size = index, cfg.attn_res_block_size
        self.kind = cfg.layer_kind(index)
        self.self_attn = KDALayer(cfg, device=device) if self.kind == "kda" else GatedMLA(cfg, device=device)
        if cfg.is_moe(index):
            self.mlp = LatentMoE(cfg, ep_size=ep_size, ep_rank=ep_rank, device=device)
        else:
            self.mlp = SiTUMLP(
                d, cfg.intermediate_size, cfg.activation_situ_beta, cfg.activation_situ_linear_beta, device=device
            )
        self.input_layernorm = RMSNorm(d, eps, device=device)
        self.post_attention_layernorm = RMSNorm(d, eps, device=device)
        self.attn_res = AttnResQuery(d, eps, device=device)
        self.mlp_res = AttnResQuery(d, eps, device=device)

    def forward(self, partial: torch.Tensor | None, blocks: list[torch.Tensor]) -> torch.Tensor:
        """partial [B, T, d]: running sum of the current block (the embedding before layer 0); blocks is
        updated in place when this layer opens a new block. Returns the new partial sum."""
        h_in = partial if not blocks else self.attn_res(blocks, partial)
        if self.index % self.block_size == 0:  # close the block AFTER reading it (it enters as the partial)
            blocks.append(partial)
            partial = None
        a = self.self_attn(self.input_layernorm(h_in))
        partial = a if partial is None else partial + a
        h_mid = self.mlp_res(blocks, partial)
        return partial + self.mlp(self.post_attention_layernorm(h_mid))


class K3Model(nn.Module):
    """tokens [B, T] int64 -> logits [B, T, V]. ``ep_size``/``ep_rank`` shard the routed experts."""

    def __init__(self, cfg: K3Config, *, ep_size: int = 1, ep_rank: int = 0, device=None) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, ep_size=ep_size, ep_rank=ep_rank, device=device) for i in range(cfg.num_hidden_layers)
        )
        self.output_attn_res = AttnResQuery(d, cfg.rms_norm_eps, device=device)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, device=device)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False, device=device)

    def moe_layers(self) -> list[LatentMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, LatentMoE)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        partial = self.embed_tokens(tokens)
        blocks: list[torch.Tensor] = []
        for layer in self.layers:
            partial = layer(partial, blocks)
        y = self.output_attn_res(blocks, partial)
        return self.lm_head(self.norm(y))


def token_loss_sum(model: K3Model, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies (fp32): tokens, targets [B, T]. Callers divide by the global count."""
    logits = model(tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


def _generator(seed: int, name: str) -> torch.Generator:
    # One stream per parameter name: init is independent of module order and of the EP world size.
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


@torch.no_grad()
def init_weights(model: K3Model, seed: int) -> None:
    """Deterministic init: normal(0, initializer_range) matrices, ones for gains, zeros for AttnRes queries,
    KDA's own rules for conv/A_log/dt_bias; routed experts draw the full [E, ...] tensor and keep their slice."""
    std = model.cfg.initializer_range
    special = set()
    for name, module in model.named_modules():
        if isinstance(module, KDALayer):
            module.reset_special(_generator(seed, name))
            special |= {
                id(module.q_conv1d),
                id(module.k_conv1d),
                id(module.v_conv1d),
                id(module.A_log),
                id(module.dt_bias),
                id(module.o_norm),
            }
        elif isinstance(module, (RMSNorm, AttnResQuery)):
            special |= {id(p) for p in module.parameters()}
            for pname, p in module.named_parameters():
                p.fill_(0.0 if pname == "proj" else 1.0)
    for name, p in model.named_parameters():
        if id(p) in special:
            continue
        gen = _generator(seed, name)
        shard = getattr(p, "expert_shard", None)
        if shard is None:
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        else:
            offset, E = shard
            full = torch.randn((E, *p.shape[1:]), generator=gen) * std
            p.copy_(full[offset : offset + p.shape[0]])


def build_model(
    cfg: K3Config, *, seed: int = 0, ep_size: int = 1, ep_rank: int = 0, dtype: torch.dtype = torch.float32
) -> K3Model:
    """A K3Model on CPU with ``init_weights(seed)`` applied (identical values for any EP size)."""
    model = K3Model(cfg, ep_size=ep_size, ep_rank=ep_rank)
    init_weights(model, seed)
    return model.to(dtype)


__all__ = ["K3Model", "DecoderLayer", "init_weights", "build_model", "token_loss_sum"]
