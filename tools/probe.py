"""Active pairwise link probe: time a send/recv from every rank to every other rank.

``moonep probe --world-size N`` launches N local ranks (``collectives.launch``). For each ordered pair
``(src, dst)`` and each round, all ranks meet at a barrier, ``src`` sends ``nbytes`` to ``dst``, and the one-way
time is ``dst's recv exit - src's send enter`` (one host clock: ranks launched here share it). The *minimum* over
rounds fills ``one_way_s[src][dst]``: a slow link adds its delay to every round, while scheduling jitter on
shared cores only adds to some, so the minimum keeps the link and drops the jitter; a pair whose time is ``factor`` x
the median pair and at least
``min_extra_s`` more is a *slow pair*. Injected link delays (``MOONEP_INJECT_LINK_DELAY`` or ``link_delay=``)
apply to the probe's sends like any others, which is how tests check that a delayed pair stands out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from collectives import launch
from collectives.faults import parse_link_delay_specs

MAX_NBYTES = 1 << 30
"""Largest probe payload (1 GiB)."""
MAX_ROUNDS = 10_000
"""Most timed sends per ordered pair: the probe keeps the minimum, which a few rounds find, and every rank holds
``[R, R, rounds]`` times (``--rounds 10**20`` was an overflow traceback on every rank)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeConfig:
    """How hard to probe."""

    rounds: int = 5
    """Timed sends per ordered pair (the minimum is kept: one descheduled rank does not make a slow link)."""
    nbytes: int = 4096
    """Payload per send (at most ``MAX_NBYTES``: the probe times latency, and every rank allocates it)."""
    factor: float = 3.0
    """A pair this many times the median pair time is slow..."""
    min_extra_s: float = 0.005
    """...and at least this many seconds over it (loopback jitter on busy shared cores reaches a few ms)."""

    def __post_init__(self):
        if not 1 <= self.rounds <= MAX_ROUNDS or not 4 <= self.nbytes <= MAX_NBYTES:
            raise ValueError(
                f"rounds must be in [1, {MAX_ROUNDS}] and nbytes in [4, {MAX_NBYTES}], got {self.rounds}, {self.nbytes}"
            )
        if not self.factor > 1 or self.min_extra_s < 0:
            raise ValueError(f"factor must be > 1 and min_extra_s >= 0, got {self.factor}, {self.min_extra_s}")


def probe_rank(comm, cfg: ProbeConfig, link_delays: list[tuple[int, int, float]] = ()) -> np.ndarray:
    """Run on every rank; returns (on every rank) ``[R, R, rounds]`` one-way seconds (diagonal 0)."""
    for src, dst, ms in link_delays:
        comm.inject_link_delay(src, dst, ms)
    world, me = comm.world_size, comm.rank
    sent = torch.zeros(world, world, cfg.rounds, dtype=torch.float64)
    got = torch.zeros(world, world, cfg.rounds, dtype=torch.float64)
    buf = torch.zeros(max(1, cfg.nbytes // 4), dtype=torch.float32)
    for src in range(world):
        for dst in range(world):
            if src == dst:
                continue
            for k in range(cfg.rounds):
                comm.barrier()
                if me == src:
                    sent[src, dst, k] = time.time()
                    comm.send(buf, dst)
                elif me == dst:
                    comm.recv(buf, src)
                    got[src, dst, k] = time.time()
    comm.all_reduce(sent)  # each entry was written by exactly one rank: the sum gathers them
    comm.all_reduce(got)
    return (got - sent).numpy()  # the diagonal stays 0: summarise() blanks it


def summarise(one_way: np.ndarray, cfg: ProbeConfig) -> dict:
    """The probe JSON: ``one_way_s`` ``[R][R]`` minima over rounds (null diagonal), ``median_s``, ``slow_pairs``."""
    med = np.array(one_way.min(axis=2) if one_way.ndim == 3 else one_way, dtype=float)
    np.fill_diagonal(med, np.nan)
    typical = float(np.nanmedian(med))
    slow = []
    for src, dst in zip(*np.nonzero(np.nan_to_num(med) >= max(cfg.factor * typical, typical + cfg.min_extra_s))):
        slow.append(
            {
                "ranks": [int(src), int(dst)],
                "seconds": float(med[src, dst]),
                "ratio": float(med[src, dst] / typical) if typical > 0 else float("inf"),
            }
        )
    slow.sort(key=lambda p: -p["seconds"])
    return {
        "one_way_s": [[None if not np.isfinite(x) else float(x) for x in row] for row in med],
        "median_s": typical,
        "slow_pairs": slow,
        "rounds": cfg.rounds,
    }


def _probe_job(comm, cfg: ProbeConfig, link_delays) -> np.ndarray:
    return probe_rank(comm, cfg, link_delays)


def run_probe(
    world_size: int,
    cfg: ProbeConfig | None = None,
    *,
    link_delay: str = "",
    backend: str = "torch",
    timeout: float = 60.0,
) -> dict:
    """Launch ``world_size`` local ranks, probe every ordered pair, return ``summarise``'s JSON."""
    if world_size < 2:
        raise ValueError(f"the probe needs world_size >= 2, got {world_size}")
    cfg = cfg or ProbeConfig()
    delays = [(d.src, d.dst, d.ms) for d in parse_link_delay_specs(link_delay)]
    bad = [d for d in delays if max(d[0], d[1]) >= world_size]
    if bad:
        raise ValueError(f"link delay ranks {bad} outside world_size={world_size}")
    one_way = launch(
        _probe_job,
        world_size,
        backend=backend,
        timeout=timeout,
        job_timeout=max(60.0, 3 * timeout),
        cfg=cfg,
        link_delays=delays,
    )
    return summarise(one_way, cfg)
