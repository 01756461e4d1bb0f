"""Published Megatron-Bridge (NVIDIA NeMo) training throughput: the MoE and dense validation rows.

These rows are held out: no constant is fitted to them. The one fitted MoE constant (``moe_copy_ns`` per GPU
type) is fitted on the separate calibration rows of ``simulator.moe_fit`` (the 25.11 tables), and
``tests/simulator/test_moe_fit.py`` checks that the fit never prices a recipe of this module.

Every number below is copied from NVIDIA's published performance summaries of Megatron-Bridge, never derived:
- ``ARCHIVE``: https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html
  (repository file ``docs/performance-summary-archive.md`` of NVIDIA-NeMo/Megatron-Bridge), sections
  "26.02 NeMo Container" (tables per model) and "25.09 NeMo Container" (DGX-H100 table);
- ``CURRENT``: https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary.html
  (``docs/performance-summary.md``), section "25.11 NeMo Container", DGX-H100 table.
The tables give system, GPU count, precision, GBS, MBS, sequence length, FSDP, TP, PP, CP, VP, EP and the
measured tokens/s/GPU and model TFLOP/s/GPU; MoE runs are dropless with forced-balanced routing (their footnote),
hence ``maxvio = 0``. ETP is 1 in every MoE recipe (``BASE_*_CONFIG`` of ``scripts/performance/configs``).

What the tables do not give is set the same way for every row (no per-row tuning): recompute ``selective``
(core attention), the distributed optimizer (ZeRO-1; ZeRO-3 where the table's FSDP column is set), the
interleaved schedule where VP > 1. Three recipe settings are read from the Megatron-Bridge recipe files
(``scripts/performance/configs/{deepseek,qwen}/*_workload_base_configs.py``) because they change the model's
work, not its speed knobs: the flex (HybridEP/DeepEP) dispatcher of the DeepSeek-V3 and Qwen3-30B-A3B recipes
(``deepep`` here), ``moe_a2a_overlap=True`` of the Qwen3-235B-A22B and Qwen3-30B-A3B H100 recipes
(``QWEN3_*_PRETRAIN_CONFIG_H100_FP8_CS_V1`` in ``qwen3_workload_base_configs.py`` at tag v0.3.0, the 26.02
release; the only H100 Qwen3-30B-A3B recipe there with the table's PP 2 x VP 12 x EP 8 layout) and
``recompute_modules=["mla_up_proj"]`` of the DeepSeek-V3 recipes. The others use Megatron's all-to-all
dispatcher (``classic``).
"""

from __future__ import annotations

from dataclasses import dataclass

ARCHIVE = "https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html"
CURRENT = "https://docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary.html"


@dataclass(frozen=True)
class Published:
    """One published run: the recipe as the table gives it and its measured throughput."""

    model: str
    """Simulator preset of the model."""
    system: str
    """Simulator hardware preset (DGX-H100 -> h100, DGX-B200 -> b200)."""
    gpus: int
    precision: str
    """Table's precision, mapped: BF16 -> bf16; FP8 / FP8-CS / MXFP8 -> fp8."""
    gbs: int
    """Global batch size, sequences."""
    mbs: int
    seq: int
    tp: int
    pp: int
    cp: int
    vp: int
    """1 where the table says n/a."""
    ep: int
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    source: str
    """URL and table: release section, system or model table."""
    fsdp: bool = False
    dispatcher: str = "classic"
    moe_a2a_overlap: bool = False
    recompute_modules: tuple[str, ...] = ()
    note: str = ""

    @property
    def is_moe(self) -> bool:
        return self.ep > 1


_A26 = f"{ARCHIVE} (26.02 NeMo Container, table 'Model: {{}}')"
MOE_ROWS = (
    Published(
        "qwen3-30b-a3b",
        "h100",
        16,
        "fp8",
        1024,
        1,
        4096,
        1,
        2,
        1,
        12,
        8,
        5113,
        118,
        _A26.format("Qwen3_30B_a3B") + ", DGX-H100 FP8",
        dispatcher="deepep",
        moe_a2a_overlap=True,
    ),
    Published(
        "qwen3-235b-a22b",
        "h100",
        256,
        "fp8",
        8192,
        1,
        4096,
        2,
        8,
        1,
        4,
        32,
        1633,
        242,
        _A26.format("Qwen3_235B_a22B") + ", DGX-H100 FP8",
        moe_a2a_overlap=True,
        note="EP 32 folds over TP 2 x DP 16 (ETP 1)",
    ),
    Published(
        "gpt-oss-120b",
        "h100",
        64,
        "bf16",
        1280,
        1,
        4096,
        1,
        4,
        1,
        1,
        8,
        5993,
        163,
        _A26.format("GPT OSS 120B") + ", DGX-H100 BF16",
    ),
    Published(
        "deepseek-v3",
        "h100",
        1024,
        "fp8",
        8192,
        1,
        4096,
        2,
        8,
        1,
        4,
        64,
        1297,
        338,
        f"{ARCHIVE} (25.09 NeMo Container, System: DGX-H100, 'DeepSeekV3 (dropless)')",
        dispatcher="deepep",
        recompute_modules=("mla_up_proj",),
        note="the 25.09 table has no precision column; its footnote gives the H100 FP8 block scaling",
    ),
    Published(
        "qwen3-30b-a3b",
        "b200",
        8,
        "fp8",
        512,
        1,
        4096,
        1,
        1,
        1,
        1,
        8,
        9691,
        223,
        _A26.format("Qwen3_30B_a3B") + ", DGX-B200 MXFP8",
        dispatcher="deepep",
    ),
    Published(
        "qwen3-235b-a22b",
        "b200",
        256,
        "fp8",
        8192,
        1,
        4096,
        1,
        8,
        1,
        1,
        8,
        3805,
        563,
        _A26.format("Qwen3_235B_a22B") + ", DGX-B200 MXFP8",
    ),
    Published(
        "deepseek-v3",
        "b200",
        256,
        "fp8",
        4096,
        1,
        4096,
        1,
        16,
        1,
        1,
        8,
        2689,
        699,
        _A26.format("DeepSeekV3") + ", DGX-B200 MXFP8",
        dispatcher="deepep",
        recompute_modules=("mla_up_proj",),
    ),
    Published(
        "gpt-oss-120b",
        "b200",
        64,
        "bf16",
        1280,
        4,
        4096,
        1,
        1,
        1,
        1,
        64,
        8047,
        219,
        _A26.format("GPT OSS 120B") + ", DGX-B200 BF16",
    ),
)
DENSE_ROWS = (
    Published(
        "llama3-70b",
        "h100",
        64,
        "fp8",
        256,
        1,
        8192,
        4,
        8,
        1,
        5,
        1,
        1621,
        728,
        _A26.format("LLAMA3_70B") + ", DGX-H100 FP8",
    ),
    Published(
        "llama3-405b",
        "h100",
        1024,
        "fp8",
        1536,
        1,
        8192,
        8,
        8,
        2,
        8,
        1,
        311,
        784,
        _A26.format("LLAMA3.1_405B") + ", DGX-H100 FP8",
    ),
    Published(
        "llama3-8b",
        "h100",
        8,
        "fp8",
        128,
        1,
        8192,
        1,
        1,
        1,
        1,
        1,
        14451,
        744,
        f"{CURRENT} (25.11 NeMo Container, System: DGX-H100, LLAMA3_8B FP8-CS)",
        fsdp=True,
    ),
)
ROWS = MOE_ROWS + DENSE_ROWS
