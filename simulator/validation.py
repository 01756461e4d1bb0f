"""Validation against published runs: Korthikanti et al. 2022 (arXiv 2205.05198), Megatron-LM on A100-80GB.

Table 5 iteration times (seconds) and Fig. 1 memory (GiB per GPU), as replayed by Calculon
(``calculon-ai/calculon`` ``validation/seqsel/tab5/*.json``, quoted in
``docs/reference/simulator_and_straggler_background.md`` section 3.1). Sequence 2048, vocab 51200. Interleaving
3 for 175B and 530B as in Calculon's replay files (the Fig. 1 activation memory of those two models matches the
interleaved formula, which supports it). The A100 efficiency set in ``hardware.py`` is one set for all rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from simulator.analytic import simulate
from simulator.hardware import load_hardware
from simulator.memory import GIB, rank_memory
from simulator.parallel import ParallelConfig
from simulator.published import ROWS, Published
from simulator.specs import load_model


@dataclass(frozen=True)
class Run:
    """One published run."""

    model: str
    gpus: int
    tp: int
    pp: int
    vpp: int
    global_batch: int
    micro_batch: int
    full_recompute_s: float
    selective_sp_s: float
    params_optimizer_gib: float
    activations_none_gib: float
    activations_selective_gib: float


RUNS = (
    Run("gpt-22b", 8, 8, 1, 1, 4, 4, 1.42, 1.10, 45.56, 59.25, 9.56),
    Run("gpt-175b", 64, 8, 8, 3, 64, 1, 18.13, 13.75, 45.56, 66.84, 12.35),
    Run("gpt-530b", 280, 8, 35, 3, 280, 1, 49.05, 37.83, 31.64, 114.02, 23.08),
    Run("gpt-1t", 512, 8, 64, 1, 512, 1, 94.42, 71.49, 32.96, 131.25, 26.56),
)
SOURCE = (
    "Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models' "
    "(arXiv 2205.05198), Table 5 and Fig. 1, as replayed in calculon-ai/calculon validation/seqsel"
)


def config(run: Run, recompute: str, sequence_parallel: bool = True) -> ParallelConfig:
    return ParallelConfig(
        tp=run.tp,
        pp=run.pp,
        dp=run.gpus // (run.tp * run.pp),
        vpp=run.vpp,
        schedule="interleaved" if run.vpp > 1 else "1f1b",
        micro_batch=run.micro_batch,
        global_batch_tokens=run.global_batch * 2048,
        seq_len=2048,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
        zero_stage=0,
    )


def time_table(engine: str = "analytic") -> list[dict]:
    """Predicted vs published iteration time for every run and recompute mode (8 rows)."""
    rows = []
    for run in RUNS:
        for mode, published in (("full", run.full_recompute_s), ("selective", run.selective_sp_s)):
            res = simulate(run.model, "a100", config(run, mode), run.gpus, engine=engine)
            rows.append(
                {
                    "model": run.model,
                    "gpus": run.gpus,
                    "recompute": mode,
                    "published_s": published,
                    "predicted_s": res.step_time_s,
                    "error": res.step_time_s / published - 1.0,
                    "mfu": res.mfu,
                    "feasible": res.feasible,
                    "reason": res.reason,
                }
            )
    return rows


def memory_table() -> list[dict]:
    """Predicted vs published activation memory per GPU (Fig. 1) for no recompute (no SP) and selective+SP."""
    rows = []
    for run in RUNS:
        spec, hw = load_model(run.model), load_hardware("a100")
        for mode, sp, published in (
            ("none", False, run.activations_none_gib),
            ("selective", True, run.activations_selective_gib),
        ):
            mem = rank_memory(spec, hw, config(run, mode, sp), 0)
            rows.append(
                {
                    "model": run.model,
                    "recompute": mode,
                    "published_gib": published,
                    "predicted_gib": mem["activations"] / GIB,
                    "error": mem["activations"] / GIB / published - 1.0,
                }
            )
    return rows


def format_rows(rows: list[dict], pub: str, pred: str) -> str:
    lines = [f"{'model':<10} {'recompute':<10} {'published':>10} {'predicted':>10} {'error':>8}"]
    for r in rows:
        lines.append(f"{r['model']:<10} {r['recompute']:<10} {r[pub]:>10.2f} {r[pred]:>10.2f} {r['error']:>+8.1%}")
    return "\n".join(lines)


_MODE_LABEL = {"full": "full", "selective": "selective+SP", "none": "none (no SP)"}


def format_a100_tables() -> tuple[str, str]:
    """The README's two A100 tables (markdown): iteration time, both engines, with the predicted MFU; activation
    memory per GPU."""
    lines = [
        "| model | GPUs | recompute | published s | analytic s | error | event s | error | MFU (pred.) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for a, e in zip(time_table(), time_table(engine="event")):
        lines.append(
            f"| {a['model']} | {a['gpus']} | {_MODE_LABEL[a['recompute']]} | {a['published_s']:.2f} | "
            f"{a['predicted_s']:.2f} | {a['error']:+.1%} | {e['predicted_s']:.2f} | {e['error']:+.1%} | "
            f"{a['mfu']:.1%} |"
        )
    memory = ["| model | recompute | published | predicted | error |", "|---|---|---|---|---|"]
    for r in memory_table():
        memory.append(
            f"| {r['model']} | {_MODE_LABEL[r['recompute']]} | {r['published_gib']:.2f} | {r['predicted_gib']:.2f} | "
            f"{r['error']:+.1%} |"
        )
    return "\n".join(lines), "\n".join(memory)


# ------------------------------------------------------------------ published Megatron-Bridge runs (MoE, dense)
def published_config(row: Published) -> ParallelConfig:
    """The row's recipe as a ``ParallelConfig`` (fields the table does not give: see ``simulator.published``)."""
    return ParallelConfig(
        tp=row.tp,
        pp=row.pp,
        cp=row.cp,
        ep=row.ep,
        etp=1 if row.is_moe else 0,
        dp=row.gpus // (row.tp * row.pp * row.cp),
        vpp=row.vp,
        schedule="interleaved" if row.vp > 1 else "1f1b",
        micro_batch=row.mbs,
        global_batch_tokens=row.gbs * row.seq,
        seq_len=row.seq,
        precision=row.precision,
        recompute=row.recompute,
        recompute_modules=row.recompute_modules,
        zero_stage=3 if row.fsdp else 1,
        offload_fraction=row.offload_fraction,
        main_grads_dtype=row.main_grads_dtype,
        dispatcher=row.dispatcher,
        moe_a2a_overlap=row.moe_a2a_overlap,
        shared_expert_overlap=row.shared_expert_overlap,
        cuda_graph=row.cuda_graph,
        ep_comm_sms=row.ep_comm_sms,
        fp8_attention=row.fp8_attention,
        fused_expert_mlp=row.fused_expert_mlp,
        pp_first_layers=row.pp_layout[0] if row.pp_layout else None,
        pp_last_layers=row.pp_layout[1] if row.pp_layout else None,
    )


