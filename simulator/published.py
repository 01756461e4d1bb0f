"""Published training throughput the simulator is validated on: MoE and dense runs, every row cited.

Nothing here is fitted: the rows are held out, and ``tests/simulator/test_published.py`` checks the simulator
against them. Every number is copied from its source, never derived (tokens/s/GPU as published; for the papers,
which give iteration times, ``tokens_per_s_per_gpu = global batch x sequence / iteration time / GPUs`` is the
one derived column and says so).

**Which rows (a rule, applied before any prediction was looked at).** From NVIDIA's Megatron-Bridge
performance summaries (``CURRENT``: 26.08; ``ARCHIVE``: 26.06.01 back to 25.09), the newest pre-training row for
each (model, system, precision) whose model is a simulator preset and whose system is a preset (DGX-H100,
DGX-B200, DGX-GB200); one row per (model, system, precision), because an older row of the same triple ran older
software and is superseded, not independent. Two rows are added by name: the 26.02 Qwen3-30B-A3B H100 row
(issue 18's open row, a documented expected miss, see ``validation.KNOWN_MISSES``) and the DeepSeek-V3 25.09 H100
dropless row (the only DeepSeek-V3 H100 row in any table). Dense rows also come from two papers that give
iteration times across data-parallel sizes at a fixed batch per replica: Nemotron-4 15B (arXiv 2402.16819,
Table 2: TP 8, DP 96 / 192 / 288, batch 384 / 768 / 1152 sequences of 4096, iteration 0.57 / 0.58 / 0.64 s, MFU
34.3 / 33.3 / 30.5 %).

**Recipe settings the tables do not give** are read from the recipe files of Megatron-Bridge as they stood when the
row's release section was added (``src/megatron/bridge/perf_recipes/<family>/<system>/*.py`` from 26.08,
``scripts/performance/configs/<family>/`` before; the release branch where ``main`` had already moved) and stated
per row: the dispatcher (``flex`` with HybridEP/DeepEP -> ``deepep``, ``alltoall`` -> ``classic``),
``overlap_moe_expert_parallel_comm`` / ``moe_a2a_overlap`` (``a2a``), ``moe_shared_expert_overlap`` (``shared``),
the recompute modules (``recompute_granularity = None`` -> ``none``; Megatron's default selective recompute is core
attention), FSDP (the table's FSDP column), activation offloading (``cpu_offloading_num_layers``), the gradient
buffer dtype (``grad_reduce_in_fp32``), the multi-token-prediction module (``mtp_num_layers``), the layers of
the first and last pipeline chunk (``layout=first+last``, from ``pipeline_model_parallel_layout`` or
``account_for_embedding/loss_in_pipeline_split``), full-iteration CUDA graphs (``graph=full``) or TE per-module
graphs with the MoE router and preprocessing in scope (``graph=modules``), FP8 attention (``fp8attn=1``), TE's
op-fuser for the experts (``use_transformer_engine_op_fuser``, ``fuser=1``: every full-iteration recipe sets it)
and the SMs HybridEP holds (``sms=32``). MoE runs are dropless with forced-balanced routing (the tables'
footnote), so ``maxvio = 0``; ETP is 1.
"""

from __future__ import annotations

from dataclasses import dataclass

ARCHIVE = "https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html"
CURRENT = "https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary.html"
NEMOTRON4_15B = "Parmar et al. 2024, Nemotron-4 15B Technical Report, arXiv 2402.16819, Table 2"


