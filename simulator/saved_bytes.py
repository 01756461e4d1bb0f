"""``moonep simulate saved-bytes``: the simulator's saved bytes per token per layer, by module, beside what real
layer code keeps (``moonep bench k3-memory --json``, measured with ``saved_tensors_hooks``).

The simulator may not import the model code (tests/test_layers.py: it takes ``k3.config`` only), so the measured
side arrives as the bench's JSON: data, not an import. Modules are the bench's: ``mla`` / ``kda`` attention,
``moe`` / ``dense_mlp``, the two ``attn_res`` mixes, the two layer ``norms``, and the whole ``mla_layer`` /
``kda_layer`` (attention + MoE + norms + AttnRes). The simulator's rows are its own terms (``simulator.layers``):
attention and FFN ``par`` bytes, the norm and block inputs (``act_rep``) for the norms, and ``act_rep + act_par``
for a layer, plus the AttnRes mixes (``layers.attn_res_bytes``, moonep's implementation); a non-flash softmax adds
``act_s2_per_s`` bytes per key position (not included: K3's MLA runs SDPA's fused causal path).
"""

from __future__ import annotations

import json
import math

from simulator.layers import _attention, _ffn, layer_stats
from simulator.modelspec import ModelSpec

MODULES = ("mla", "kda", "moe", "dense_mlp", "attn_res", "norms", "mla_layer", "kda_layer")


def simulated(spec: ModelSpec) -> dict[str, float | None]:
    """Saved bytes per token per layer by module, as the simulator counts them (None: no term for it)."""
    mla, kda = layer_stats(spec, ("mla", "moe")), layer_stats(spec, ("kda", "moe"))
    return {
        "mla": float(_attention(spec, "mla")["par"]),
        "kda": float(_attention(spec, "kda")["par"]),
        "moe": float(_ffn(spec, "moe")["par"]),
        "dense_mlp": float(_ffn(spec, "dense")["par"]),
        "attn_res": mla.act_attn_res,
        "norms": float(mla.act_rep),
        "mla_layer": mla.act_rep + mla.act_par + mla.act_attn_res,
        "kda_layer": kda.act_rep + kda.act_par + kda.act_attn_res,
    }


def measured(path: str) -> list[dict]:
    """The K3 rows of a ``moonep bench k3-memory --json`` report: one dict per sequence length."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    rows = report.get("k3") if isinstance(report, dict) else None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and "seq_len" in r for r in rows):
        raise ValueError(f"{path} is not a 'moonep bench k3-memory --json' report (no 'k3' rows with seq_len)")
    return rows


def side_by_side(spec: ModelSpec, rows: list[dict] | None, *, name: str = "k3") -> dict:
    """{"model", "modules": [...], "simulator": {...}, "measured": [{seq_len, module: bytes}], "ratio": [...]}:
    measured over simulated per module and sequence length (None where either side has no number)."""
    sim = simulated(spec)
    out: dict = {"model": name, "modules": list(MODULES), "simulator": sim, "measured": [], "ratio": []}
    for row in rows or []:
        got = {m: row.get(m) for m in MODULES}
        out["measured"].append({"seq_len": row["seq_len"], **got})
        ratio = {m: _ratio(got[m], sim[m]) for m in MODULES}
        out["ratio"].append({"seq_len": row["seq_len"], **ratio})
    return out


def _ratio(a, b) -> float | None:
    if a is None or b is None or not b or not math.isfinite(a):
        return None
    return a / b


def format_table(table: dict) -> str:
    """The side-by-side as text: one column per module, a row for the simulator, per measured T and per ratio."""
    mods = table["modules"]

    def cell(v, f: str) -> str:
        return f"{'-':>11}" if v is None else f"{v:>11{f}}"

    lines = [f"{'bytes/token/layer':<22}" + "".join(f"{m:>11}" for m in mods)]
    lines.append(f"{'simulator ' + table['model']:<22}" + "".join(cell(table["simulator"][m], ",.0f") for m in mods))
    for row in table["measured"]:
        lines.append(f"{'measured T=' + str(row['seq_len']):<22}" + "".join(cell(row[m], ",.0f") for m in mods))
    for row in table["ratio"]:
        lines.append(f"{'measured/sim T=' + str(row['seq_len']):<22}" + "".join(cell(row[m], ".2f") for m in mods))
    return "\n".join(lines)


BUDGET_TERMS = ("norm and block inputs", "attention", "FFN / MoE", "AttnRes mixes", "layer")


def activation_budget(spec: ModelSpec) -> list[dict]:
    """Saved bytes per token per layer by term, per layer kind of ``spec`` at its released widths (bf16, TP 1,
    no recompute, flash attention): what one token costs a layer before any recompute or fp8 storage, the
    README's K3 vs DeepSeek-V3 table."""
    out = []
    for kind in sorted(set(spec.layer_kinds()), key=spec.layer_kinds().index):
        st = layer_stats(spec, kind)
        a, f = _attention(spec, kind[0])["par"], _ffn(spec, kind[1])["par"]
        terms = (st.act_rep, float(a), float(f), st.act_attn_res)
        out.append({"model": spec.name, "kind": "/".join(kind), **dict(zip(BUDGET_TERMS, (*terms, sum(terms))))})
    return out


def format_budget(rows: list[dict]) -> str:
    """Markdown table of ``activation_budget`` rows (bytes per token per layer)."""
    lines = ["| model | layer | " + " | ".join(BUDGET_TERMS) + " |", "|---|---|" + "---|" * len(BUDGET_TERMS)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['kind']} | " + " | ".join(f"{r[t]:,.0f}" for t in BUDGET_TERMS) + " |")
    return "\n".join(lines)


TERM_COLUMNS = (("k3", ("mla", "moe")), ("k3", ("kda", "moe")), ("deepseek-v3", ("mla", "moe")))
"""The README's per-term table: K3's MLA and KDA MoE layers beside DeepSeek-V3's MoE layer."""


def format_terms(specs: dict[str, ModelSpec], columns=TERM_COLUMNS) -> str:
    """Markdown table of ``LayerStats.act_terms`` bytes per token per layer (bf16, TP 1, flash, probabilities
    inside the SwiGLU; ``kv_lora`` is the ``mla_kv`` item), one column per (model, layer kind), AttnRes last."""
    stats = [layer_stats(specs[m], k) for m, k in columns]
    names: list[str] = []
    for st in stats:
        names += [t.name for t in st.act_terms if t.name not in names and t.when != "combine"]
    head = "| term | " + " | ".join(f"{m} {'/'.join(k)}" for m, k in columns) + " |"
    lines = [head, "|---|" + "---|" * len(columns)]
    for name in names:
        cells = [sum(t.nbytes for t in st.act_terms if t.name == name) for st in stats]
        if any(cells):
            lines.append(f"| {name} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |")
    lines.append("| AttnRes mixes | " + " | ".join(f"{st.act_attn_res:,.0f}" for st in stats) + " |")
    return "\n".join(lines)


__all__ = [
    "MODULES",
    "TERM_COLUMNS",
    "format_terms",
    "activation_budget",
    "format_budget",
    "format_table",
    "measured",
    "side_by_side",
    "simulated",
]
