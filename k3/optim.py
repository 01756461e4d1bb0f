"""Optimizer construction and the learning-rate schedule (warmup, then cosine to a floor)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from k3.muon import PerHeadMuon, param_groups

if TYPE_CHECKING:
    from collectives.base import Communicator


def build_optimizer(
    model, kind: str, *, lr: float, weight_decay: float, comm: Communicator | None = None
) -> PerHeadMuon:
    """``kind="muon"``: Per-Head Muon for matrices, AdamW for the rest; ``"adamw"``: AdamW for everything.

    ``comm``: the ranks whose replicated grads are already summed (the trainer's world); Newton-Schulz of the
    replicated matrices is then split over them (``k3.muon``). None: every block runs on this rank.
    """
    groups = param_groups(model)
    if kind == "adamw":
        groups = [{"params": groups[0]["params"] + groups[1]["params"], "kind": "adamw"}]
    elif kind != "muon":
        raise ValueError(f"optimizer: expected 'muon' or 'adamw', got {kind!r}")
    return PerHeadMuon([g for g in groups if g["params"]], lr=lr, weight_decay=weight_decay, comm=comm)


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps, then cosine to ``floor * peak`` at ``total`` (step is 0-based)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


__all__ = ["build_optimizer", "lr_at"]