@dataclass(frozen=True)
class Published:
    """One published run: the recipe as its source gives it and its measured throughput."""

    model: str
    """Simulator preset of the model."""
    system: str
    """Simulator hardware preset (DGX-H100 -> h100, DGX-B200 -> b200, DGX-GB200 -> gb200)."""
    gpus: int
    """GPUs of the run."""
    precision: str
    """Source precision, mapped: BF16 -> bf16; FP8 / FP8-CS / FP8-MX / MXFP8 -> fp8."""
    gbs: int
    """Global batch size, sequences."""
    mbs: int
    """Micro-batch size, sequences."""
    seq: int
    """Sequence length."""
    tp: int
    """Tensor parallel size."""
    pp: int
    """Pipeline parallel size."""
    cp: int
    """Context parallel size."""
    vp: int
    """Virtual pipeline size (1 where the table says n/a)."""
    ep: int
    """Expert parallel size (1 for dense models)."""
    tokens_per_s_per_gpu: float
    """Published throughput (papers: derived from the iteration time, see the module doc)."""
    tflops_per_gpu: float
    """Published model TFLOP/s/GPU (0 where the source gives MFU only)."""
    source: str
    """URL or paper and the table (release section, system or model table)."""
    fsdp: bool = False
    """Megatron FSDP (the table's FSDP column): ZeRO-3 here."""
    dispatcher: str = "classic"
    """``deepep`` for Megatron's flex dispatcher (HybridEP / DeepEP), else ``classic`` all-to-all."""
    moe_a2a_overlap: bool = False
    """The recipe overlaps the EP all-to-all with another micro-batch's compute."""
    shared_expert_overlap: bool = False
    """The recipe runs the shared experts beside the all-to-all (``moe_shared_expert_overlap``, ``shared``)."""
    recompute: str = "selective"
    """``none`` where the recipe sets ``recompute_granularity = None``, else Megatron's selective default."""
    recompute_modules: tuple[str, ...] = ()
    """The recipe's ``recompute_modules``."""
    main_grads_dtype: str = "bf16"
    """Gradient buffer dtype: the performance recipes' ``_benchmark_common`` sets ``grad_reduce_in_fp32 = False``
    (Kimi K2's recipe sets it back to True; the papers' runs are taken as fp32)."""
    offload_fraction: float = 0.0
    """Share of the layers whose activations the recipe offloads to the host (``cpu_offloading_num_layers`` over
    the layers)."""
    pp_layout: tuple[int, int] | None = None
    """Transformer layers of the first and of the last model chunk where the recipe's
    ``pipeline_model_parallel_layout`` sets them (DeepSeek-V3's recipes: ``Et*4|(t*4|)*14tmL`` is 4 and 1, the last
    chunk holding the MTP module and the loss); None: the even split."""
    mtp: bool = False
    """The run trains DeepSeek-V3's multi-token-prediction module: the table says "w/ MTP", or the recipe sets
    ``mtp_num_layers = 1`` (every DeepSeek-V3 recipe but the 25.11 BF16 command-line runs, "w/o MTP"). The tables'
    own model TFLOP/s agree: about 260 GFLOP per token with the module, 249 without."""
    cuda_graph: str = "none"
    """``full`` where the recipe sets ``cuda_graph_impl = "full_iteration"`` (with the paged-stash sync-free MoE
    dispatch); ``modules`` where it sets ``cuda_graph_impl = "transformer_engine"`` with the MoE router and
    preprocessing in ``cuda_graph_scope`` (see ``ParallelConfig.cuda_graph``)."""
    fp8_attention: bool = False
    """The recipe sets ``fp8_dot_product_attention``."""
    fused_expert_mlp: bool = False
    """The recipe sets ``use_transformer_engine_op_fuser`` (``fuser=1``): the experts run as fused grouped ops."""
    ep_comm_sms: int = 20
    """SMs the recipe gives the EP dispatcher (``sms``): Megatron's ``moe_deepep_num_sms`` default 20 (the NCCL
    all-to-all is taken as the same), 32 where the full-iteration MXFP8 recipes set ``moe_hybridep_num_sms``."""
    recipe: str = ""
    """The recipe function the settings were read from."""
    note: str = ""
    """Anything a reader should know about this row."""
    release: str = ""
    """The table section (Megatron-Bridge release) or paper the row comes from."""

    @property
    def is_moe(self) -> bool:
        return self.ep > 1 or self.model in MOE_MODELS


