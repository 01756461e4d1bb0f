"""moonep.compat.deepep.Buffer, called the way vLLM / Megatron call DeepEP's normal mode, on real gloo ranks.

Checks mirror DeepEP's own intranode test: layout against a Python reference, provenance of received rows,
local expert ids, per-expert counts, cached-handle dispatch, and combine = x * (ranks the token visited).
"""

import functools

import pytest
import torch

from collectives import launch
from tests.distributed import run_checks

E_PER_RANK, K, T, H = 3, 3, 11, 5


def _routing(rank: int, R: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    E = E_PER_RANK * R
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx[::4, -1] = -1  # masked slots, as DeepEP tests punch holes in topk_idx
    weights = torch.rand(T, K, generator=gen)
    return idx, weights, E


def _layout_reference(idx, E, R):
    in_rank = torch.zeros(idx.shape[0], R, dtype=torch.bool)
    for t, row in enumerate(idx.tolist()):
        for e in row:
            if e >= 0:
                in_rank[t, e // (E // R)] = True
    return in_rank


def deepep_checks(comm):
    from moonep.compat.deepep import Buffer

    R, r = comm.world_size, comm.rank
    buf = Buffer(comm)
    idx, weights, E = _routing(r, R)
    x = torch.full((T, H), float(r)) + torch.arange(T, dtype=torch.float32)[:, None] / 100  # sender + token id
    n_rank, n_rdma, n_expert, in_rank, event = buf.get_dispatch_layout(idx, E)
    recv = {}

    def layout():
        ref = _layout_reference(idx, E, R)
        if n_rdma is not None or not torch.equal(in_rank, ref) or not torch.equal(n_rank, ref.sum(0).int()):
            return "layout differs from the Python reference"
        want = torch.bincount(idx[idx >= 0], minlength=E).int()
        return None if torch.equal(n_expert, want) else "num_tokens_per_expert differs"

    def dispatch():
        event.current_stream_wait()
        out = buf.dispatch(
            x,
            num_tokens_per_rank=n_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=n_expert,
            topk_idx=idx,
            topk_weights=weights,
        )
        recv.update(zip(("x", "idx", "w", "per_expert", "handle"), out[:5]))
        prefix = recv["handle"][0]
        starts = [0] + prefix[:, r].tolist()
        for src in range(R):  # provenance: each source's block holds that source's rows, in token order
            block = recv["x"][starts[src] : starts[src + 1]]
            if block.numel() and not torch.all(block.floor() == src):
                return f"rows from rank {src} are not where rank_prefix_matrix says"
        everyone = [_routing(i, R)[0] for i in range(R)]
        want_rows = sum(int(_layout_reference(ix, E, R)[:, r].sum()) for ix in everyone)
        if recv["x"].shape[0] != want_rows:
            return f"received {recv['x'].shape[0]} rows, expected {want_rows}"
        local = recv["idx"]
        if ((local < -1) | (local >= E_PER_RANK)).any():
            return "recv_topk_idx outside [-1, local experts)"
        want_counts = sum(((ix >= r * E_PER_RANK) & (ix < (r + 1) * E_PER_RANK)).sum() for ix in everyone)
        return None if sum(recv["per_expert"]) == int(want_counts) else "per-expert counts do not add up"

    def cached():
        again = buf.dispatch(x, handle=recv["handle"])
        return None if torch.equal(again[0], recv["x"]) and again[1] is None else "cached dispatch differs"

    def combine():
        out, w, _ = buf.combine(recv["x"], recv["handle"], topk_weights=recv["w"])
        visits = in_rank.sum(1, keepdim=True).float()
        if not torch.allclose(out, x * visits, atol=5e-6):
            return "combine(dispatch(x)) != x * ranks visited"
        return None if torch.allclose(w, weights * visits, atol=1e-6) else "combined weights wrong"

    def expert_round_trip():  # the caller applies weights per local expert, as a DeepEP user does
        y = torch.zeros_like(recv["x"])
        for k in range(K):
            mine = recv["idx"][:, k] >= 0
            y[mine] += recv["w"][mine, k : k + 1] * 2 * recv["x"][mine]
        out, _, _ = buf.combine(y, recv["handle"])
        want = 2 * x * torch.where(idx >= 0, weights, torch.zeros_like(weights)).sum(1, keepdim=True)
        return None if torch.allclose(out, want, atol=1e-5) else "weighted expert round trip wrong"

    return run_checks(
        comm,
        {
            "layout": layout,
            "dispatch": dispatch,
            "cached": cached,
            "combine": combine,
            "expert_round_trip": expert_round_trip,
        },
    )


@functools.lru_cache(maxsize=None)
def job(world_size):
    return launch(deepep_checks, world_size, timeout=30, job_timeout=120)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("check", ["layout", "dispatch", "cached", "combine", "expert_round_trip"])
def test_deepep_surface(world_size, check):
    assert job(world_size)[check] is None, job(world_size)[check]


def one_rank_bad_input(comm):
    from moonep.compat.deepep import Buffer

    buf, problems = Buffer(comm), []
    for call, needle in (
        (lambda: buf.get_dispatch_layout(torch.tensor([[0, 7]]), 4), "outside"),
        (lambda: buf.get_dispatch_layout(torch.tensor([[0.0, 1.0]]), 4), "integer"),
        (lambda: buf.dispatch(torch.zeros(1, 2)), "fresh dispatch needs"),
    ):
        try:
            call()
            problems.append(f"no error for {needle!r}")
        except ValueError as exc:
            problems.append(None if needle in str(exc) else str(exc))
    return problems


def test_bad_input_is_refused():
    from moonep.compat.deepep import Buffer

    with pytest.raises(ValueError, match="normal mode"):
        Buffer(None, low_latency_mode=True)
    with pytest.raises(ValueError, match="Communicator or a torch ProcessGroup"):
        Buffer(object())
    assert launch(one_rank_bad_input, 1, timeout=30) == [None, None, None]
