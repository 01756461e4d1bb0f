"""Telemetry: NVML when it works, CPU/load fallback when pynvml is missing or NVML fails; sampling off-thread."""

import json
import sys
import threading
import time
import types

import pytest

from tools import telemetry
from tools.telemetry import THROTTLE_BITS, Sampler, open_source, pci_bus_id


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


def test_pci_bus_id_is_nvml_spelling():
    assert pci_bus_id(0, 0x1B, 0) == "00000000:1B:00.0"
    assert pci_bus_id(0x10002, 0xFF, 0x1F, 7) == "00010002:FF:1F.7"
    with pytest.raises(ValueError, match="PCI"):
        pci_bus_id(0, 0x100, 0)  # a bus is one byte
    with pytest.raises(ValueError, match="PCI"):
        pci_bus_id(0, 0, 32)  # 5 bits of device


def _props(**fields):
    return types.SimpleNamespace(**fields)


def test_nvml_picks_the_cuda_device_by_pci_bus_id(monkeypatch):
    """Catches: sampling NVML GPU <cuda index> when CUDA_VISIBLE_DEVICES=3,1 makes cuda:0 NVML's GPU 3."""
    nv = fake_pynvml()
    asked = []
    nv.nvmlDeviceGetHandleByPciBusId = lambda bus: asked.append(bus) or ("gpu", bus)
    nv.nvmlDeviceGetHandleByIndex = lambda i: pytest.fail("an NVML index is not the CUDA device")
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setattr(
        telemetry,
        "_cuda_properties",
        lambda i: _props(pci_domain_id=0, pci_bus_id=0x9A + i, pci_device_id=0, uuid="ab-cd"),
    )
    sample = open_source(1).sample()
    assert asked == ["00000000:9B:00.0"] and sample["gpu"] == "pci 00000000:9B:00.0"


def test_nvml_falls_back_to_uuid_then_index(monkeypatch):
    """A torch without the PCI fields matches by UUID; a torch without CUDA leaves only the NVML index."""
    nv = fake_pynvml()
    nv.nvmlDeviceGetHandleByUUID = lambda u: ("gpu", u)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setattr(telemetry, "_cuda_properties", lambda i: _props(uuid="58f1dc6f-0000"))
    assert open_source(0).sample()["gpu"] == "uuid GPU-58f1dc6f-0000"
    monkeypatch.setattr(telemetry, "_cuda_properties", lambda i: None)
    assert open_source(2).sample()["gpu"].startswith("nvml index 2")


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
    for interval in (0, float("nan"), float("inf"), 1e300):  # inf killed the sampling thread with a traceback
        with pytest.raises(ValueError, match=r"interval_s must be a number of seconds in \(0, 31536000\]"):
            Sampler(0, None, interval_s=interval)
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


@pytest.mark.gpu
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


def _real_nvml_and_cuda() -> bool:
    try:
        import torch

        return _real_nvml() and torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _real_nvml_and_cuda(), reason="needs nvidia-ml-py, a GPU driver and a CUDA torch")
def test_real_nvml_samples_the_cuda_device_not_the_nvml_index():
    """The NVML handle picked for cuda:<last> is that device: same UUID as torch reports for it."""
    import pynvml
    import torch

    index = torch.cuda.device_count() - 1
    source = open_source(index, prefer="nvml")
    try:
        assert source.name == "nvml", getattr(source, "reason", "")
        nvml_uuid = pynvml.nvmlDeviceGetUUID(source.handle)
        nvml_uuid = nvml_uuid.decode() if isinstance(nvml_uuid, bytes) else nvml_uuid
        torch_uuid = str(torch.cuda.get_device_properties(index).uuid)
        assert nvml_uuid.removeprefix("GPU-") == torch_uuid.removeprefix("GPU-"), (source.gpu, nvml_uuid, torch_uuid)
        assert source.gpu.startswith(("pci ", "uuid ")), source.gpu
    finally:
        source.close()