def published_model(row: Published):
    """The row's model: the preset, with DeepSeek-V3's one MTP module where the run trained it."""
    spec = load_model(row.model)
    return replace(spec, mtp_layers=1) if row.mtp else spec


def cli_args(row: Published) -> list[str]:
    """``moonep simulate run`` flags that reproduce ``published_config(row)``."""
    args = ["--model", row.model, "--hardware", row.system, "--gpus", str(row.gpus), "--precision", row.precision]
    args += ["--global-batch-tokens", str(row.gbs * row.seq), "--micro-batch", str(row.mbs), "--seq-len", str(row.seq)]
    args += ["--tp", str(row.tp), "--pp", str(row.pp), "--cp", str(row.cp), "--ep", str(row.ep), "--vpp", str(row.vp)]
    args += ["--etp", "1"] if row.is_moe else []
    args += ["--schedule", "interleaved" if row.vp > 1 else "1f1b", "--recompute", row.recompute]
    args += ["--zero", "3" if row.fsdp else "1", "--dispatcher", row.dispatcher]
    args += ["--offload-fraction", str(row.offload_fraction)] if row.offload_fraction else []
    args += ["--mtp-layers", "1"] if row.mtp else []
    layout = row.pp_layout or ()
    args += ["--pp-first-layers", str(layout[0]), "--pp-last-layers", str(layout[1])] if layout else []
    args += ["--main-grads-dtype", row.main_grads_dtype]
    args += ["--recompute-modules", ",".join(row.recompute_modules)] if row.recompute_modules else []
    args += ["--cuda-graph", row.cuda_graph] + (["--fp8-attention"] if row.fp8_attention else [])
    args += ["--moe-shared-expert-overlap"] if row.shared_expert_overlap else []
    args += ["--fused-expert-mlp"] if row.fused_expert_mlp else []
    return args + (["--moe-a2a-overlap", "--ep-comm-sms", str(row.ep_comm_sms)] if row.moe_a2a_overlap else [])


