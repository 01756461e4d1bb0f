"""How the local launcher starts its rank processes: ``spawn`` (the default), or warm from a forkserver.

A spawned rank is a fresh interpreter that imports torch before it can run a line of the job: about a second per
rank per job on a laptop-class core, and most of a short job's wall time. A process that launches many short
jobs (a test suite, a benchmark sweep) can name modules in ``MOONEP_LAUNCH_PRELOAD`` (comma-separated, e.g.
``torch,collectives,moonep``): ranks are then forked from one forkserver that imported those modules once, and
start in tens of milliseconds. A module whose import compiles what the ranks run belongs there too: ``moonep.warm``
puts the planner's and the send layout's numba kernels into the forkserver, so that no rank loads them itself.

A warm rank is still a new process per rank per job (nothing of a previous job survives in it), and it gets what
a spawned rank gets: the launcher's environment as it is at launch, its working directory (both sent with the
job, since the forkserver itself was started earlier), ``sys.path`` and ``__main__`` (multiprocessing's own
preparation data). It dies with the launcher too, even one killed by SIGKILL: its parent is the forkserver, which
lives as long as any rank does, so a warm rank watches the launcher itself (a ``pidfd`` on Linux, a poll
elsewhere) and kills itself when the launcher is gone. Import-time side effects of the preloaded modules are shared, so
only modules that are safe to import once per machine belong in the list (torch and this toolkit are).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import signal
import threading
import time
from multiprocessing.context import ForkServerContext, SpawnContext

PRELOAD_ENV = "MOONEP_LAUNCH_PRELOAD"
"""Comma-separated modules the forkserver imports once; unset or empty: ranks are spawned."""


def preload_modules() -> list[str]:
    """The modules named in ``MOONEP_LAUNCH_PRELOAD`` ([] when unset: spawn)."""
    return [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]


def start_context() -> SpawnContext | ForkServerContext:
    """The multiprocessing context the launcher starts ranks with: ``forkserver`` preloading
    ``preload_modules()`` when any are named, else ``spawn``."""
    modules = preload_modules()
    if not modules:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(modules)  # read when the forkserver starts: the first warm launch of the process
    return ctx


LauncherState = tuple[dict[str, str], str, int]
"""The launcher's environment, working directory and pid, as a warm rank receives them."""


def launcher_state() -> LauncherState:
    """What a rank must take from the launcher at launch time: its environment, directory and pid."""
    return dict(os.environ), os.getcwd(), os.getpid()


def adopt_launcher_state(state: LauncherState | None) -> None:
    """In the rank: the launcher's environment and working directory, as a spawned rank would have them (a
    forked one has the forkserver's, from when it started), and death with the launcher. ``None``: nothing to
    adopt (spawned: the rank's parent is the launcher)."""
    if state is None:
        return
    env, cwd, launcher = state
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    threading.Thread(target=_die_with, args=(launcher,), name="moonep-launcher-watch", daemon=True).start()


def _die_with(pid: int) -> None:
    """Block until process ``pid`` exits, then SIGKILL this one (a daemon thread of a warm rank)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3, or already gone: poll instead
        fd = None
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has exited
    else:
        while _alive(pid):
            time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
