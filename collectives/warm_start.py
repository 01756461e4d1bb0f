"""How the local launcher starts its rank processes: ``spawn`` (the default), or warm from a forkserver.

A spawned rank is a fresh interpreter that imports torch before it can run a line of the job: about a second per
rank per job on a laptop-class core, and most of a short job's wall time. A process that launches many short
jobs (a test suite, a benchmark sweep) can name modules in ``MOONEP_LAUNCH_PRELOAD`` (comma-separated, e.g.
``torch,collectives,moonep``): ranks are then forked from one forkserver that imported those modules once, and
start in tens of milliseconds.

A warm rank is still a new process per rank per job (nothing of a previous job survives in it), and it gets what
a spawned rank gets: the launcher's environment as it is at launch, its working directory (both sent with the
job, since the forkserver itself was started earlier), ``sys.path`` and ``__main__`` (multiprocessing's own
preparation data). It dies with the launcher too: the forkserver exits when the launching process does, and a
rank asks for SIGKILL when its parent dies. Import-time side effects of the preloaded modules are shared, so
only modules that are safe to import once per machine belong in the list (torch and this toolkit are).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.context import BaseContext

PRELOAD_ENV = "MOONEP_LAUNCH_PRELOAD"
"""Comma-separated modules the forkserver imports once; unset or empty: ranks are spawned."""


def preload_modules() -> list[str]:
    """The modules named in ``MOONEP_LAUNCH_PRELOAD`` ([] when unset: spawn)."""
    return [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]


def start_context() -> BaseContext:
    """The multiprocessing context the launcher starts ranks with: ``forkserver`` preloading
    ``preload_modules()`` when any are named, else ``spawn``."""
    modules = preload_modules()
    if not modules:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(modules)  # read when the forkserver starts: the first warm launch of the process
    return ctx


def launcher_state() -> tuple[dict[str, str], str]:
    """What a rank must take from the launcher at launch time: its environment and working directory."""
    return dict(os.environ), os.getcwd()


def adopt_launcher_state(state: tuple[dict[str, str], str] | None) -> None:
    """In the rank: the launcher's environment and working directory, as a spawned rank would have them (a
    forked one has the forkserver's, from when it started). ``None``: nothing to adopt (spawned)."""
    if state is None:
        return
    env, cwd = state
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
