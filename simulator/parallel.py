"""``ParallelConfig``: how one training job is split, plus the feasibility rules with readable reasons.

Sizes: TP x CP x PP x DP = GPUs; EP is carved out of the DP x CP ranks (EP divides DP x CP) and expert weights
are additionally split by TP (expert-TP = TP). A step processes ``global_batch_tokens`` tokens in
``micro_batches = global_batch_tokens / seq_len / (DP x micro_batch)`` micro-batches per pipeline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from simulator.hardware import HardwareSpec
from simulator.layers import RECOMPUTE_MODES
from simulator.specs import ModelSpec

SCHEDULES = ("1f1b", "interleaved", "dualpipe")
DISPATCHERS = ("moonep", "classic")
PRECISIONS = ("bf16", "fp8")


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """Parallel sizes, batch and the training recipe knobs that change time or memory."""

    tp: int = 1
    """Tensor parallel size (inside a node), with sequence parallelism when ``sequence_parallel``."""
    pp: int = 1
    """Pipeline stages."""
    ep: int = 1
    """Expert parallel size (divides DP x CP)."""
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
    schedule: str = "1f1b"
    """Pipeline schedule: 1f1b, interleaved (needs vpp > 1) or dualpipe (bidirectional, two weight copies)."""
    dispatcher: str = "moonep"
    """MoE dispatch: moonep (exact balance + replica weight traffic) or classic (busiest rank sets the time)."""
    maxvio: float = 0.0
    """Routing skew: busiest EP rank's load / mean - 1 before balancing."""
    precision: str = "bf16"
    """GEMM precision: bf16 or fp8 (fp8 GEMMs and dispatch; attention/KDA stay bf16)."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism with TP (norm/dropout activations split by TP)."""

    def __post_init__(self):
        for f in ("tp", "pp", "ep", "cp", "dp", "vpp", "micro_batch", "global_batch_tokens", "seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ParallelConfig.{f} must be a positive integer, got {v!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"ParallelConfig.recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ParallelConfig.zero_stage must be 0..3, got {self.zero_stage!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"ParallelConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"ParallelConfig.dispatcher must be one of {DISPATCHERS}, got {self.dispatcher!r}")
        if not self.maxvio >= 0:
            raise ValueError(f"ParallelConfig.maxvio must be >= 0, got {self.maxvio!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"ParallelConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def sequences(self) -> int:
        return self.global_batch_tokens // self.seq_len

    @property
    def micro_batches(self) -> int:
        """Micro-batches per pipeline per step (m)."""
        return self.sequences // (self.dp * self.micro_batch)

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: vpp (interleaved), 2 (dualpipe: one per direction) or 1."""
        return self.vpp if self.schedule == "interleaved" else (2 if self.schedule == "dualpipe" else 1)

    def to_dict(self) -> dict:
        return asdict(self)


def infeasible_reason(spec: ModelSpec, hw: HardwareSpec, par: ParallelConfig, gpus: int) -> str | None:
    """Why ``par`` cannot run ``spec`` on ``gpus`` GPUs of ``hw`` (memory aside), or None when it can."""
    if par.gpus != gpus:
        return f"TP x CP x PP x DP = {par.tp}x{par.cp}x{par.pp}x{par.dp} = {par.gpus} != {gpus} GPUs"
    if (par.dp * par.cp) % par.ep:
        return f"EP {par.ep} does not divide DP x CP = {par.dp * par.cp}"
    if hw.gpus_per_node % par.tp:
        return f"TP {par.tp} does not divide the {hw.gpus_per_node} GPUs of a node (TP stays on NVLink)"
    if spec.num_heads % par.tp:
        return f"{spec.num_heads} attention heads are not divisible by TP {par.tp}"
    if spec.kda_layers and spec.kda_heads % par.tp:
        return f"{spec.kda_heads} KDA heads are not divisible by TP {par.tp}"
    if spec.kv_heads >= par.tp and spec.kv_heads % par.tp:
        return f"{spec.kv_heads} KV heads are not divisible by TP {par.tp}"
    if not spec.is_moe and par.ep > 1:
        return f"EP {par.ep} > 1 on a dense model"
    if spec.is_moe and spec.num_experts % par.ep:
        return f"{spec.num_experts} experts are not divisible by EP {par.ep}"
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
    if spec.num_layers < stages:
        return f"{spec.num_layers} layers cannot fill {stages} pipeline stages"
    if par.schedule == "interleaved" and m % p:
        return f"interleaved schedule needs micro-batches ({m}) divisible by PP ({p})"
    if par.schedule == "dualpipe" and (p % 2 or m < 2 * p or m % 2):
        return f"dualpipe needs an even PP ({p}) and an even number of micro-batches >= 2 x PP (got {m})"
    if par.precision == "fp8" and hw.fp8_tflops <= 0:
        return f"{hw.name} has no FP8 tensor cores"
    return None


def stage_layers(spec: ModelSpec, par: ParallelConfig) -> tuple[tuple[int, ...], ...]:
    """Layer indices of each model chunk, in pipeline order: ``pp * vpp`` contiguous, near-even chunks."""
    return _split(spec.num_layers, par.pp * (par.vpp if par.schedule == "interleaved" else 1))


@lru_cache(maxsize=1024)
def _split(L: int, chunks: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(range(i * L // chunks, (i + 1) * L // chunks)) for i in range(chunks))


def rank_chunks(par: ParallelConfig) -> list[list[int]]:
    """Chunk indices (into ``stage_layers``) each pipeline rank runs: interleaved rank r holds r, r+p, ...;
    dualpipe rank r holds stage r of one direction and stage p-1-r of the other."""
    p = par.pp
    if par.schedule == "interleaved":
        return [[r + j * p for j in range(par.vpp)] for r in range(p)]
    if par.schedule == "dualpipe":
        return [[r, p - 1 - r] for r in range(p)]
    return [[r] for r in range(p)]
