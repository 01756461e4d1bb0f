"""Acceptance (issue 5): a profile from ``moonep simulate calibrate`` predicts the project's own measured
``moonep train`` step time for the tiny K3 within 20%.

One run: calibrate (quick) on ``moonep train``'s default world size, measure the real training step (k3's
``run_bench``: one warm-up step, then the median over timed steps of the slowest rank's fwd + bwd + sync +
optimizer + balancing), calibrate again, and predict with ``moonep simulate run`` on the mean of the two
profiles. Calibrating on both sides of the measured run matters on this shared machine: the cores left to the
job change from one ten seconds to the next, and the two calibrations bound the run in time. A thread samples
the other sessions' running threads; when their load during the run differs from that during the calibrations
by more than one thread, the attempt is repeated once (the last attempt is asserted on).
"""
import json
import os
import statistics
import threading

import pytest

from moonep.cli import main

TOLERANCE = 0.20
FOREIGN_SHIFT = 1.0
"""Change, in running threads of other processes, between the calibrations and the measured run beyond which
the attempt is repeated once: other sessions share this machine and the cores they leave to the job are what
the calibration measures. Only their load is sampled for this, never the training's result."""


class ForeignLoad:
    """Samples, twice a second, how many threads of processes outside this test's tree are running."""

    def __init__(self):
        self.samples: dict[str, list[int]] = {}
        self.phase = "idle"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def mean(self, *phases: str) -> float:
        values = [v for p in phases for v in self.samples.get(p, [])]
        return statistics.fmean(values) if values else 0.0

    def _run(self):
        while not self._stop.wait(0.5):
            self.samples.setdefault(self.phase, []).append(_foreign_running())


def _foreign_running() -> int:
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stats[int(name)] = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
    ours, grew = {os.getpid()}, True
    while grew:  # this process and its descendants (the launched ranks)
        grew = False
        for pid, fields in stats.items():
            if pid not in ours and int(fields[1]) in ours:
                ours.add(pid)
                grew = True
    running = 0
    for pid in set(stats) - ours:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    running += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except OSError:
            continue
    return running


def _train_config():
    from k3.train import TrainConfig

    return TrainConfig()  # what `moonep train --preset tiny` runs: world size, global batch, sequence length


def _calibrate(tmp_path, tag: str, world: int, rows: int) -> dict:
    path = tmp_path / f"profile-{tag}.json"
    assert main(["simulate", "calibrate", "--quick", "--world-size", str(world), "--model", "k3-tiny",
                 "--micro-batch", str(rows), "--out", str(path)]) == 0
    return json.loads(path.read_text())


def _predict(tmp_path, profile: dict, tc) -> dict:
    hw, out = tmp_path / "mean-profile.json", tmp_path / "prediction.json"
    hw.write_text(json.dumps(profile))
    world = tc.world_size
    rc = main(["simulate", "run", "--model", "k3-tiny", "--hardware", str(hw), "--gpus", str(world),
               "--ep", str(world), "--seq-len", str(tc.seq_len), "--global-batch-tokens",
               str(tc.global_batch * tc.seq_len), "--micro-batch", str(tc.global_batch // world),
               "--recompute", "none", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["feasible"], res["reason"]
    return res


def _attempt(tmp_path, tc, load: ForeignLoad, n: int) -> tuple[float, dict, list]:
    from k3.bench import run_bench
    from simulator.calibrate import merge_profiles

    world, rows = tc.world_size, tc.global_batch // tc.world_size
    load.phase = f"cal{n}"
    before = _calibrate(tmp_path, "before", world, rows)
    load.phase = f"train{n}"
    measured = run_bench("tiny", (world,), steps=5)["results"][0]["step_s"]
    load.phase = f"cal{n}"
    after = _calibrate(tmp_path, "after", world, rows)
    load.phase = "idle"
    return measured, merge_profiles(before, after), [before["host"], after["host"]]


@pytest.mark.slow
@pytest.mark.host_noise
def test_calibrated_profile_predicts_tiny_k3_train_step(tmp_path):
    tc = _train_config()
    with ForeignLoad() as load:
        for attempt in range(2):
            measured, profile, hosts = _attempt(tmp_path, tc, load, attempt)
            cores = [h["effective_cores"] for h in hosts]
            others = (load.mean(f"cal{attempt}"), load.mean(f"train{attempt}"))
            print(f"\nattempt {attempt + 1}: effective cores {cores[0]:.2f} / {cores[1]:.2f}, other sessions' "
                  f"running threads {others[0]:.1f} calibrating / {others[1]:.1f} training")
            if abs(others[0] - others[1]) <= FOREIGN_SHIFT:
                break
    res = _predict(tmp_path, profile, tc)
    ratio = res["step_time_s"] / measured
    print(f"\ntiny K3, {tc.world_size} ranks: measured {measured:.3f} s/step, predicted {res['step_time_s']:.3f} "
          f"s/step, ratio {ratio:.3f} (effective cores {cores[0]:.2f} / {cores[1]:.2f}, other sessions' running "
          f"threads {others[0]:.1f} calibrating / {others[1]:.1f} training, attempt {attempt + 1}); "
          f"breakdown {json.dumps({k: round(v, 4) for k, v in res['breakdown'].items() if v})}")
    assert res["breakdown"]["host"] > 0 and res["breakdown"]["ep"] > 0 and res["breakdown"]["kda"] > 0
    assert abs(ratio - 1.0) <= TOLERANCE, f"predicted/measured = {ratio:.3f}"
