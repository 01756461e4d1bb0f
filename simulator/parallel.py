"""``ParallelConfig``: how one training job is split, and the model chunks each pipeline rank runs (whether the
split fits a model and a GPU, with readable reasons: ``simulator.feasibility``).

Sizes: TP x CP x PP x DP = GPUs; experts fold over a stage's TP x CP x DP ranks as EP x ETP x expert-DP (MoE
parallel folding: EP x ETP divides TP x CP x DP; ETP defaults to TP). A step processes ``global_batch_tokens``
tokens in ``micro_batches = global_batch_tokens / seq_len / (DP x micro_batch)`` micro-batches per pipeline."""

from __future__ import annotations

import math
from dataclasses import asdict, fields
from functools import lru_cache

from simulator.field_checks import frozen_config
from simulator.layers import RECOMPUTE_MODES
from simulator.modelspec import MAX_SIZE, MAX_TOKENS, ModelSpec

SCHEDULES = ("1f1b", "interleaved", "dualpipe")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "mlp_act", "moe", "moe_act", "mla_up_proj", "shared_experts")
"""Megatron ``--recompute-modules`` names priced here (``mlp`` / ``moe``: the whole dense MLP / MoE layer re-run from
its input; ``mlp_act``, not a Megatron name: the dense FFN activation function)."""
DISPATCHERS = ("moonep", "classic", "deepep")
PRECISIONS = ("bf16", "fp8")


