"""A trainer that owns its process groups: it calls init_process_group itself, then hands them to collectives
(``init`` adopts the default group, ``from_group`` wraps a sub-group), and never destroys them: the exit must
still be clean. Run by test_from_group.py under torchrun; prints one RESULT line per rank."""

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import collectives


def _errors_before_and_after_init() -> list[str]:
    seen = []
    try:
        collectives.from_group(None)
    except RuntimeError as exc:
        seen.append(str(exc))
    dist.init_process_group("gloo")
    try:
        collectives.from_group("not a group")
    except ValueError as exc:
        seen.append(str(exc))
    return seen


def main() -> None:
    errors = _errors_before_and_after_init()
    rank, world = dist.get_rank(), dist.get_world_size()
    adopted = collectives.init(timeout=30)
    sub = dist.new_group(list(range(world)))
    comm = collectives.from_group(sub, timeout=30)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))  # torchtitan hands over ep_mesh
    on_mesh = collectives.from_group(mesh, timeout=30)
    mesh_sum = torch.tensor([float(rank)])
    on_mesh.all_reduce(mesh_sum)
    rows = torch.arange(4 * world, dtype=torch.float32) + 100 * rank
    got = torch.empty_like(rows)
    comm.all_to_all_single(got, rows, [4] * world, [4] * world)
    want = torch.cat([torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) + 100 * src for src in range(world)])
    total = torch.tensor([rank + 1.0])
    adopted.all_reduce(total)
    ranks = torch.empty(world, dtype=torch.int64)
    adopted.all_gather(ranks, torch.tensor([rank]))
    comm.barrier()
    adopted.close()
    comm.close()
    after = torch.ones(1)
    dist.all_reduce(after, group=sub)  # closing the wrappers left the trainer's groups alive
    result = {
        "rank": rank,
        "comm": [comm.rank, comm.world_size, adopted.world_size],
        "exchange_ok": bool(torch.equal(got, want)),
        "sum": total.item(),
        "gathered": ranks.tolist(),
        "group_alive_after_close": after.item(),
        "mesh": [on_mesh.rank, on_mesh.world_size, mesh_sum.item()],
        "errors": errors,
    }
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())


if __name__ == "__main__":
    main()  # no destroy_process_group: collectives' exit hook must keep the exit clean
