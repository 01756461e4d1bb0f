"""Tracing and injected faults of one training rank: the records ``moonep diagnose`` reads.

``PhaseClock`` writes one ``kind="data"`` record per step and ``kind="compute"`` records per phase with
``cpu_s`` (thread CPU time), split per sublayer call by module hooks, and stretches them by an injected
slowdown (which faults are in force at a step: ``collectives.faults.faults_at``). Model code stays untouched:
hooks only.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from k3.moe import LatentMoE


class PhaseClock:
    """One rank's compute and data phases as trace records, with an injected slowdown applied to them.

    Compute is thread CPU time (``cpu_s``): gloo moves data on its own threads, so neither waiting for peers
    inside a phase nor time descheduled on a shared host counts, which is what lets ``tools`` compare ranks.
    A slowdown spins on this thread until a phase's CPU time is ``factor`` x what it was (time-based, as in
    ``tools/workload.py``), so the factor means the same on any machine. Without a tracer nothing is recorded
    but the slowdown still applies.
    """

    def __init__(self, tracer) -> None:
        self.tracer = tracer
        self.factor = 1.0
        """Compute multiplier of the current step (1 = no injected slowdown)."""
        self._phase: str | None = None
        self._nested = 0.0  # CPU seconds of sublayer records (already stretched) inside the open phase

    def attach(self, model) -> None:
        """Per-sublayer records: hooks around every attention and MLP sublayer, forward and backward."""
        for layer in model.layers:
            self._hook(layer.self_attn, layer.kind, layer.index)
            self._hook(layer.mlp, "moe" if isinstance(layer.mlp, LatentMoE) else "dense", layer.index)

    def _hook(self, module, kind: str, index: int) -> None:
        start: list[tuple[float, float]] = []

        def enter(*_):
            if self._phase is not None:
                start[:] = [(time.time(), time.thread_time())]

        def leave(*_):
            if self._phase is not None and start:
                t0, c0 = start.pop()
                self._stretch(c0)
                cpu = time.thread_time() - c0
                self._nested += cpu
                self.tracer.record_event(
                    self._phase, t0, time.time(), kind="compute", layer=kind, index=index, cpu_s=cpu
                )

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        module.register_full_backward_pre_hook(enter)
        module.register_full_backward_hook(leave)

    def _stretch(self, c0: float, done: float = 0.0) -> None:
        """Spin until this thread's CPU time since ``c0``, less ``done`` (stretched already), is factor x."""
        if self.factor > 1.0:
            end = c0 + done + (time.thread_time() - c0 - done) * self.factor
            while time.thread_time() < end:
                pass

    @contextmanager
    def phase(self, name: str):
        """A compute phase; its sublayer calls get their own records, the rest one record (``layer="other"``)."""
        t0, c0 = time.time(), time.thread_time()
        self._phase, self._nested = name, 0.0
        try:
            yield
        finally:
            self._phase = None
        self._stretch(c0, self._nested)
        if self.tracer is not None:
            rest = {"layer": "other"} if self._nested else {}
            self.tracer.record_event(
                name, t0, time.time(), kind="compute", cpu_s=time.thread_time() - c0 - self._nested, **rest
            )

    @contextmanager
    def data(self, delay_ms: float = 0.0):
        """Data loading (wall time: a slow loader often waits on I/O), plus an injected delay."""
        t0 = time.time()
        yield
        if delay_ms:
            time.sleep(delay_ms / 1000.0)
        if self.tracer is not None:
            self.tracer.record_event("data_load", t0, time.time(), kind="data")