@frozen_config
class ParallelConfig:
    """Parallel sizes, batch and the training recipe knobs that change time or memory."""

    tp: int = 1
    """Tensor parallel size (inside a node), with sequence parallelism when ``sequence_parallel``."""
    pp: int = 1
    """Pipeline stages."""
    ep: int = 1
    """Expert parallel size; EP x ETP divides TP x CP x DP (EP may span TP ranks when ETP < TP)."""
    cp: int = 1
    """Context parallel size (a sequence split over CP ranks)."""
    dp: int = 1
    """Data parallel replicas."""
    vpp: int = 1
    """Virtual stages per pipeline rank (``interleaved`` schedule)."""
    micro_batch: int = 1
    """Sequences per micro-batch."""
    global_batch_tokens: int = 4 * 2**20
    """Tokens per optimizer step (all replicas)."""
    seq_len: int = 4096
    """Sequence length s."""
    recompute: str = "none"
    """Activation recomputation: none, selective (core attention), selective+act (also activation
    functions and KDA convolutions), full (whole layer; only layer inputs kept)."""
    zero_stage: int = 1
    """0: replicated Adam; 1: optimizer sharded over DP; 2: + gradients; 3: + weights."""
    grad_reduce: str = "auto"
    """When gradients are reduced over DP: ``step`` (accumulated over the step's micro-batches, reduced once after
    the last backward: Megatron's DDP and distributed optimizer, FSDP inside ``no_sync``, ``torch.distributed.
    pipelining`` stages), ``microbatch`` (after every micro-batch's backward: Megatron-FSDP
    ``optim_grads[_params]``, DeepSpeed ZeRO-2/3, PyTorch FSDP's default, torchtitan's gradient accumulation
    without PP) or ``auto`` (``microbatch`` when ZeRO >= 2 shards the gradients, else ``step``)."""
    overlap_grad_reduce: bool = True
    """DP gradient buckets are reduced while the backward still runs (Megatron ``overlap_grad_reduce``, which
    Megatron-Bridge's recipes set and Megatron-LM's command line leaves off; FSDP always overlaps). Off: after the
    backward, all of it exposed. Only where the hardware's ``Efficiency.dp_overlap`` lets buckets overlap."""
    overlap_param_gather: bool = True
    """The distributed optimizer's (ZeRO >= 1) parameter all-gather runs behind the next step's forward (Megatron
    ``overlap_param_gather``; ZeRO-3's per-pass gathers behind each pass). Off: before it, all of it exposed."""
    schedule: str = "1f1b"
    """Pipeline schedule: 1f1b, interleaved (needs vpp > 1) or dualpipe (bidirectional, two weight copies)."""
    dispatcher: str = "moonep"
    """MoE dispatch: moonep (exact balance + replica weight traffic), classic (all-to-all; busiest rank sets the
    time) or deepep (classic, but a token crosses to another node once per destination node, as DeepEP/HybridEP
    and Megatron's flex dispatcher send it)."""
    maxvio: float = 0.0
    """Routing skew: busiest EP rank's load / mean - 1 before balancing."""
    precision: str = "bf16"
    """GEMM precision: bf16 or fp8 (fp8 GEMMs and dispatch; attention/KDA stay bf16)."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism with TP (norm/dropout activations split by TP)."""
    etp: int = 0
    """Expert tensor parallel size (Megatron ``--expert-tensor-parallel-size``); 0 means equal to ``tp``. EP x ETP
    must divide the expert-side world of a stage, TP x CP x DP (MoE parallel folding)."""
    recompute_modules: tuple[str, ...] = ()
    """Extra modules recomputed in the backward (Megatron ``--recompute-modules`` names, see
    ``RECOMPUTE_MODULES``); ignored by ``full``."""
    activation_dtype: str = "auto"
    """Saved GEMM-input activations: bf16, fp8 (1 byte, as TE keeps them in fp8 runs) or auto (fp8 in fp8 runs)."""
    offload_fraction: float = 0.0
    """Fraction of each layer's saved activations moved to host memory between forward and backward (PCIe)."""
    pp_first_layers: int | None = None
    """Transformer layers of the first model chunk (None: even split; 0: the embedding alone, Megatron's
    ``account_for_embedding_in_pipeline_split``); with vpp = 1 Megatron's ``--decoder-first-pipeline-num-layers``."""
    pp_last_layers: int | None = None
    """Transformer layers of the last model chunk (None: even split; 0: the LM head and loss alone, Megatron's
    ``account_for_loss_in_pipeline_split``); with vpp = 1 ``--decoder-last-pipeline-num-layers``."""
    microbatch_group: int = 0
    """Contiguous micro-batches N per virtual stage of the interleaved schedule (Megatron
    ``--microbatch-group-size-per-virtual-pipeline-stage``), in [PP, micro-batches]; 0 means PP (the default)."""
    capacity_factor: float = 0.0
    """Token-dropping MoE: each expert takes at most ``capacity_factor`` x its mean tokens (Megatron
    ``--moe-expert-capacity-factor``); 0 means dropless."""
    pad_to_capacity: bool = False
    """Pad every expert's input to its capacity (``--moe-pad-expert-input-to-capacity``); needs a capacity factor."""
    moment_dtype: str = "fp32"
    """Adam moments m and v (``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``): fp32 or bf16."""
    main_grads_dtype: str = "fp32"
    """Main gradient buffer (``--main-grads-dtype``): fp32 or bf16."""
    attn_res_impl: str = "moonep"
    """What a Block AttnRes mix keeps for the backward: ``moonep`` (k3.attnres: sources by reference) or
    ``release`` (the released ``_apply_attn_res``: fp32 stacks of the sources); models without AttnRes ignore it."""
    moe_probs: str = "swiglu"
    """Where the MoE routing probability multiplies an expert's path: ``swiglu`` (inside the activation, Megatron's
    ``weighted_bias_swiglu``, moonep's K3: the expert output is not kept) or ``combine`` (at the weighted
    un-permutation: each routed copy's output [K, H] is kept)."""
    activation_fp8_input_store: bool = False
    """SwiGLU inputs (dense FFN, routed and shared experts) kept as fp8 e4m3 for the backward (Megatron
    ``activation_func_fp8_input_store``, DeepSeek-V3 section 3.3.2), cast there and back by unfused ops."""
    attn_out_cache: str = "bf16"
    """The attention-output projection's input, which flash attention also keeps as its ``o``: ``bf16`` (one bf16
    copy, plus TE's fp8 copy in fp8 runs), ``e5m6`` (DeepSeek-V3 section 3.3.2: one 12-bit copy for both
    backwards) or ``fp8`` (one 1-byte copy)."""
    moe_a2a_overlap: bool = False
    """Overlap EP dispatch/combine of one micro-batch with another's compute in 1F1B/interleaved steady state
    (Megatron ``--overlap-moe-expert-parallel-comm``; DualPipe overlaps by construction)."""
    shared_expert_overlap: bool = False
    """The shared experts run on a side stream beside the dispatch / combine all-to-all (Megatron
    ``moe_shared_expert_overlap``): up to their GEMM time of each pass's EP is hidden. No effect without shared
    experts or under DualPipe, as in Megatron; refused with ``moe_a2a_overlap`` and the ``moonep`` dispatcher."""
    ep_comm_sms: int = 20
    """SMs the EP dispatch/combine kernels hold while they run (Megatron's ``moe_deepep_num_sms`` default 20; the
    GB200/GB300 MXFP8 recipes give HybridEP 32): with ``moe_a2a_overlap`` the compute paired with them runs on
    the other SMs."""
    fused_expert_mlp: bool = False
    """Experts as TE op-fuser grouped ops (Megatron ``use_transformer_engine_op_fuser``): biases, clamp and router
    probabilities stay in the kernels. Off: Megatron's eager path (``simulator.layers.eager_expert_bytes``)."""
    fp8_attention: bool = False
    """Core attention in FP8 (TE ``fp8_dot_product_attention``; ``simulator.attention_model.FP8_SPEEDUP``)."""
    cuda_graph: str = "none"
    """CUDA graphs: ``none``; ``modules`` (Megatron ``cuda_graph_impl = transformer_engine`` with the ``attn`` /
    ``moe_router`` / ``moe_preprocess`` scopes: those launches become one graph each, the dropless host sync
    stays: ``Efficiency.moe_layer_fixed_s`` becomes ``moe_layer_module_graph_s``); or ``full`` (``cuda_graph_impl
    = full_iteration``: one graph per step, which needs a sync-free MoE dispatch with static buffers: neither the
    sync nor the launches stay, ``moe_layer_graphed_s``)."""

    def __post_init__(self):
        for f in ("tp", "pp", "ep", "cp", "dp", "vpp", "micro_batch", "global_batch_tokens", "seq_len"):
            v, top = getattr(self, f), MAX_TOKENS if f == "global_batch_tokens" else MAX_SIZE
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
                raise ValueError(f"ParallelConfig.{f} must be an integer in [1, {top}], got {v!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ParallelConfig.zero_stage must be 0..3, got {self.zero_stage!r}")
        if not (isinstance(self.maxvio, (int, float)) and math.isfinite(self.maxvio) and self.maxvio >= 0):
            raise ValueError(f"ParallelConfig.maxvio must be a finite number >= 0, got {self.maxvio!r}")
        self._check_recipe()

    def _check_recipe(self) -> None:
        for name in _SWITCHES:  # a string such as "no" would read as on
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ParallelConfig.{name} must be True or False, got {getattr(self, name)!r}")
        for f in ("etp", "pp_first_layers", "pp_last_layers", "microbatch_group", "ep_comm_sms"):
            v = getattr(self, f)
            if v is None and f.startswith("pp_"):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_SIZE:
                raise ValueError(f"ParallelConfig.{f} must be an integer in [0, {MAX_SIZE}], got {v!r}")
        cf = self.capacity_factor
        if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not math.isfinite(cf) or cf < 0:
            raise ValueError(f"ParallelConfig.capacity_factor (--moe-capacity-factor) must be finite, >= 0: {cf!r}")
        if self.pad_to_capacity and not cf:
            raise ValueError(
                "ParallelConfig.pad_to_capacity (--moe-pad-expert-input-to-capacity) needs --moe-capacity-factor > 0"
            )
        bad = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if not isinstance(self.recompute_modules, tuple) or bad:
            raise ValueError(
                f"ParallelConfig.recompute_modules: unknown {bad or self.recompute_modules!r}; "
                f"known: {', '.join(RECOMPUTE_MODULES)}"
            )
        for f, allowed in (
            ("recompute", RECOMPUTE_MODES),
            ("schedule", SCHEDULES),
            ("dispatcher", DISPATCHERS),
            ("precision", PRECISIONS),
            ("activation_dtype", ("auto", "bf16", "fp8")),
            ("moment_dtype", ("fp32", "bf16")),
            ("main_grads_dtype", ("fp32", "bf16")),
            ("grad_reduce", ("auto", "step", "microbatch")),
            ("attn_res_impl", ("moonep", "release")),
            ("moe_probs", ("swiglu", "combine")),
            ("attn_out_cache", ("bf16", "e5m6", "fp8")),
            ("cuda_graph", ("none", "modules", "full")),
        ):
            if getattr(self, f) not in allowed:
                raise ValueError(f"ParallelConfig.{f} must be one of {allowed}, got {getattr(self, f)!r}")
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise ValueError(f"ParallelConfig.offload_fraction must be in [0, 1], got {self.offload_fraction!r}")
        clash = {  # Megatron's TransformerConfig refuses the first two; moonep has no shared-expert stream
            "moe_a2a_overlap": self.moe_a2a_overlap,
            "recompute module shared_experts": "shared_experts" in self.recompute_modules,
            "the moonep dispatcher (classic or deepep run it)": self.dispatcher == "moonep",
        }
        bad = next((name for name, on in clash.items() if on), None)
        if self.shared_expert_overlap and bad:
            raise ValueError(f"ParallelConfig.shared_expert_overlap cannot run with {bad}")
        if self.cuda_graph == "modules" and (self.recompute == "full" or "moe" in self.recompute_modules):
            what = "full recompute" if self.recompute == "full" else "recompute module moe"  # Megatron refuses both
            raise ValueError(f"ParallelConfig.cuda_graph modules (the MoE router graphed) cannot run with {what}")

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        """Expert tensor parallel size (``etp``, or ``tp`` when 0)."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: TP x CP x DP / (EP x ETP) ranks hold the same expert shard."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    @property
    def reduces_every_microbatch(self) -> bool:
        """Gradients reduced after every micro-batch's backward (``grad_reduce``), not once per step."""
        if self.grad_reduce == "auto":
            return self.zero_stage >= 2
        return self.grad_reduce == "microbatch"

    @property
    def grad_bytes(self) -> float:
        """Bytes per element of the main gradient buffer (``main_grads_dtype``)."""
        return 4.0 if self.main_grads_dtype == "fp32" else 2.0

    @property
    def fp8_activations(self) -> bool:
        """GEMM inputs saved in fp8."""
        return self.activation_dtype == "fp8" or (self.activation_dtype == "auto" and self.precision == "fp8")

    def recomputes(self, module: str) -> bool:
        """Whether ``module`` (a ``RECOMPUTE_MODULES`` name) is recomputed (``selective`` implies core_attn,
        ``selective+act`` also the activation functions)."""
        implied = {"selective": ("core_attn",), "selective+act": ("core_attn", "mlp_act", "moe_act")}
        return module in self.recompute_modules or module in implied.get(self.recompute, ())

    @property
    def sequences(self) -> int:
        return self.global_batch_tokens // self.seq_len

    @property
    def micro_batches(self) -> int:
        """Micro-batches per pipeline per step (m)."""
        return self.sequences // (self.dp * self.micro_batch)

    @property
    def group_size(self) -> int:
        """Contiguous micro-batches N per virtual stage (``microbatch_group``, or PP when 0)."""
        return self.microbatch_group or self.pp

    def warmup_passes(self, rank: int) -> int:
        """Forward chunk passes pipeline rank ``rank`` runs before its first backward (Megatron ``schedules.py``):
        interleaved ``(p - r - 1) 2 + (v - 1) N``, 1F1B ``p - r - 1``, both capped at the rank's passes. EP A2A
        overlap (Megatron's combined 1F1B) runs one forward more, so that each steady-state step pairs a forward
        and a backward of different micro-batches: at PP 1 the first forward runs alone."""
        m, p, v = self.micro_batches, self.pp, self.vpp
        ahead = int(self.moe_a2a_overlap and self.schedule != "dualpipe")
        if self.schedule == "interleaved":
            return min(m * v, (p - rank - 1) * 2 + (v - 1) * self.group_size + ahead)
        return min(m, p - rank - 1 + ahead)

    def moe_load(self, skew: float = 1.0) -> tuple[float, float]:
        """(mean, busiest) rows per expert over the balanced dropless mean, the busiest expert at ``skew`` x the
        mean: dropless ``(1, skew)``; capacity factor c ``(min(1, c), min(skew, c))``; padded to it ``(c, c)``."""
        c = self.capacity_factor
        if not c:
            return 1.0, skew
        if self.pad_to_capacity:
            return c, c
        return min(1.0, c), min(skew, c)

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: vpp (interleaved), 2 (dualpipe: one per direction) or 1."""
        return self.vpp if self.schedule == "interleaved" else (2 if self.schedule == "dualpipe" else 1)

    def to_dict(self) -> dict:
        return asdict(self)


def stage_layers(spec: ModelSpec, par: ParallelConfig) -> tuple[tuple[int, ...], ...]:
    """Layer indices of each model chunk, in pipeline order: ``pp * vpp`` contiguous chunks, the first and last
    holding ``pp_first_layers`` / ``pp_last_layers`` when set (0: an embedding-only / head-only chunk) and the
    rest split near-evenly."""
    stages = par.pp * (par.vpp if par.schedule == "interleaved" else 1)
    return _split(spec.num_layers, stages, par.pp_first_layers, par.pp_last_layers)


@lru_cache(maxsize=1024)
def _split(L: int, chunks: int, first: int | None = None, last: int | None = None) -> tuple[tuple[int, ...], ...]:
    if first is None and last is None:
        return tuple(tuple(range(i * L // chunks, (i + 1) * L // chunks)) for i in range(chunks))
    mid_chunks = chunks - (first is not None) - (last is not None)
    mid = L - (first or 0) - (last or 0)
    sizes = [first] * (first is not None)
    sizes += [(i + 1) * mid // mid_chunks - i * mid // mid_chunks for i in range(mid_chunks)]
    sizes += [last] * (last is not None)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(tuple(range(a, a + n)) for a, n in zip(starts, sizes))


def rank_chunks(par: ParallelConfig) -> list[list[int]]:
    """Chunk indices (into ``stage_layers``) each pipeline rank runs: interleaved rank r holds r, r+p, ...;
    dualpipe rank r holds stage r of one direction and stage p-1-r of the other."""
    p = par.pp
    if par.schedule == "interleaved":
        return [[r + j * p for j in range(par.vpp)] for r in range(p)]
    if par.schedule == "dualpipe":
        return [[r, p - 1 - r] for r in range(p)]
    return [[r] for r in range(p)]


_SWITCHES = tuple(f.name for f in fields(ParallelConfig) if isinstance(f.default, bool))
"""The on/off ``ParallelConfig`` fields."""
