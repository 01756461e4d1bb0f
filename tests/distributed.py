"""Shared by the distributed test batteries: run many named checks in one launched job, merge the verdicts.

A battery runs inside ``collectives.launch`` (one spawn per backend and world size), calls each check on every
rank and returns ``{check: None | "failed on ranks [...]; rank r: <its message>"}``, identical on all ranks, so
the pytest side asserts on rank 0's copy for every rank.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch


def run_checks(comm, checks: dict[str, Callable[[], str | None]], limit: int = 6) -> dict:
    """Call every check (``None`` = pass, a string = what went wrong; an exception counts as a failure)."""
    results = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception:
            results[name] = traceback.format_exc(limit=limit)
    return gather_verdicts(comm, results)


def gather_verdicts(comm, results: dict) -> dict:
    """{check: None | 'failed on ranks [...]; rank r: first failing rank's message'} merged over all ranks."""
    names = sorted(results)
    msgs = [(results[n] or "").encode()[:2000] for n in names]
    lens = torch.tensor([len(m) for m in msgs], dtype=torch.int64)
    everyone = torch.empty(comm.world_size * len(names), dtype=torch.int64)
    comm.all_gather(everyone, lens)
    everyone = everyone.view(comm.world_size, len(names))
    width = max(1, int(everyone.max()))
    text = torch.zeros(len(names), width, dtype=torch.uint8)
    for j, m in enumerate(msgs):
        if m:
            text[j, : len(m)] = torch.frombuffer(bytearray(m), dtype=torch.uint8)
    all_text = torch.empty(comm.world_size * len(names), width, dtype=torch.uint8)
    comm.all_gather(all_text, text)
    all_text = all_text.view(comm.world_size, len(names), width)
    merged = {}
    for j, name in enumerate(names):
        bad = [i for i in range(comm.world_size) if everyone[i, j]]
        merged[name] = (
            None
            if not bad
            else (
                f"failed on ranks {bad}; rank {bad[0]}: "
                + bytes(all_text[bad[0], j, : int(everyone[bad[0], j])].tolist()).decode(errors="replace")
            )
        )
    return merged
