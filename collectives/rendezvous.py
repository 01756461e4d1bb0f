"""Rendezvous stores that keep to the caller's timeout and name the address when they cannot.

torch's ``TCPStore`` client reads the server's first answer with no limit (``TCPStore::ping`` calls ``recv``
without a timeout, whatever ``timeout`` the store was given): when another process holds ``MASTER_PORT`` and
accepts connections without speaking the store protocol, or only listens (the kernel completes the handshake for
it), the client blocks there for ever, while rank 0, which fails to listen, names EADDRINUSE at once. So the store
is made on a helper thread and waited for with the timeout; a store that is not up by then, or whose making
failed, is a ``CollectiveError`` naming ``host:port`` on every rank. The thread left behind is a daemon blocked in
``recv`` without the GIL: it costs nothing and ends with the process.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]  # public API; torch re-exports it without `as`
from torch.distributed.distributed_c10d import Store
from torch.distributed.rendezvous import rendezvous

from collectives.errors import CollectiveError

if TYPE_CHECKING:  # optional: mpi4py (the mpi extra), for its type only; importing it at run time initialises MPI
    from mpi4py import MPI


def bounded_store(make: Callable[[], Store], host: str, port: int | str, rank: int, timeout: float) -> Store:
    """``make()``'s store if it is up within ``timeout`` seconds, else a ``CollectiveError`` naming the address."""
    made: dict = {}

    def run() -> None:
        try:
            made["store"] = make()
        except BaseException as exc:  # handed to the waiting thread, which names the address
            made["error"] = exc

    thread = threading.Thread(target=run, name="moonep-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout)
    if "store" in made:
        return made["store"]
    where = f"rendezvous with the store at {host}:{port} failed on rank {rank}"
    if "error" in made:
        exc = made["error"]
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CollectiveError(f"{where}: {type(exc).__name__}: {reason}", op="rendezvous") from exc
    raise CollectiveError(
        f"{where}: the store was not up within its {timeout:g}s timeout: nothing there answered (another process "
        f"may hold the port without serving it, or the rank serving it never started it), or not every rank came",
        op="rendezvous",
    )


def env_store(rank: int, world_size: int, timeout: float) -> Store:
    """The store of torch's ``env://`` rendezvous (``MASTER_ADDR``/``MASTER_PORT``, torchrun's agent store where
    torchrun says so), made within ``timeout`` seconds."""
    host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]

    def make() -> Store:
        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=timedelta(seconds=timeout)))
        return store

    return bounded_store(make, host, port, rank, timeout)


def mpi_store(world: MPI.Intracomm, timeout: float) -> Store:
    """A store for torch.distributed under mpiexec (``world``: mpi4py's ``COMM_WORLD``): rank 0 serves one on a
    port the OS picks and broadcasts where; the others connect within ``timeout`` seconds."""
    rank, size = world.Get_rank(), world.Get_size()
    if rank == 0:  # port 0: the OS picks a free port, which rank 0 then tells everyone
        store = TCPStore(
            socket.gethostname(), 0, size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
        )
        world.bcast((socket.gethostname(), store.port), root=0)
        return store
    host, port = world.bcast(None, root=0)
    client = functools.partial(TCPStore, host, port, size, is_master=False, timeout=timedelta(seconds=timeout))
    return bounded_store(client, host, port, rank, timeout)
