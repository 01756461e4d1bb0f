"""``ModelSpec``: a decoder-only transformer described by the few numbers that cost and memory depend on.

Each layer has a mixer kind (``mha`` incl. GQA, ``mla``, ``kda``, ``mamba``) and an FFN kind (``dense`` or ``moe``);
in a single-block hybrid (Nemotron-H) a layer holds one of the two and the other is ``none``. ``layer_kinds()``
lists them. Counting formulas live in ``simulator.layers``; presets and loaders in
``simulator.specs`` and ``simulator.hf_config``.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, fields
from functools import lru_cache

from moonep_base import MAX_SIZE
from simulator.field_checks import frozen_config

ATTENTION_KINDS = ("mha", "mla")
MAX_TOKENS = 2**53
"""Largest token count a job takes (its global batch): every count up to it is exact as a float."""


@frozen_config
class ModelSpec:
    """A decoder-only transformer (dense or MoE; softmax, MLA or KDA attention per layer)."""

    name: str
    """Label used in reports."""
    hidden: int
    """Model width H."""
    num_layers: int
    """Number of decoder layers L."""
    vocab: int
    """Vocabulary size V."""
    num_heads: int
    """Attention heads of the softmax (MHA/GQA/MLA) layers."""
    num_kv_heads: int = 0
    """Key/value heads for GQA; 0 means ``num_heads`` (MHA). Ignored by MLA."""
    head_dim: int = 0
    """Per-head width for MHA/GQA; 0 means ``hidden // num_heads``."""
    attention: str = "mha"
    """Softmax attention flavour of the non-KDA layers: ``mha`` (incl. GQA) or ``mla``."""
    q_lora_rank: int = 0
    """MLA query low-rank width (0: full-rank query projection)."""
    kv_lora_rank: int = 0
    """MLA compressed KV width (the cached latent)."""
    qk_nope_dim: int = 0
    """MLA per-head query/key width without position part."""
    qk_rope_dim: int = 0
    """MLA shared key/query slice per head (cached with the latent)."""
    v_head_dim: int = 0
    """MLA per-head value width."""
    attn_output_gate: bool = False
    """Full-rank sigmoid output gate on attention (K3 MLA and KDA): one extra H x (heads*dv) matrix."""
    kda_layers: tuple[int, ...] = ()
    """0-based indices of layers using KDA linear attention instead of ``attention``."""
    kda_heads: int = 0
    """KDA heads (Gated DeltaNet: value heads)."""
    kda_head_dim: int = 0
    """KDA per-head key = value width (Gated DeltaNet: the value width)."""
    kda_conv: int = 4
    """KDA short-convolution taps on q, k, v."""
    kda_gate: str = "channel"
    """The delta rule's decay: ``channel`` (KDA: a low-rank channel-wise gate and a full-rank output gate) or
    ``head`` (Gated DeltaNet, Qwen3-Next / Qwen3.5: one decay and one beta per value head from the hidden state,
    an output gate z; its q and k may have their own head count and width)."""
    kda_key_heads: int = 0
    """Gated DeltaNet q / k heads (0: ``kda_heads``)."""
    kda_key_dim: int = 0
    """Gated DeltaNet q / k head width (0: ``kda_head_dim``)."""
    ffn_hidden: int = 0
    """Dense FFN width (the dense layers of an MoE model too)."""
    gated_ffn: bool = True
    """GLU-style FFN (3 matrices) rather than 2-matrix GeLU MLP."""
    num_experts: int = 0
    """Routed experts E per MoE layer (0: dense model)."""
    top_k: int = 0
    """Experts per token K."""
    moe_ffn_hidden: int = 0
    """Routed/shared expert width."""
    num_shared_experts: int = 0
    """Shared experts (fused into one MLP of width ``num_shared_experts * moe_ffn_hidden``)."""
    shared_ffn_hidden: int = 0
    """Width of the always-active shared MLP when a config gives it directly (Granite-4's
    ``shared_intermediate_size``, not a whole number of expert widths); 0 = ``num_shared_experts`` experts."""
    first_k_dense: int = 0
    """Leading layers with a dense FFN instead of MoE."""
    moe_layers: tuple[int, ...] = ()
    """0-based indices of the MoE layers when they are not simply every layer from ``first_k_dense`` (Llama-4
    Maverick: every other layer; Jamba: every other layer); empty = layers ``first_k_dense..``; the rest are
    dense FFNs of width ``ffn_hidden``."""
    shared_expert_gate: bool = False
    """Qwen2-MoE: the shared expert's output is scaled by a sigmoid gate, one [H -> 1] projection per layer."""
    moe_latent_dim: int = 0
    """LatentMoE width: routed experts work in this latent (dispatch sends it); 0 = full width."""
    expert_groups: int = 0
    """Expert groups of group-limited routing (HF ``n_group``; 0: none)."""
    groups_per_token: int = 0
    """Groups a token's experts may come from (HF ``topk_group``; DeepSeek-V3: 4 of 8); 0: no limit."""
    router_bias: bool = False
    """Router carries a per-expert selection bias (aux-free balancing)."""
    bias: bool = False
    """Linear layers carry biases (GPT/Megatron)."""
    expert_bias: bool = False
    """Routed experts carry biases (gpt-oss); priced by ``ParallelConfig.fused_expert_mlp``."""
    glu_clamp: float = 0.0
    """Clamp on the gated activation's two inputs (gpt-oss ``swiglu_limit`` 7.0; 0: none)."""
    norm: str = "rmsnorm"
    """``rmsnorm`` (gain only) or ``layernorm`` (gain and bias)."""
    attn_res: bool = False
    """K3 Block AttnRes: 4 norms + 2 pseudo-queries per layer and 3 vectors at the output."""
    attn_res_block_size: int = 0
    """Layers per AttnRes block (sets how many sources each mix reads; 0 = one block)."""
    dropout: bool = False
    """Dropout after attention and MLP (saves a 1-byte mask each; Megatron GPT runs)."""
    tie_embeddings: bool = False
    """Input embedding and LM head share weights."""
    position_embeddings: int = 0
    """Rows of a learned absolute position table (0: none)."""
    sliding_window: int = 0
    """Keys a query attends to in the sliding-window layers (0: no sliding-window layers)."""
    sliding_window_layers: tuple[int, ...] = ()
    """0-based indices of softmax layers using the ``sliding_window`` (gpt-oss: every other layer)."""
    attn_sinks: bool = False
    """gpt-oss: one learned sink logit per attention head (``num_heads`` parameters per softmax layer)."""
    mamba_layers: tuple[int, ...] = ()
    """0-based indices of layers whose mixer is a Mamba (selective SSM) block instead of attention (Jamba)."""
    mamba_d_state: int = 16
    """Mamba SSM state size N per channel (HF ``mamba_d_state``)."""
    mamba_d_conv: int = 4
    """Mamba causal depthwise convolution taps (HF ``mamba_d_conv``)."""
    mamba_expand: int = 2
    """Mamba inner width = ``mamba_expand * hidden`` (HF ``mamba_expand``)."""
    mamba_dt_rank: int = 0
    """Rank of the Mamba time-step projection; 0 = ceil(hidden / 16) (HF ``mamba_dt_rank="auto"``)."""
    mamba_conv_bias: bool = True
    """Mamba convolution carries a bias (HF ``mamba_conv_bias``)."""
    mamba_proj_bias: bool = False
    """Mamba in/out projections carry biases (HF ``mamba_proj_bias``)."""
    mamba_heads: int = 0
    """Mamba-2 (SSD) heads over the inner width (HF ``mamba_n_heads``: Bamba, Granite-4); 0 = Mamba-1 (Jamba)."""
    mamba_groups: int = 1
    """Mamba-2 groups sharing one B and C projection (HF ``mamba_n_groups``)."""
    mamba_inner_dim: int = 0
    """Mamba inner width when a config gives it as heads x head width (Nemotron-H); 0 = ``mamba_expand * hidden``."""
    mixer_only_layers: tuple[int, ...] = ()
    """0-based indices of layers holding a mixer and no FFN (single-block hybrids: Nemotron-H's ``M`` and ``*``)."""
    ffn_only_layers: tuple[int, ...] = ()
    """0-based indices of layers holding an FFN and no mixer (Nemotron-H's ``E`` and ``-``)."""
    gated_experts: bool = True
    """Routed and shared experts are GLU (3 matrices) rather than 2-matrix (Nemotron-H's squared ReLU)."""
    seq_len: int = 4096
    """Default training sequence length."""
    mtp_layers: int = 0
    """Multi-token-prediction modules (DeepSeek-V3 ``num_nextn_predict_layers``): each is one more transformer layer
    plus a projection [2H -> H] and norms, sharing the embedding and LM head. Not in ``param_counts``' total/active
    (the published counts exclude it: DeepSeek-V3's 671B leaves out its 14B MTP module)."""
    mtp_blocks: str = ""
    """Blocks of each MTP module in ``hybrid_override_pattern`` letters (Nemotron-H's ``mtp_hybrid_override_pattern``:
    ``*E`` is an attention block, then an MoE block); empty: one layer of the model's last kind."""
    mtp_repeated: bool = False
    """One MTP module's weights serve every depth (Megatron's ``mtp_use_repeated_layer``): time and activations
    per depth, parameters, gradients and optimizer state once."""

    def __post_init__(self):
        _check_field_types(self)
        for f in ("hidden", "num_layers", "vocab", "num_heads"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"ModelSpec.{f} must be a positive integer, got {getattr(self, f)!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"ModelSpec.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.attention == "mla" and min(self.kv_lora_rank, self.qk_nope_dim, self.v_head_dim) < 1:
            raise ValueError("ModelSpec.kv_lora_rank/qk_nope_dim/v_head_dim must be > 0 for MLA")
        if self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelSpec.num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")
        if any(not 0 <= i < self.num_layers for i in self.kda_layers):
            raise ValueError("ModelSpec.kda_layers must be 0-based indices below num_layers")
        if self.kda_layers and min(self.kda_heads, self.kda_head_dim) < 1:
            raise ValueError("ModelSpec.kda_heads and kda_head_dim must be > 0 when kda_layers is set")
        if self.kda_gate not in ("channel", "head"):
            raise ValueError(f"ModelSpec.kda_gate must be 'channel' or 'head', got {self.kda_gate!r}")
        if self.kda_gate == "channel" and (self.kda_key_heads or self.kda_key_dim):
            raise ValueError("ModelSpec.kda_key_heads / kda_key_dim are Gated DeltaNet's (kda_gate='head')")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"ModelSpec.top_k must be in [1, num_experts], got {self.top_k}")
        if self.num_experts and self.moe_ffn_hidden < 1:
            raise ValueError("ModelSpec.moe_ffn_hidden must be > 0 for an MoE model")
        if self.shared_ffn_hidden and self.num_shared_experts:
            raise ValueError(
                "ModelSpec.shared_ffn_hidden and num_shared_experts are both set: give the shared MLP one way"
            )
        self._check_moe_layers()
        if any(k[1] == "dense" for k in self.layer_kinds()) and self.ffn_hidden < 1:
            raise ValueError("ModelSpec.ffn_hidden must be > 0 when any layer is dense")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"ModelSpec.norm must be rmsnorm or layernorm, got {self.norm!r}")
        if self.seq_len < 1:
            raise ValueError(f"ModelSpec.seq_len must be >= 1, got {self.seq_len}")
        self._check_mtp()
        if not 0 <= self.glu_clamp < float("inf"):
            raise ValueError(f"ModelSpec.glu_clamp must be a finite number >= 0, got {self.glu_clamp!r}")
        if self.attn_res_block_size < 0:
            raise ValueError(f"ModelSpec.attn_res_block_size must be >= 0, got {self.attn_res_block_size}")
        if any(not 0 <= i < self.num_layers for i in self.sliding_window_layers):
            raise ValueError("ModelSpec.sliding_window_layers must be 0-based indices below num_layers")
        mamba = set(self.mamba_layers)
        if any(not 0 <= i < self.num_layers for i in mamba) or mamba & set(self.kda_layers):
            raise ValueError("ModelSpec.mamba_layers must be 0-based indices below num_layers, none of them KDA")
        if self.mamba_layers and min(self.mamba_d_state, self.mamba_d_conv, self.mamba_expand) < 1:
            raise ValueError("ModelSpec.mamba_d_state, mamba_d_conv and mamba_expand must be > 0 for Mamba layers")
        if self.mamba_heads and (self.mamba_inner % self.mamba_heads or self.mamba_heads % max(self.mamba_groups, 1)):
            raise ValueError(
                f"ModelSpec.mamba_heads {self.mamba_heads} must divide the Mamba inner width {self.mamba_inner} and "
                f"be a multiple of mamba_groups {self.mamba_groups}"
            )
        if self.sliding_window_layers and self.sliding_window < 1:
            raise ValueError("ModelSpec.sliding_window must be > 0 when sliding_window_layers is set")
        self._check_shapes()
        self._check_single_blocks()

    def _check_single_blocks(self) -> None:
        """A layer holds a mixer, an FFN or both; a mixer-only layer has no FFN kind, an FFN-only one no mixer."""
        mixer, ffn = set(self.mixer_only_layers), set(self.ffn_only_layers)
        if any(not 0 <= i < self.num_layers for i in mixer | ffn) or mixer & ffn:
            raise ValueError("ModelSpec.mixer_only_layers / ffn_only_layers must be disjoint indices below num_layers")
        if ffn & (set(self.kda_layers) | set(self.mamba_layers)):
            raise ValueError("ModelSpec.ffn_only_layers must not be KDA or Mamba layers (those are mixers)")
        if mixer & set(self.moe_layers):
            raise ValueError("ModelSpec.mixer_only_layers must not be MoE layers (a mixer-only layer has no FFN)")
        if (mixer or ffn) and self.is_moe and not self.moe_layers:
            raise ValueError("ModelSpec.moe_layers must name the MoE layers of a single-block hybrid")

    def _check_shapes(self) -> None:
        """Sizes that are each valid but impossible together (a head narrower than one unit, groups of no expert)."""
        if self.attention == "mha" and not self.head_dim and self.hidden < self.num_heads:
            raise ValueError(
                f"ModelSpec.num_heads {self.num_heads} > hidden {self.hidden}: the head width hidden // num_heads "
                "is 0 (set head_dim)"
            )
        if self.expert_groups and (self.expert_groups > self.num_experts or self.num_experts % self.expert_groups):
            raise ValueError(f"ModelSpec.expert_groups {self.expert_groups} must divide num_experts {self.num_experts}")
        if self.expert_groups and self.groups_per_token > self.expert_groups:
            raise ValueError(
                f"ModelSpec.groups_per_token {self.groups_per_token} must be <= expert_groups {self.expert_groups}"
            )
        if self.first_k_dense > self.num_layers:
            raise ValueError(f"ModelSpec.first_k_dense {self.first_k_dense} must be <= num_layers {self.num_layers}")

    def _check_moe_layers(self) -> None:
        """``moe_layers`` is one way to say which layers are MoE; ``first_k_dense`` the other, not both."""
        if not self.moe_layers:
            return
        if not self.num_experts:
            raise ValueError("ModelSpec.moe_layers is set but num_experts is 0")
        if self.first_k_dense:
            raise ValueError("ModelSpec.moe_layers and first_k_dense are both set: give the MoE layers one way")
        ids = self.moe_layers
        if any(not 0 <= i < self.num_layers for i in ids) or len(set(ids)) < len(ids):
            raise ValueError("ModelSpec.moe_layers must be distinct 0-based indices below num_layers")

    @property
    def kda_key_width(self) -> int:
        """Width of the delta rule's q (= k) projection: key heads x key width."""
        return (self.kda_key_heads or self.kda_heads) * (self.kda_key_dim or self.kda_head_dim)

    @property
    def shared_width(self) -> int:
        """Width of the fused shared-expert MLP (0: none)."""
        return self.shared_ffn_hidden or self.num_shared_experts * self.moe_ffn_hidden

    @property
    def expert_fc1(self) -> int:
        """FC1 outputs per unit of expert width (routed and shared): 2 for GLU (gate and up), 1 for squared ReLU;
        an expert has ``expert_fc1 + 1`` matrices."""
        return 2 if self.gated_experts else 1

    @property
    def mamba_inner(self) -> int:
        """Mamba inner (expanded) width: ``mamba_inner_dim``, else ``mamba_expand * hidden``."""
        return self.mamba_inner_dim or self.mamba_expand * self.hidden

    @property
    def mamba2_in_proj(self) -> int:
        """Mamba-2 in-projection width: z and x (``mamba_inner`` each), B and C (groups x state each), dt (heads)."""
        return 2 * self.mamba_inner + 2 * self.mamba_groups * self.mamba_d_state + self.mamba_heads

    @property
    def mamba_rank(self) -> int:
        """Mamba time-step rank (``ceil(hidden / 16)`` when ``mamba_dt_rank`` is 0, as HF's "auto")."""
        return self.mamba_dt_rank or -(-self.hidden // 16)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dhead(self) -> int:
        return self.head_dim or self.hidden // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def max_maxvio(self, ep: int) -> float:
        """The largest routing skew (busiest EP rank / mean - 1) at EP ``ep``: a token sends one copy to each of
        its ``top_k`` experts, at most ``min(top_k, E / EP)`` of them on one rank, so that rank holds at most
        ``EP min(k, E/EP) / k`` x the mean."""
        return ep * min(self.top_k, self.num_experts // ep) / self.top_k - 1

    def _check_mtp(self) -> None:
        if self.mtp_layers < 0:
            raise ValueError(f"ModelSpec.mtp_layers must be >= 0, got {self.mtp_layers}")
        odd = sorted(set(self.mtp_blocks) - set(MTP_BLOCK_KINDS))
        if odd:
            raise ValueError(f"ModelSpec.mtp_blocks must be letters of {''.join(MTP_BLOCK_KINDS)}, got {odd}")
        sized = {"E": self.is_moe, "-": self.ffn_hidden > 0, "M": bool(self.mamba_layers), "*": True}
        if self.mtp_layers and not all(sized[b] for b in self.mtp_blocks):
            raise ValueError(f"ModelSpec.mtp_blocks {self.mtp_blocks!r} names a block the model has no size for")

    def mtp_kinds(self) -> tuple[tuple[str, str], ...]:
        """``(mixer kind, ffn kind)`` of each layer of one MTP module (``layer_kinds``' kinds)."""
        if not self.mtp_blocks:
            return self.layer_kinds()[-1:]
        return tuple(MTP_BLOCK_KINDS[b] if b != "*" else (self.attention, "none") for b in self.mtp_blocks)

    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        """``(mixer kind, ffn kind)`` per layer, kinds in {mha, mla, kda, mamba, none} x {dense, moe, none}
        (cached)."""
        return _layer_kinds(self)

    def to_dict(self) -> dict:
        d = asdict(self)
        for f in _TUPLE_FIELDS:
            d[f] = list(getattr(self, f))
        return d

    @classmethod
    def from_dict(cls, data: dict) -> ModelSpec:
        """A spec from a JSON object; a missing, unknown or ill-typed field is a ``ValueError`` naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"a ModelSpec JSON holds one object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelSpec field(s) {unknown}")
        missing = sorted(f.name for f in fields(cls) if f.default is MISSING and f.name not in data)
        if missing:
            raise ValueError(f"ModelSpec JSON is missing required field(s) {missing}")
        data = dict(data)
        for f in _TUPLE_FIELDS:
            if not isinstance(data.get(f, ()), (list, tuple)):
                raise ValueError(f"ModelSpec.{f} must be a list of layer indices, got {data[f]!r}")
            data[f] = tuple(data.get(f, ()))
        return cls(**data)


MTP_BLOCK_KINDS = {"M": ("mamba", "none"), "*": ("attention", "none"), "E": ("none", "moe"), "-": ("none", "dense")}
"""``mtp_blocks`` letters and the layer kind each is (``*``: the model's own attention kind)."""
_TUPLE_FIELDS = (
    "kda_layers",
    "sliding_window_layers",
    "moe_layers",
    "mamba_layers",
    "mixer_only_layers",
    "ffn_only_layers",
)
_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str, "tuple[int, ...]": tuple}


def _check_field_types(spec: ModelSpec) -> None:
    """Each field has its annotated type (``bool`` is not an ``int``) and integer sizes are >= 0."""
    for f in fields(spec):
        v, want = getattr(spec, f.name), _TYPES[f.type]
        ok = isinstance(v, want) and (want is bool or not isinstance(v, bool))
        if want is tuple and ok:
            ok = all(isinstance(i, int) and not isinstance(i, bool) for i in v)
        if not ok:
            raise ValueError(f"ModelSpec.{f.name} must be of type {f.type}, got {v!r}")
        if want is int and not 0 <= v <= MAX_SIZE:
            raise ValueError(f"ModelSpec.{f.name} must be in [0, {MAX_SIZE}], got {v!r}")


@lru_cache(maxsize=64)
def _layer_kinds(spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    kda, mamba = set(spec.kda_layers), set(spec.mamba_layers)
    mixer_only, ffn_only = set(spec.mixer_only_layers), set(spec.ffn_only_layers)
    moe = set(spec.moe_layers or range(spec.first_k_dense, spec.num_layers)) if spec.is_moe else set()

    def mixer(i: int) -> str:
        return "none" if i in ffn_only else "kda" if i in kda else "mamba" if i in mamba else spec.attention

    def ffn(i: int) -> str:
        return "none" if i in mixer_only else "moe" if i in moe else "dense"

    return tuple((mixer(i), ffn(i)) for i in range(spec.num_layers))


def blocks(kind: tuple[str, str]) -> int:
    """Blocks a layer of ``kind`` holds: a mixer and an FFN (2), or one of them in a single-block hybrid (1)."""
    return (kind[0] != "none") + (kind[1] != "none")
