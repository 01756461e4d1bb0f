"""moonep on real ranks: one launched job per (backend, world size) runs the whole battery (battery.py,
battery_moe.py) and reports per check; gloo for world sizes 1-4, MPI for 2 and 3."""

import functools
import subprocess
import sys

import pytest

from collectives import launch
from tests.collectives.conftest import needs_mpi
from tests.moonep import battery

JOBS = [("torch", n) for n in (1, 2, 3, 4)] + [("mpi", 2), ("mpi", 3)]
CHECKS = (
    ["dispatch_" + k for k in ("random", "one_expert", "dup_rank", "masked", "skew", "padding", "static")]
    + ["dispatch_" + k for k in ("varlen", "k1")]
    + ["prefetch_reduce"]
    + ["autograd_" + k for k in ("random", "masked", "one_expert")]
    + [
        "classic_baseline_random",
        "classic_baseline_hot",
        "moe_random",
        "moe_all_to_experts_0_to_K",
        "moe_every_token_to_one_expert",
        "moe_varlen_shared",
        "moe_two_layers_shared_pools",
    ]
    + [
        "bad_" + c
        for c in (
            "id_too_big",
            "id_negative",
            "id_float",
            "hidden_shape",
            "hidden_dtype",
            "hidden_device",
            "s_gt_S",
            "tpe_mismatch",
            "total_differs",
            "nan_weights",
            "combine_shape",
        )
    ]
)


@functools.cache
def job(backend: str, world_size: int) -> dict:
    return launch(battery.run, world_size, backend=backend, timeout=30, job_timeout=240)


@pytest.mark.spawns
@pytest.mark.parametrize("backend,world_size", JOBS, ids=[f"{b}-{n}" for b, n in JOBS])
@pytest.mark.parametrize("check", CHECKS)
def test_moonep(backend, world_size, check):
    if backend == "mpi":
        needs_mpi()
    results = job(backend, world_size)
    assert check in results, f"battery did not run {check}"
    assert results[check] is None, results[check]


@pytest.mark.spawns
def test_battery_runs_exactly_the_listed_checks():
    assert set(job("torch", 2)) == set(CHECKS)


@pytest.mark.spawns
def test_import_is_lazy():
    code = "import sys, moonep, moonep.cli; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_buffer_rejects_bad_geometry():
    from moonep.buffer import Buffer

    class FakeComm:  # three ranks making the same call: the agreement gathers three copies of this rank's words
        world_size, rank = 3, 0

        def all_gather(self, out, inp, validate=True):
            out.copy_(inp.repeat(self.world_size))

    with pytest.raises(ValueError, match="multiple"):
        Buffer(FakeComm(), S=4, H=8, K=2, E=8)
    with pytest.raises(ValueError, match="S must be"):
        Buffer(FakeComm(), S=0, H=8, K=2, E=9)
    with pytest.raises(TypeError):  # sizes are keyword-only: no silent mix-up of their order
        Buffer(FakeComm(), 4, 8, 2, 9)


def test_receive_rows_match_moonep_worked_example():
    """MoonEP's own NvS example (S=4096, K=8, E=256, R=8, token_padding=128): 32768 + 127*64 -> 40960 rows."""
    from moonep.layout import num_recv_rows

    assert num_recv_rows(8 * 4096, 8, 8, 256 // 8, 128) == 40960  # what Buffer sizes its receive rows with


def test_moe_refuses_a_buffer_of_another_geometry():
    import moonep
    from moonep.buffer import Buffer

    class OneRank:
        world_size, rank = 1, 0

    buf = Buffer(OneRank(), S=8, H=4, K=2, E=4, token_padding=2)
    assert moonep.MoE(OneRank(), H=4, F=4, E=4, K=2, S=8, buffer=buf).buffer is buf  # padding: the buffer's
    with pytest.raises(ValueError, match="differs from the layer"):
        moonep.MoE(OneRank(), H=4, F=4, E=4, K=2, S=16, buffer=buf)
    with pytest.raises(ValueError, match="differs from the layer"):
        moonep.MoE(OneRank(), H=4, F=4, E=4, K=2, S=8, token_padding=4, buffer=buf)


@pytest.mark.parametrize(
    "extra,named",
    [
        (["--world-size", "0"], "--world-size must be >= 1, got 0"),
        (["--maxvio", "abc"], "--maxvio: 'abc' is not a number"),
        (["--maxvio", "0,-1"], "--maxvio: -1 must be a finite number >= 0"),
        (["--maxvio", ","], "--maxvio: no value given"),
    ],
)
def test_bench_ep_refuses_bad_arguments_in_one_line(capsys, extra, named):
    """Catches: a traceback for --maxvio abc / --world-size 0, and a negative maxvio benchmarked as if it meant
    something."""
    from moonep.console import main

    assert main(["bench", "ep", "--quick", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moonep bench ep: {named}") and "Traceback" not in err, err


@pytest.mark.spawns
def test_bench_quick_schema(tmp_path):
    """`moonep bench ep --quick` writes the stable JSON schema and a plot; ours (cost-aware, the default) stays
    inside its row bound and never computes more rows than the classic dispatcher's hottest rank."""
    import json

    from moonep.console import main

    out, png = tmp_path / "ep.json", tmp_path / "ep.png"
    assert (
        main(["bench", "ep", "--world-size", "2", "--maxvio", "0,4", "--quick", "--json", str(out), "--plot", str(png)])
        == 0
    )
    report = json.loads(out.read_text())
    keys = {
        "maxvio",
        "cap",
        "ours_max_rows",
        "baseline_max_rows",
        "ours_layer_s",
        "baseline_layer_s",
        "ours_peak_bytes",
        "baseline_peak_bytes",
        "ours_slack",
        "ours_rows_bound",
        "ours_replicas",
        "ours_weight_bytes",
    }
    assert [e["maxvio"] for e in report["results"]] == [0.0, 4.0]
    assert report["config"]["balance"]["mode"] == "cost" and report["config"]["cost_model"]["row_seconds"] > 0
    for e in report["results"]:
        assert keys <= set(e)
        assert e["cap"] <= e["ours_max_rows"] <= min(e["ours_rows_bound"], e["baseline_max_rows"])
        assert 0 <= e["ours_slack"] <= report["config"]["balance"]["max_slack"]
        assert e["ours_host_reads_per_layer"] == 1  # the step's split table, nothing else (the budget)
        assert e["baseline_max_rows"] >= e["cap"]
    lo, hi = report["results"]
    assert report["ours_max_over_min"] == max(e["ours_layer_s"] for e in report["results"]) / min(
        e["ours_layer_s"] for e in report["results"]
    )
    assert lo["ratio_vs_classic_flat"] == lo["ours_layer_s"] / lo["baseline_layer_s"]
    assert hi["ratio_vs_classic_flat"] == hi["ours_layer_s"] / lo["baseline_layer_s"]
    assert hi["baseline_max_rows"] > lo["baseline_max_rows"]
    # measured peak bytes: the baseline's hottest rank allocates more rows with skew; ours is bounded by the rows
    # its slack allows (the static buffers are sized for max_slack), whatever the skew
    assert hi["baseline_peak_bytes"] > 1.1 * lo["baseline_peak_bytes"]
    ours = (hi["ours_peak_bytes"], lo["ours_peak_bytes"])
    assert max(ours) <= (1 + report["config"]["balance"]["max_slack"]) * 1.1 * min(ours)
    assert png.stat().st_size > 0