def published_table(engine: str = "analytic") -> list[dict]:
    """Predicted vs published tokens/s/GPU for every ``simulator.published`` row."""
    out = []
    for row in ROWS:
        res = simulate(published_model(row), row.system, published_config(row), row.gpus, engine=engine)
        out.append(
            {
                "model": row.model,
                "system": row.system,
                "gpus": row.gpus,
                "pp": row.pp,
                "precision": row.precision,
                "release": row.release,
                "kind": "moe" if row.is_moe else "dense",
                "published": row.tokens_per_s_per_gpu,
                "predicted": res.tokens_per_s_per_gpu,
                "error": res.tokens_per_s_per_gpu / row.tokens_per_s_per_gpu - 1.0,
                "published_tflops": row.tflops_per_gpu,
                "tflops_full_square": res.flops.get("full_square", {}).get("tflops_per_gpu", 0.0),
                "tflops_causal": res.flops.get("causal", {}).get("tflops_per_gpu", 0.0),
                "memory_gib": res.memory_gib_per_gpu,
                "ep_overlapped": res.ep_overlap.get("overlapped_fraction", 0.0),
                "feasible": res.feasible,
                "reason": res.reason,
            }
        )
    return out


BAND = 0.15
"""The issue's acceptance band on tokens/s/GPU (see ``simulator.software_fit`` for what is fitted, and how)."""
KNOWN_MISSES = {
    ("qwen3-30b-a3b", "h100", 16, 2): "issue 18's row: the PP 2 x VP 12 recipe of the 26.02 container ran at 5113 "
    "tokens/s/GPU, while the same model on the same 16 H100s ran at 8826-8960 from 26.04 on (PP 1 x EP 16, "
    "HybridEP, CUDA graphs): the simulator puts the two layouts close together and cannot tell that release's "
    "costs apart; kept as published, out of the fit",
}
"""Validation rows outside ``BAND`` with the honest model, and why: reported, not tuned away. Keyed by
``row_key``."""


def row_key(row) -> tuple:
    """(model, system, GPUs, PP): what tells the table's rows apart (a row or a ``published_table`` dict)."""
    if isinstance(row, dict):
        return (row["model"], row["system"], row["gpus"], row["pp"])
    return (row.model, row.system, row.gpus, row.pp)


def mean_abs_error(rows: list[dict], kind: str) -> float:
    """Mean |error| of the rows of ``kind`` (``moe`` or ``dense``)."""
    errs = [abs(r["error"]) for r in rows if r["kind"] == kind]
    return sum(errs) / len(errs)


def format_published(rows: list[dict]) -> str:
    """Markdown table (the README's)."""
    lines = [
        "| model | system | GPUs | precision | table | published tok/s/GPU | predicted | error | "
        "TFLOP/s causal / full | GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        miss = " (documented miss)" if row_key(r) in KNOWN_MISSES else ""
        lines.append(
            f"| {r['model']} | {r['system']} | {r['gpus']} | {r['precision']} | {r['release']} | "
            f"{r['published']:.0f} | {r['predicted']:.0f} | {r['error']:+.1%}{miss} | "
            f"{r['tflops_causal']:.0f} / {r['tflops_full_square']:.0f} | {r['memory_gib']:.1f} |"
        )
    tracked = [r for r in rows if row_key(r) not in KNOWN_MISSES]
    for kind in ("moe", "dense"):
        ratios = [r["predicted"] / r["published"] for r in tracked if r["kind"] == kind]
        inside = sum(abs(x - 1) <= BAND for x in ratios)
        lines.append(
            f"\n{kind}: {len(ratios)} rows, MAE {mean_abs_error(tracked, kind):.1%}, mean ratio "
            f"{sum(ratios) / len(ratios):.3f}, {inside} within +-{BAND:.0%}"
        )
    return "\n".join(lines)
