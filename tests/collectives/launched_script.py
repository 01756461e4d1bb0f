"""One user script, five ways to start it (see test_launchers.py): python, torchrun, mpiexec."""

import json
import os
import sys

import torch

from collectives import launch


def work(comm):
    t = torch.tensor([float(comm.rank + 1)])
    comm.all_reduce(t)
    return {"rank": comm.rank, "world_size": comm.world_size, "backend": comm.backend, "sum": t.item()}


if __name__ == "__main__":
    result = launch(work, 2, backend=sys.argv[1], timeout=30, job_timeout=120)
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())  # one write: ranks share stdout
