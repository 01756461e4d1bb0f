"""Synthetic trace records (the format of collectives/trace.py) for fast detector tests.

A tiny timing model of a step on R ranks: data loading, compute (optionally per routed token), then an
all-to-all and an all-reduce on the whole group, each preceded by the argument-header ``validate`` exchange.
Everyone leaves a collective at ``last enter + transfer``, exactly the relation the analysis inverts.
"""

from __future__ import annotations

import json
import os

import numpy as np


def make_records(
    *,
    ranks=4,
    steps=40,
    compute=0.02,
    data=0.002,
    noise=0.02,
    seed=0,
    slow=None,
    data_slow=None,
    tokens=None,
    link=None,
    stages=None,
    transfer=0.0003,
    latency=0.0001,
    validate=True,
):
    """``{rank: [record, ...]}``.

    slow=(rank, factor, from_step); data_slow=(rank, extra_s, from_step); tokens=[R] rows per rank per step
    (compute scales with them); link=(extra_s, from_step) added to every all-to-all transfer;
    stages=[R] stage index per rank (compute scaled by 1 + 0.5 * stage); validate=False drops the header
    exchange, so the collective itself absorbs the wait for late arrivers.
    """
    rng = np.random.default_rng(seed)
    out = {r: [] for r in range(ranks)}
    seq = dict.fromkeys(range(ranks), 0)
    t = 1000.0

    def rec(r, op, t0, t1, step, **extra):
        d = {
            "op": op,
            "bytes": extra.pop("bytes", 0),
            "group": extra.pop("group", [r]),
            "rank": r,
            "seq": seq[r],
            "t_enter": t0,
            "t_exit": t1,
            "ok": True,
            "step": step,
        }
        d.update(extra)
        seq[r] += 1
        out[r].append(d)

    def collective(now, op, step, extra_transfer=0.0, nbytes=64):
        group = list(range(ranks))
        ends = {}
        if validate:  # header exchange first: it absorbs the wait, the op itself starts aligned
            t_h = max(now.values()) + latency
            for r in range(ranks):
                rec(r, "validate", now[r], t_h, step, group=group, bytes=8)
            now = dict.fromkeys(range(ranks), t_h)
        t_x = max(now.values()) + transfer + extra_transfer
        for r in range(ranks):
            rec(r, op, now[r], t_x + rng.uniform(0, latency), step, group=group, bytes=nbytes)
            ends[r] = t_x
        return ends

    for step in range(steps):
        now = {}
        for r in range(ranks):
            t0 = t
            d = data * (1 + noise * rng.standard_normal())
            if data_slow and r == data_slow[0] and step >= data_slow[2]:
                d += data_slow[1]
            rec(r, "data_load", t0, t0 + d, step, kind="data")
            c = compute * (1 + noise * abs(rng.standard_normal()))
            tok = None
            if tokens is not None:
                tok = int(tokens[r])
                c *= tok / float(np.median(tokens))
            if stages is not None:
                c *= 1.0 + 0.5 * stages[r]
            if slow and r == slow[0] and step >= slow[2]:
                c *= slow[1]
            extra = {"tokens": tok} if tok is not None else {}
            if stages is not None:
                extra["stage"] = stages[r]
            rec(r, "expert_compute", t0 + d, t0 + d + c, step, kind="compute", **extra)
            now[r] = t0 + d + c
        link_extra = link[0] if link and step >= link[1] else 0.0
        ends = collective(now, "all_to_all_single", step, link_extra)
        ends = collective(ends, "all_reduce", step)
        t = max(ends.values()) + 0.0005
    return out


def write_dir(path, records) -> str:
    os.makedirs(path, exist_ok=True)
    for r, recs in records.items():
        with open(os.path.join(path, f"rank{r}.jsonl"), "w") as f:
            f.write("".join(json.dumps(x) + "\n" for x in recs))
    return str(path)
