"""Telemetry: NVML when it works, CPU/load fallback when pynvml is missing or NVML fails; sampling off-thread."""
import json
import sys
import threading
import time
import types

import pytest

from tools.telemetry import THROTTLE_BITS, Sampler, open_source


class FakeNVMLError(Exception):
    pass


def fake_pynvml(init_fails=False):
    nv = types.ModuleType("pynvml")
    nv.NVMLError = FakeNVMLError
    nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM, nv.NVML_TEMPERATURE_GPU = 0, 1, 0

    def init():
        if init_fails:
            raise FakeNVMLError("Driver Not Loaded")

    def unsupported(*a):
        raise FakeNVMLError("Not Supported")

    nv.nvmlInit, nv.nvmlShutdown = init, lambda: None
    nv.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    nv.nvmlDeviceGetMaxClockInfo = lambda h, c: 1980
    nv.nvmlDeviceGetClockInfo = lambda h, c: 1410 if c == 0 else 2619
    nv.nvmlDeviceGetTemperature = lambda h, s: 71
    nv.nvmlDeviceGetPowerUsage = lambda h: 512000
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x4 | 0x40
    nv.nvmlDeviceGetTotalEccErrors = unsupported
    return nv


def test_nvml_fields_and_throttle_names(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    sample = open_source(0).sample()
    assert sample["sm_clock_mhz"] == 1410 and sample["max_sm_clock_mhz"] == 1980 and sample["power_w"] == 512.0
    assert sample["throttle_names"] == ["sw_power_cap", "hw_thermal"]
    assert sample["ecc_uncorrected"] is None  # unsupported counters are null, not errors


def test_falls_back_on_nvml_error_and_missing_module(monkeypatch):
    """Catches: a CPU-only machine crashing the training job because NVML is absent."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_fails=True))
    src = open_source(0)
    assert src.name == "cpu" and "Driver Not Loaded" in src.reason
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    src = open_source(0)
    assert src.name == "cpu" and "nvidia-ml-py" in src.reason
    sample = src.sample()
    assert sample["process_cpu_s"] >= 0 and "load_1m" in sample


def test_sampler_runs_off_thread_and_writes_jsonl(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    s = Sampler(3, tmp_path, interval_s=0.01)
    s.start()
    names = [t.name for t in threading.enumerate()]
    time.sleep(0.1)
    s.stop()
    s.start()  # restartable (the benchmark alternates)
    time.sleep(0.03)
    s.close()
    assert "telemetry-rank3" in names
    lines = [json.loads(x) for x in (tmp_path / "telemetry_rank3.jsonl").read_text().splitlines()]
    assert len(lines) == s.samples >= 4 and {x["source"] for x in lines} == {"cpu"}
    assert all(x["rank"] == 3 for x in lines) and s.cpu_s > 0


def test_sampler_checks_arguments():
    with pytest.raises(ValueError, match="interval_s"):
        Sampler(0, None, interval_s=0)
    with pytest.raises(ValueError, match="prefer"):
        Sampler(0, None, prefer="gpu")


def _real_nvml() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # ImportError, NVMLError (no driver / no GPU)
        return False


@pytest.mark.skipif(not _real_nvml(), reason="needs nvidia-ml-py and a GPU driver (runs when a GPU is lent)")
def test_real_nvml_samples_a_gpu(tmp_path):
    """The real library on a real GPU: the sampler picks NVML and the clocks and temperature read sane values."""
    s = Sampler(0, tmp_path, interval_s=0.02, device_index=0, prefer="nvml")
    s.start()
    time.sleep(0.2)
    s.close()
    lines = [json.loads(x) for x in (tmp_path / "telemetry_rank0.jsonl").read_text().splitlines()]
    assert s.source == "nvml" and len(lines) >= 3 and {x["source"] for x in lines} == {"nvml"}
    first = lines[0]
    assert 0 < first["sm_clock_mhz"] <= (first["max_sm_clock_mhz"] or 10_000)
    assert first["mem_clock_mhz"] > 0 and 0 < first["temperature_c"] < 120
    assert first["throttle_names"] is None or set(first["throttle_names"]) <= set(THROTTLE_BITS.values())
