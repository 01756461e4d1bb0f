"""collectives: one ``Communicator`` face over torch.distributed, mpi4py and NVSHMEM.

Everything distributed in the toolkit takes a ``Communicator``; nothing else calls an engine directly.

    from collectives import launch

    def work(comm):
        ...  # comm.rank, comm.world_size, comm.all_to_all_single(out, inp, out_splits, in_splits), ...

    if __name__ == "__main__":
        print(launch(work, world_size=4))          # 4 local ranks over gloo; same script under torchrun/mpiexec

    comm = from_group(group)                       # or wrap a process group your trainer already made
"""

from collectives.base import REDUCE_OPS, CollectiveError, Communicator, Pending
from collectives.launch import LaunchError, LaunchOptions, external_launcher, init, launch, local_rank, rank_device
from collectives.topology import Topology
from collectives.torch_backend import from_group
from collectives.trace import TRACE_ENV, Tracer, read_trace

__all__ = [
    "Communicator",
    "CollectiveError",
    "Pending",
    "REDUCE_OPS",
    "launch",
    "init",
    "from_group",
    "LaunchError",
    "LaunchOptions",
    "external_launcher",
    "local_rank",
    "rank_device",
    "Topology",
    "Tracer",
    "read_trace",
    "TRACE_ENV",
]