MOE_MODELS = ("deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "kimi-k2")

# Columns: model | system | GPUs | precision | GBS | MBS | seq | TP | PP | CP | VP | EP | tok/s/GPU | TFLOP/s |
# source (section) | recipe settings (key=value, comma separated, ``note=`` last; see Published)
# fmt: off
_TABLE = """
qwen3-30b-a3b   | h100  |   16 | fp8  | 1024 | 1 | 4096 | 1 | 1 | 1 | 1  | 16 |  8826 |  203 | C 26.06 | dispatcher=deepep,recompute=none,recipe=qwen3_30b_a3b_pretrain_16gpu_h100_fp8cs_config
qwen3-30b-a3b   | h100  |   16 | fp8  | 1024 | 1 | 4096 | 1 | 2 | 1 | 12 |  8 |  5113 |  118 | A 26.02 | dispatcher=deepep,a2a=1,recompute=none,note=issue 18's row: the PP 2 x VP 12 recipe of the 26.02 container
qwen3-235b-a22b | h100  |  256 | fp8  | 8192 | 1 | 4096 | 2 | 8 | 1 | 4  | 32 |  1712 |  253 | A 26.04.01 | layout=2+2,a2a=1,recompute=none,recipe=qwen3_235b_a22b_pretrain_256gpu_h100_fp8cs_config
gpt-oss-120b    | h100  |   64 | bf16 | 1280 | 1 | 4096 | 1 | 4 | 1 | 1  |  8 |  5824 |  158 | A 26.04.01 | modules=layernorm+moe_act,recipe=gpt_oss_120b_pretrain_64gpu_h100_bf16_config
deepseek-v3     | h100  | 1024 | fp8  | 8192 | 1 | 4096 | 2 | 8 | 1 | 4  | 64 |  1297 |  338 | A 25.09 | mtp=1,layout=1+0,a2a=1,dispatcher=deepep,modules=mla_up_proj,note=the 25.09 table has no precision column; its footnote gives the H100 FP8 block scaling
deepseek-v3     | b200  |  256 | fp8  | 4096 | 1 | 4096 | 1 | 8 | 1 | 2  | 32 |  3328 |  864 | A 26.04.01 | mtp=1,layout=4+1,graph=modules,dispatcher=deepep,a2a=1,modules=mla_up_proj+mlp,recipe=deepseek_v3_pretrain_256gpu_b200_fp8mx_config
gpt-oss-120b    | b200  |   64 | bf16 | 1280 | 4 | 4096 | 1 | 1 | 1 | 1  |  8 | 13568 |  369 | A 26.04.01 | modules=layernorm+moe_act,recipe=gpt_oss_120b_pretrain_64gpu_b200_bf16_config
qwen3-235b-a22b | b200  |  256 | fp8  | 8192 | 1 | 4096 | 1 | 8 | 1 | 1  |  8 |  3776 |  560 | A 26.04.01 | layout=11+11,recompute=none,recipe=qwen3_235b_a22b_pretrain_256gpu_b200_fp8cs_config
qwen3-30b-a3b   | b200  |    8 | fp8  |  512 | 4 | 4096 | 1 | 1 | 1 | 1  |  8 | 27136 |  619 | A 26.04.01 | graph=modules,dispatcher=deepep,recompute=none,recipe=qwen3_30b_a3b_pretrain_8gpu_b200_fp8mx_config
deepseek-v3     | gb200 |  256 | fp8  | 4096 | 1 | 4096 | 1 | 4 | 1 | 4  | 64 |  4912 | 1276 | C 26.08 | mtp=1,layout=4+1,a2a=1,graph=full,fuser=1,sms=32,dispatcher=deepep,modules=mla_up_proj,recipe=deepseek_v3_pretrain_256gpu_gb200_fp8mx_config
deepseek-v3     | gb200 |  256 | bf16 | 4096 | 1 | 4096 | 1 | 4 | 1 | 4  | 64 |  3139 |  782 | A 25.11 | layout=4+1,graph=modules,dispatcher=deepep,modules=mla_up_proj,recipe=deepseek_v3_pretrain_256gpu_gb200_bf16_config,note=DeepSeekV3 (w/o MTP)
gpt-oss-120b    | gb200 |   64 | fp8  | 1280 | 4 | 4096 | 1 | 1 | 1 | 1  | 64 | 28672 |  934 | C 26.08 | dispatcher=deepep,a2a=1,graph=full,fuser=1,sms=32,fp8attn=1,recompute=none,recipe=gpt_oss_120b_pretrain_64gpu_gb200_fp8mx_config
gpt-oss-120b    | gb200 |   64 | bf16 | 1280 | 4 | 4096 | 1 | 1 | 1 | 1  | 64 | 16640 |  452 | A 26.04.01 | a2a=1,modules=layernorm+moe_act,recipe=gpt_oss_120b_pretrain_64gpu_gb200_bf16_config
qwen3-235b-a22b | gb200 |  256 | fp8  | 8192 | 1 | 4096 | 1 | 8 | 1 | 3  | 32 |  7280 | 1077 | C 26.08 | layout=3+3,a2a=1,graph=full,fuser=1,sms=32,fp8attn=1,dispatcher=deepep,recompute=none,recipe=qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config
qwen3-235b-a22b | gb200 |  256 | bf16 | 8192 | 1 | 4096 | 1 | 8 | 1 | 3  | 32 |  4916 |  728 | A 25.11 | layout=3+3,graph=modules,dispatcher=deepep,recompute=none,note=the 25.11 BF16 recipe (VP 3; today's BF16 recipe has other sizes)
qwen3-30b-a3b   | gb200 |    8 | fp8  |  512 | 4 | 4096 | 1 | 1 | 1 | 1  |  8 | 39936 |  923 | C 26.08 | a2a=1,graph=full,fuser=1,sms=32,fp8attn=1,dispatcher=deepep,recompute=none,recipe=qwen3_30b_a3b_pretrain_8gpu_gb200_fp8mx_config
llama3-405b     | h100  | 1024 | fp8  | 1536 | 1 | 8192 | 8 | 8 | 2 | 8  |  1 |   326 |  822 | A 26.06 | layout=1+1
llama3-70b      | h100  |   64 | fp8  |  256 | 1 | 8192 | 4 | 8 | 1 | 5  |  1 |  1664 |  731 | A 26.04.01 |
llama3-8b       | h100  |    8 | fp8  |  128 | 1 | 8192 | 1 | 1 | 1 | 1  |  1 | 14451 |  744 | A 25.11 | fsdp=1
llama3-405b     | b200  |  128 | fp8  |   64 | 1 | 8192 | 4 | 8 | 2 | 8  |  1 |   661 | 1667 | A 25.11 | layout=1+1
llama3-8b       | b200  |    8 | fp8  |  128 | 2 | 8192 | 1 | 1 | 1 | 1  |  1 | 30624 | 1576 | A 25.11 |
llama3-405b     | gb200 |  256 | fp8  | 1536 | 1 | 8192 | 4 | 16 | 1 | 4 |  1 |   843 | 2129 | A 26.06 | layout=1+1
llama3-70b      | gb200 |   64 | fp8  |  256 | 2 | 8192 | 1 | 1 | 1 | 1  |  1 |  4224 | 1892 | A 26.04.01 | fsdp=1,offload=0.5,recipe=llama3_70b_pretrain_64gpu_gb200_fp8cs_config (cpu_offloading_num_layers 40 of 80)
llama3-8b       | gb200 |    8 | fp8  |  128 | 2 | 8192 | 1 | 1 | 1 | 1  |  1 | 31508 | 1622 | A 25.11 |
nemotron4-15b   | h100  |  768 | bf16 |  384 | 1 | 4096 | 8 | 1 | 1 | 1  |  1 |  3593 |    0 | N15 | grads=fp32,note=DP 96, iteration 0.57 s, MFU 34.3%
nemotron4-15b   | h100  | 1536 | bf16 |  768 | 1 | 4096 | 8 | 1 | 1 | 1  |  1 |  3531 |    0 | N15 | grads=fp32,note=DP 192, iteration 0.58 s, MFU 33.3%
nemotron4-15b   | h100  | 2304 | bf16 | 1152 | 1 | 4096 | 8 | 1 | 1 | 1  |  1 |  3200 |    0 | N15 | grads=fp32,note=DP 288, iteration 0.64 s, MFU 30.5%
"""  # noqa: E501 (a table copied row by row from its sources)
# fmt: on
_SECTIONS = {"C": CURRENT, "A": ARCHIVE}
_SYSTEMS = {"h100": "DGX-H100", "b200": "DGX-B200", "gb200": "DGX-GB200", "b300": "DGX-B300", "gb300": "DGX-GB300"}


def _flag(value: str) -> bool:
    return value == "1"


_SETTINGS = {
    "modules": ("recompute_modules", lambda v: tuple(v.split("+"))),
    "a2a": ("moe_a2a_overlap", _flag),
    "shared": ("shared_expert_overlap", _flag),
    "fp8attn": ("fp8_attention", _flag),
    "fuser": ("fused_expert_mlp", _flag),
    "fsdp": ("fsdp", _flag),
    "mtp": ("mtp", _flag),
    "layout": ("pp_layout", lambda v: tuple(int(x) for x in v.split("+"))),
    "grads": ("main_grads_dtype", str),
    "graph": ("cuda_graph", str),
    "sms": ("ep_comm_sms", int),
    "offload": ("offload_fraction", float),
    "dispatcher": ("dispatcher", str),
    "recompute": ("recompute", str),
    "recipe": ("recipe", str),
}
"""Row setting key -> (``Published`` field, parser of its value)."""


def _settings(text: str) -> dict:
    """``key=value`` recipe settings of one row as ``Published`` keyword arguments (``_SETTINGS``)."""
    out: dict = {}
    text, _, note = text.partition("note=")  # the note comes last and may hold commas
    if note:
        out["note"] = note.strip()
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        if key not in _SETTINGS:
            raise ValueError(f"published row: unknown setting {key!r}")
        field, parse = _SETTINGS[key]
        out[field] = parse(value)
    return out


def _source(code: str, model: str, system: str, precision: str) -> tuple[str, str]:
    """(citation, release) of a row's source code: ``N15`` (the Nemotron-4 15B paper) or ``C|A <release>``."""
    if code == "N15":
        return NEMOTRON4_15B, "arXiv 2402.16819"
    section, release = code.split()
    return f"{_SYSTEMS[system]} {model} {precision.upper()}: {_SECTIONS[section]} ({release} NeMo Container)", release


def parse_table(table: str) -> tuple[Published, ...]:
    """Rows of a table in this module's column format (``_TABLE``)."""
    rows = []
    for line in filter(None, (ln.strip() for ln in table.splitlines())):
        cells = [c.strip() for c in line.split("|")]
        model, system, precision, code = cells[0], cells[1], cells[3], cells[14]
        ints = [int(c) for c in (cells[2], *cells[4:12])]
        source, release = _source(code, model, system, precision)
        rows.append(
            Published(
                model,
                system,
                ints[0],
                precision,
                *ints[1:],
                float(cells[12]),
                float(cells[13]),
                source,
                release=release,
                **_settings(cells[15] if len(cells) > 15 else ""),
            )
        )
    return tuple(rows)


ROWS = parse_table(_TABLE)
MOE_ROWS = tuple(r for r in ROWS if r.is_moe)
DENSE_ROWS = tuple(r for r in ROWS if not r.is_moe)
