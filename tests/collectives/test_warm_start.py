"""Warm ranks (``collectives.warm_start``): forked from a forkserver that imported torch once, yet started with
what a spawned rank gets (the launcher's environment and directory at launch time) and the same results."""

import os

import pytest
import torch

from collectives import launch
from collectives.warm_start import PRELOAD_ENV, preload_modules, start_context

pytestmark = pytest.mark.spawns


def _what_a_rank_sees(comm, tag: str) -> dict:
    t = torch.full((3,), float(comm.rank + 1))
    comm.all_reduce(t)
    return {"sum": t.tolist(), "tag": os.environ.get("MOONEP_TEST_TAG"), "arg": tag, "cwd": os.getcwd()}


@pytest.mark.parametrize("preload", ["", "torch,collectives"])
def test_warm_and_spawned_ranks_see_the_same(preload, monkeypatch, tmp_path):
    monkeypatch.setenv(PRELOAD_ENV, preload)
    assert start_context().get_start_method() == ("forkserver" if preload else "spawn")
    for i in range(2):  # the second launch reuses the forkserver: it must see the environment as it is now
        monkeypatch.setenv("MOONEP_TEST_TAG", f"launch {i}")
        monkeypatch.chdir(tmp_path)
        got = launch(_what_a_rank_sees, 2, timeout=20, job_timeout=60, tag=str(i))
        assert got == {"sum": [3.0, 3.0, 3.0], "tag": f"launch {i}", "arg": str(i), "cwd": str(tmp_path)}


def test_the_preload_list_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(PRELOAD_ENV, " torch , ,collectives")
    assert preload_modules() == ["torch", "collectives"]
    monkeypatch.delenv(PRELOAD_ENV)
    assert preload_modules() == [] and start_context().get_start_method() == "spawn"
