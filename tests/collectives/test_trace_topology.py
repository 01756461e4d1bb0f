"""Tracing (off by default, JSON lines when on) and Topology (JSON, flags, detection, bad values)."""

import argparse
import json
import os

import pytest
import torch

from collectives import Topology, launch, read_trace


def traced_work(comm):
    x = torch.ones(comm.world_size * 2, 4)
    comm.all_to_all_single(torch.empty_like(x), x)
    comm.all_reduce(torch.ones(8))
    comm.barrier()
    sub = comm.split(0)
    sub.all_reduce(torch.ones(1))
    return comm.tracer is not None


def untraced_work(comm):
    comm.all_reduce(torch.ones(1))
    return comm.tracer is None


@pytest.mark.spawns
def test_trace_records_every_op_per_rank(tmp_path):
    assert launch(traced_work, 2, trace_dir=str(tmp_path)) is True
    files = sorted(os.listdir(tmp_path))
    assert files == ["rank0.jsonl", "rank1.jsonl"]
    for rank, name in enumerate(files):
        records = read_trace(tmp_path / name)
        ops = [r["op"] for r in records if r["op"] != "validate"]
        assert ops == ["all_to_all_single", "all_reduce", "barrier", "all_reduce"], ops
        assert [r["seq"] for r in records] == list(range(len(records)))  # one sequence, shared by sub-groups
        for r in records:
            assert set(r) == {"op", "bytes", "group", "rank", "seq", "t_enter", "t_exit", "ok", "step"}
            assert r["rank"] == rank and r["group"] == [0, 1] and r["ok"] is True
            assert r["t_exit"] >= r["t_enter"]
        a2a = next(r for r in records if r["op"] == "all_to_all_single")
        assert a2a["bytes"] == 2 * 2 * 4 * 4


@pytest.mark.spawns
def test_trace_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONEP_TRACE_DIR", str(tmp_path / "env"))
    launch(untraced_work, 2)  # the env turns tracing on in every spawned rank
    assert sorted(os.listdir(tmp_path / "env")) == ["rank0.jsonl", "rank1.jsonl"]


@pytest.mark.spawns
def test_trace_off_by_default(monkeypatch):
    monkeypatch.delenv("MOONEP_TRACE_DIR", raising=False)
    assert launch(untraced_work, 1) is True


def test_topology_json_round_trip_and_queries(tmp_path):
    topo = Topology(num_nodes=2, ranks_per_node=4, inter_bw_gbps=25.0, name="two boxes")
    path = tmp_path / "topo.json"
    topo.to_json(path)
    again = Topology.from_json(path)
    assert again == topo and again.world_size == 8
    assert [again.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert again.bandwidth_gbps(0, 3) == topo.intra_bw_gbps and again.bandwidth_gbps(3, 4) == 25.0
    assert again.transfer_seconds(0, 0, 1e9) == 0.0
    assert again.transfer_seconds(0, 4, 25e9) == pytest.approx(1.0 + 10e-6)
    with pytest.raises(ValueError, match="outside"):
        again.node_of(8)


def test_topology_from_flags_overrides_file(tmp_path):
    path = tmp_path / "t.json"
    Topology(num_nodes=4, ranks_per_node=8).to_json(path)
    parser = argparse.ArgumentParser()
    Topology.add_arguments(parser)
    args = parser.parse_args(["--topology", str(path), "--inter-bw-gbps", "12.5"])
    topo = Topology.from_args(args)
    assert (topo.num_nodes, topo.ranks_per_node, topo.inter_bw_gbps) == (4, 8, 12.5)
    assert Topology.from_args(parser.parse_args(["--nodes", "2"]), world_size=6).ranks_per_node == 3


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"num_nodes": 0}, "num_nodes"),
        ({"ranks_per_node": 1.5}, "ranks_per_node"),
        ({"inter_bw_gbps": 0}, "inter_bw_gbps"),
        ({"intra_latency_us": -1}, "intra_latency_us"),
    ],
)
def test_topology_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        Topology(**bad)


def test_topology_rejects_unknown_json_fields(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"num_nodes": 2, "gpus": 8}))
    with pytest.raises(ValueError, match="unknown Topology field"):
        Topology.from_json(path)


def test_topology_detect_without_gpu():
    topo = Topology.detect(world_size=4)
    if topo.name.startswith("nvml"):
        pytest.skip("this machine has an NVIDIA driver; the CPU fallback is not used")
    assert (topo.num_nodes, topo.ranks_per_node) == (1, 4)
