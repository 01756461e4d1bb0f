"""Search: enumerate parallel layouts for a model on N GPUs, keep those that fit, rank by tokens/s per GPU.

The space: TP in {1, 2, 4, 8} (inside a node), PP over divisors of N (at most the layer count), CP in
{1, 2, 4, 8}, DP = N / (TP CP PP), EP over power-of-two divisors of DP x CP that divide the experts,
micro-batch, recompute mode and schedule (1F1B, interleaved with 2 virtual stages, DualPipe). Cheap rule
checks run first, memory next, the step-time model only for what fits. The best ``event_top`` are re-run
on the event engine (``engine: event`` in their rows).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace

from simulator.analytic import simulate
from simulator.feasibility import infeasible_reason
from simulator.hardware import load_hardware
from simulator.layers import RECOMPUTE_MODES
from simulator.memory import GIB, exceeds_memory
from simulator.network import ClusterSpec
from simulator.parallel import SCHEDULES, ParallelConfig
from simulator.specs import load_model


@dataclass(kw_only=True, frozen=True)
class SearchSpace:
    """Values tried per knob (the defaults cover what large MoE and dense runs use)."""

    tp: tuple[int, ...] = (1, 2, 4, 8)
    """Tensor parallel sizes."""
    cp: tuple[int, ...] = (1, 2, 4, 8)
    """Context parallel sizes."""
    micro_batch: tuple[int, ...] = (1, 2)
    """Sequences per micro-batch."""
    recompute: tuple[str, ...] = ("selective", "selective+act", "full")
    """Recompute modes."""
    schedules: tuple[str, ...] = ("1f1b", "interleaved", "dualpipe")
    """Pipeline schedules (interleaved uses ``vpp``)."""
    vpp: int = 2
    """Virtual stages for the interleaved schedule."""
    zero_stage: tuple[int, ...] = (1,)
    """ZeRO stages."""
    max_pp: int = 64
    """Largest pipeline size tried."""
    max_ep: int = 256
    """Largest expert-parallel size tried."""

    def __post_init__(self):
        for f in ("tp", "cp", "micro_batch", "recompute", "schedules", "zero_stage"):
            if not getattr(self, f):
                raise ValueError(f"SearchSpace.{f} must not be empty")
        if self.vpp < 2 or self.max_pp < 1 or self.max_ep < 1:
            raise ValueError("SearchSpace.vpp must be >= 2 and max_pp, max_ep >= 1")
        for f in ("tp", "cp", "micro_batch"):
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in getattr(self, f)):
                raise ValueError(f"SearchSpace.{f} must hold positive integers, got {getattr(self, f)!r}")
        for f, allowed in (("recompute", RECOMPUTE_MODES), ("schedules", SCHEDULES), ("zero_stage", (0, 1, 2, 3))):
            bad = [v for v in getattr(self, f) if v not in allowed]
            if bad:
                raise ValueError(f"SearchSpace.{f}: unknown {bad}; known: {', '.join(map(str, allowed))}")


def candidates(spec, gpus: int, base: ParallelConfig, space: SearchSpace):
    """Yield every ParallelConfig of the space (rule-infeasible ones included; callers filter)."""
    pps = [p for p in range(1, min(space.max_pp, spec.num_layers, gpus) + 1) if gpus % p == 0]
    for tp, cp, pp in itertools.product(space.tp, space.cp, pps):
        if gpus % (tp * cp * pp):
            continue
        dp = gpus // (tp * cp * pp)
        eps = [1]
        if spec.is_moe:
            eps = [
                e
                for e in (2**i for i in range(0, 20))
                if e <= min(space.max_ep, dp * cp) and (dp * cp) % e == 0 and spec.num_experts % e == 0
            ]
        for ep, mb, rc, sched, zs in itertools.product(
            eps, space.micro_batch, space.recompute, space.schedules, space.zero_stage
        ):
            if sched != "1f1b" and pp == 1:
                continue
            try:
                cand = replace(
                    base,
                    tp=tp,
                    cp=cp,
                    pp=pp,
                    dp=dp,
                    ep=ep,
                    micro_batch=mb,
                    recompute=rc,
                    schedule=sched,
                    vpp=space.vpp if sched == "interleaved" else 1,
                    zero_stage=zs,
                )
            except ValueError:  # a combination ParallelConfig refuses (full recompute under module graphs)
                continue
            yield cand


def _progress(total: int):
    disable = bool(os.environ.get("TQDM_DISABLE")) or not sys.stderr.isatty()
    try:
        from tqdm import tqdm  # optional: tqdm, a progress bar only
    except ImportError:  # tqdm is optional at run time
        return None
    return tqdm(total=total, disable=disable, desc="simulate search", unit="cfg")


def search(
    model,
    hardware,
    gpus: int,
    base: ParallelConfig | None = None,
    cluster: ClusterSpec | None = None,
    space: SearchSpace | None = None,
    *,
    top: int = 20,
    event_top: int = 3,
    max_seconds: float | None = None,
) -> dict:
    """Ranked feasible configurations by tokens/s/GPU plus search statistics (``configs_per_s``)."""
    if max_seconds is not None and not (math.isfinite(max_seconds) and max_seconds > 0):
        raise ValueError(f"max_seconds must be a finite number > 0, got {max_seconds!r}")
    spec, hw = load_model(model), load_hardware(hardware)
    base = base or ParallelConfig(seq_len=spec.seq_len, global_batch_tokens=max(spec.seq_len * gpus, 2**24))
    space = space or SearchSpace()
    cluster = cluster or ClusterSpec()
    t0 = time.perf_counter()
    cands = list(candidates(spec, gpus, base, space))
    bar = _progress(len(cands))
    reasons: Counter = Counter()
    results = []
    evaluated = 0
    for par in cands:
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
        evaluated += 1
        if bar is not None:
            bar.update(1)
        why = infeasible_reason(spec, hw, par, gpus)
        if why is None and exceeds_memory(spec, hw, par, hw.hbm_gib * GIB):
            why = "out of memory"
        if why is not None:
            reasons[_reason_class(why)] += 1
            continue
        res = simulate(spec, hw, par, gpus, cluster)
        if res.feasible:
            results.append(res)
        else:
            reasons[_reason_class(res.reason)] += 1
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    results.sort(key=lambda r: -r.tokens_per_s_per_gpu)
    rows = [r.to_dict() for r in results[:top]]
    for i in range(min(event_top, len(rows))):
        ev = simulate(spec, hw, ParallelConfig(**rows[i]["parallel"]), gpus, cluster, engine="event")
        rows[i]["event_step_time_s"] = ev.step_time_s
    return {
        "model": spec.name,
        "hardware": hw.name,
        "gpus": gpus,
        "candidates": len(cands),
        "evaluated": evaluated,
        "feasible": len(results),
        "seconds": seconds,
        "configs_per_s": evaluated / seconds if seconds > 0 else float("inf"),
        "infeasible_reasons": dict(reasons.most_common()),
        "results": rows,
    }


def _reason_class(reason: str) -> str:
    """Group reasons for the summary (drop the numbers)."""
    return re.sub(r"\d+(\.\d+)?", "N", reason).split(":")[0].split(" (")[0].strip()
