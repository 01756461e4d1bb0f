"""Whether a ``ParallelConfig`` can run a model on a GPU, memory aside: the first rule it breaks, as a sentence
(sizes that do not factor, heads or experts a split does not divide, a schedule or overlap the layout cannot run,
as Megatron's own checks refuse them), or None."""

from __future__ import annotations

from simulator.hardware import HardwareSpec
from simulator.modelspec import ModelSpec
from simulator.parallel import ParallelConfig


def infeasible_reason(spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig, gpus: int) -> str | None:
    """Why ``par`` cannot run ``spec`` on ``gpus`` GPUs of ``hw`` (memory aside), or None when it can."""
    if par.gpus != gpus:
        return f"TP x CP x PP x DP = {par.tp}x{par.cp}x{par.pp}x{par.dp} = {par.gpus} != {gpus} GPUs"
    if par.expert_tp > 1 and spec.is_moe and spec.moe_ffn_hidden % par.expert_tp:
        return f"expert width {spec.moe_ffn_hidden} is not divisible by ETP {par.expert_tp}"
    world = par.tp * par.cp * par.dp
    if world % (par.ep * par.expert_tp):
        return (
            f"EP {par.ep} x ETP {par.expert_tp} = {par.ep * par.expert_tp} does not divide the expert-side world "
            f"TP x CP x DP = {par.tp}x{par.cp}x{par.dp} = {world}"
        )
    if par.expert_tp > par.tp and par.ep * par.expert_tp > par.tp and (par.ep * par.expert_tp) % par.tp:
        return f"EP x ETP = {par.ep * par.expert_tp} must be a multiple of TP {par.tp} when ETP > TP"
    if hw.gpus_per_node % par.tp:
        return f"TP {par.tp} does not divide the {hw.gpus_per_node} GPUs of a node (TP stays on NVLink)"
    if spec.num_heads % par.tp:
        return f"{spec.num_heads} attention heads are not divisible by TP {par.tp}"
    qk = spec.kda_key_heads or spec.kda_heads
    if spec.kda_layers and (spec.kda_heads % par.tp or qk % par.tp):
        return f"{spec.kda_heads} KDA heads ({qk} q/k) are not divisible by TP {par.tp}"
    if spec.mamba_layers and spec.mamba_heads % par.tp:
        return f"{spec.mamba_heads} Mamba-2 heads are not divisible by TP {par.tp}"
    if spec.kv_heads >= par.tp and spec.kv_heads % par.tp:
        return f"{spec.kv_heads} KV heads are not divisible by TP {par.tp}"
    if not spec.is_moe and par.ep > 1:
        return f"EP {par.ep} > 1 on a dense model"
    if par.activation_fp8_input_store and (not spec.gated_ffn or not spec.gated_experts or spec.glu_clamp):
        why = "clamped" if spec.glu_clamp else "not gated"
        return f"--activation-fp8-input-store needs SwiGLU FFNs, as Megatron's does; {spec.name}'s are {why}"
    if spec.is_moe and spec.num_experts % par.ep:
        return f"{spec.num_experts} experts are not divisible by EP {par.ep}"
    if spec.is_moe and par.ep > 1 and par.maxvio > (most := spec.max_maxvio(par.ep)):  # --maxvio 100 at EP 8 was priced
        return f"maxvio {par.maxvio:g} > {most:g}, the most routing can make at EP {par.ep}"
    if par.global_batch_tokens % par.seq_len:
        return f"global batch {par.global_batch_tokens} tokens is not a whole number of {par.seq_len}-token sequences"
    if par.sequences % (par.dp * par.micro_batch):
        return f"{par.sequences} sequences do not split into DP {par.dp} x micro-batch {par.micro_batch}"
    if par.seq_len % par.cp:
        return f"sequence length {par.seq_len} is not divisible by CP {par.cp}"
    if par.schedule == "interleaved" and par.vpp < 2:
        return "the interleaved schedule needs vpp >= 2"
    if par.schedule != "interleaved" and par.vpp != 1:
        return f"vpp {par.vpp} > 1 needs the interleaved schedule"
    return _pipeline_reason(spec, hw, par)


def _pipeline_reason(spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig) -> str | None:
    m, p = par.micro_batches, par.pp
    stages = p * (par.vpp if par.schedule == "interleaved" else 1)
    reason = _split_reason(spec.num_layers, stages, par.pp_first_layers, par.pp_last_layers)
    if reason:
        return reason
    if par.schedule == "interleaved" and not p <= par.group_size <= m:
        return (
            f"interleaved schedule needs the contiguous micro-batches N ({par.group_size}) in [PP {p}, "
            f"micro-batches {m}] (--microbatch-group)"
        )
    if par.schedule == "interleaved" and 0 < m % par.group_size < p:
        return (
            f"interleaved schedule: the last group of {m % par.group_size} micro-batches (micro-batches {m} mod N "
            f"{par.group_size}) is shorter than PP {p}; pick N dividing {m} or leaving >= {p}"
        )
    if par.microbatch_group and par.schedule != "interleaved":
        return f"--microbatch-group {par.microbatch_group} needs the interleaved schedule"
    if par.schedule == "dualpipe" and (p % 2 or m < 2 * p or m % 2):
        return f"dualpipe needs an even PP ({p}) and an even number of micro-batches >= 2 x PP (got {m})"
    reason = _a2a_overlap_reason(spec, hw, par)
    if reason:
        return reason
    if (par.precision == "fp8" or par.fp8_attention) and hw.fp8_tflops <= 0:
        return f"{hw.name} has no FP8 tensor cores" + (" (--fp8-attention)" if par.fp8_attention else "")
    return None


def _a2a_overlap_reason(spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig) -> str | None:
    """Megatron's checks on ``--overlap-moe-expert-parallel-comm`` (``TransformerConfig.__post_init__``): its
    combined 1F1B exists for PP 1 and the interleaved schedule only, needs EP, and splits layers into nodes that
    full recompute would fuse back."""
    if not par.moe_a2a_overlap or par.schedule == "dualpipe":
        return None
    if not spec.is_moe or par.ep < 2:
        return "EP A2A overlap (--moe-a2a-overlap) needs an MoE model with EP > 1"
    if par.pp > 1 and par.schedule != "interleaved":
        return f"EP A2A overlap (--moe-a2a-overlap) needs PP 1 or the interleaved schedule (PP {par.pp}, 1F1B)"
    if par.recompute == "full":
        return "EP A2A overlap (--moe-a2a-overlap) cannot run with full recompute"
    if hw.sms and not 0 <= par.ep_comm_sms < hw.sms:
        return f"EP communication SMs {par.ep_comm_sms} must be in [0, {hw.sms}) ({hw.name} SMs)"
    return None


def _split_reason(L: int, chunks: int, first: int | None, last: int | None) -> str | None:
    """Why ``L`` layers cannot be cut into ``chunks`` chunks with these end sizes (every middle chunk needs a
    layer; an end chunk set to 0 holds only the embedding or the LM head)."""
    if first is None and last is None:
        return f"{L} layers cannot fill {chunks} pipeline stages" if chunks > L else None
    mids = chunks - (first is not None) - (last is not None)
    rest = L - (first or 0) - (last or 0)
    if mids < 0 or rest < mids or (mids == 0 and rest) or (mids and rest < 1):
        return (
            f"pp_first_layers {first} + pp_last_layers {last} leave {rest} of {L} layers for {max(mids, 0)} "
            f"other model chunks ({chunks} in all)"
        )
    return None
