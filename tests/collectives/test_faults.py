"""Injected link delays: parsed strictly, spent inside the op on the sending rank only, visible in the trace."""

import pytest
import torch

from collectives import launch, read_trace
from collectives.faults import parse_link_delays


def test_parse_link_delays():
    assert parse_link_delays("src=0,dst=1,ms=5; src=2,dst=3,ms=0.5") == {(0, 1): 0.005, (2, 3): 0.0005}
    assert parse_link_delays("") == {}


@pytest.mark.parametrize(
    "spec,match",
    [
        ("src=0,dst=1", "exactly src"),
        ("src=0,dst=0,ms=1", "different ranks"),
        ("src=a,dst=1,ms=1", "integers"),
        ("src=0,dst,ms=1", "key=value"),
        ("src=0,dst=1,ms=-2", "ms >= 0"),
    ],
)
def test_parse_link_delays_rejects(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_link_delays(spec)


def delayed_exchange(comm, steps: int):
    w = comm.world_size
    for step in range(steps):
        comm.tracer.step = step
        x = torch.ones(w * 4, 8)
        comm.all_to_all_single(torch.empty_like(x), x)
        if comm.rank == 0:
            comm.send(torch.ones(4), 1)
        elif comm.rank == 1:
            comm.recv(torch.empty(4), 0)
    comm.tracer.record_event("forward", 1.0, 2.0, layer="moe")
    return sorted(comm.link_delays.items())


@pytest.mark.spawns
def test_link_delay_slows_only_the_sender(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONEP_INJECT_LINK_DELAY", "src=1,dst=2,ms=60")
    assert launch(delayed_exchange, 3, trace_dir=str(tmp_path), steps=4) == [((1, 2), 0.06)]
    own = {}
    for rank in range(3):
        records = read_trace(tmp_path / f"rank{rank}.jsonl")
        a2a = [r for r in records if r["op"] == "all_to_all_single"]
        assert [r["step"] for r in a2a] == [0, 1, 2, 3]
        own[rank] = list(a2a)
        event = records[-1]
        assert event["op"] == "forward" and event["layer"] == "moe" and event["step"] == 3
    # Rank 1 enters on time but spends the delay inside its op; everyone exits late because of it.
    for step in range(4):
        enters = [own[r][step]["t_enter"] for r in range(3)]
        exits = [own[r][step]["t_exit"] for r in range(3)]
        assert exits[1] - enters[1] >= 0.06
        assert min(exits) - max(enters) >= 0.03  # nobody finished before rank 1's data arrived
    sends = [r for r in read_trace(tmp_path / "rank0.jsonl") if r["op"] == "send"]
    assert all(r["t_exit"] - r["t_enter"] < 0.06 for r in sends)  # 0 -> 1 is not a delayed link
    assert [r["peer"] for r in sends] == [1] * 4  # point-to-point records name the other side
    recvs = [r for r in read_trace(tmp_path / "rank1.jsonl") if r["op"] == "recv"]
    assert [r["peer"] for r in recvs] == [0] * 4
