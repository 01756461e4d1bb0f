"""Hardware telemetry sampled off the training thread, written as JSON lines next to the trace.

``Sampler(rank, out_dir, interval_s).start()`` runs a daemon thread that every ``interval_s`` appends one JSON
object to ``<out_dir>/telemetry_rank<rank>.jsonl``. The training thread never samples or writes: it only
starts and stops the thread, so the cost it sees is the GIL hand-offs of a short sample (measured by
``moonep bench telemetry``).

Sources, chosen once at ``start``:

- ``nvml`` (``pip install nvidia-ml-py``; imported lazily): SM and memory clocks and the SM maximum,
  temperature, power, the clock-event (throttle) reasons bitmask with names, volatile uncorrected ECC errors,
  PCIe replay counter, NVLink replay errors summed over links. A counter the GPU does not support is null.
  The GPU is the one the rank uses: CUDA device ``device_index`` (default ``LOCAL_RANK``) is looked up in NVML by
  its PCI bus id from ``torch.cuda.get_device_properties`` (else by UUID), never by NVML index, because NVML
  numbers all GPUs in its own order while CUDA numbers the visible ones (``CUDA_VISIBLE_DEVICES`` reorders and
  hides, ``CUDA_DEVICE_ORDER`` defaults to fastest first). Only without CUDA in torch is the index used as an
  NVML index. ``gpu`` in each record says which GPU was sampled and how it was found.
- ``cpu`` when pynvml is missing or NVML fails (``ImportError`` / ``pynvml.NVMLError``; the reason is kept in
  every record): this process's CPU seconds and CPU share since the last sample, and the 1-minute load average.

Record fields: ``t`` (``time.time()``), ``rank``, ``source``, then the source's fields.
"""

from __future__ import annotations

import json
import os
import threading
import time

from moonep_base import seconds_problem

# NVML clock-event reason bits (nvmlClocksEventReason*): the ones that mean "slowed down" are the point
THROTTLE_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clock",
}


def pci_bus_id(domain: int, bus: int, device: int, function: int = 0) -> str:
    """The ``domain:bus:device.function`` string NVML's ``busId`` holds and ``nvmlDeviceGetHandleByPciBusId``
    accepts: hexadecimal, 8-digit domain, 2-digit bus and device (``00000000:1B:00.0``)."""
    if not (0 <= domain <= 0xFFFFFFFF and 0 <= bus <= 0xFF and 0 <= device <= 0x1F and 0 <= function <= 7):
        raise ValueError(f"not a PCI address: domain={domain} bus={bus} device={device} function={function}")
    return f"{domain:08X}:{bus:02X}:{device:02X}.{function:X}"


def _cuda_properties(index: int):
    """torch's properties of CUDA device ``index``, or None without a CUDA torch or device (then NVML indexes)."""
    try:
        import torch  # heavy: torch, only to match the GPU by PCI bus id (this module imports only the stdlib)

        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_properties(index)
    except Exception:  # a CPU build, a driver problem: fall back rather than fail the training job
        return None


def _nvml_handle(nv, index: int) -> tuple[object, str]:
    """(NVML handle, how it was found) for CUDA device ``index``: by PCI bus id, else UUID, else NVML index."""
    props = _cuda_properties(index)
    if props is not None:
        fields = [getattr(props, f, None) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
        if None not in fields:  # the fields exist in torch builds that expose cudaDeviceProp's PCI location
            bus_id = pci_bus_id(*(int(f) for f in fields))
            return nv.nvmlDeviceGetHandleByPciBusId(bus_id), f"pci {bus_id}"
        uuid = getattr(props, "uuid", None)
        if uuid is not None and hasattr(nv, "nvmlDeviceGetHandleByUUID"):
            text = str(uuid)
            text = text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"  # NVML's spelling of a UUID
            return nv.nvmlDeviceGetHandleByUUID(text), f"uuid {text}"
    return nv.nvmlDeviceGetHandleByIndex(index), f"nvml index {index} (no CUDA device in torch to match)"


class _NvmlSource:
    name = "nvml"

    def __init__(self, index: int):
        import pynvml  # optional: nvidia-ml-py (the gpu extra)

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handle, self.gpu = _nvml_handle(pynvml, index)
        self.max_sm = self._try(pynvml.nvmlDeviceGetMaxClockInfo, self.handle, pynvml.NVML_CLOCK_SM)

    def _try(self, fn, *args):
        try:
            return fn(*args)
        except self.nv.NVMLError:  # not supported on this GPU / driver: null, not an error
            return None

    def sample(self) -> dict:
        nv, h = self.nv, self.handle
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        reasons = self._try(reasons_fn, h) if reasons_fn else None
        power = self._try(nv.nvmlDeviceGetPowerUsage, h)
        ecc = (
            self._try(
                nv.nvmlDeviceGetTotalEccErrors,
                h,
                getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                getattr(nv, "NVML_VOLATILE_ECC", 0),
            )
            if hasattr(nv, "nvmlDeviceGetTotalEccErrors")
            else None
        )
        return {
            "gpu": self.gpu,
            "sm_clock_mhz": self._try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
            "mem_clock_mhz": self._try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM),
            "max_sm_clock_mhz": self.max_sm,
            "temperature_c": self._try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
            "power_w": None if power is None else power / 1000.0,
            "throttle_reasons": reasons,
            "throttle_names": None if reasons is None else [n for b, n in THROTTLE_BITS.items() if reasons & b],
            "ecc_uncorrected": ecc,
            "pcie_replay": self._try(getattr(nv, "nvmlDeviceGetPcieReplayCounter", lambda _: None), h),
            "nvlink_replay": self._nvlink_replays(),
        }

    def _nvlink_replays(self) -> int | None:
        fn = getattr(self.nv, "nvmlDeviceGetNvLinkErrorCounter", None)
        if fn is None:
            return None
        total, seen = 0, False
        for link in range(18):  # NVLINK_MAX_LINKS on Hopper
            value = self._try(fn, self.handle, link, getattr(self.nv, "NVML_NVLINK_ERROR_DL_REPLAY", 0))
            if value is not None:
                total, seen = total + value, True
        return total if seen else None

    def close(self) -> None:
        self._try(self.nv.nvmlShutdown)


class _CpuSource:
    name = "cpu"

    def __init__(self, reason: str):
        self.reason = reason
        self._last = (time.monotonic(), time.process_time())

    def sample(self) -> dict:
        now, cpu = time.monotonic(), time.process_time()
        share = (cpu - self._last[1]) / max(1e-9, now - self._last[0])
        self._last = (now, cpu)
        try:
            load = os.getloadavg()[0]
        except OSError:  # not available on this platform
            load = None
        return {"process_cpu_s": cpu, "cpu_share": round(share, 4), "load_1m": load, "fallback_reason": self.reason}

    def close(self) -> None:
        pass


def open_source(device_index: int | None = None, prefer: str = "auto"):
    """NVML when it works (``prefer`` ``auto``/``nvml``), else the CPU source carrying the reason."""
    if prefer == "cpu":
        return _CpuSource("cpu requested")
    index = int(os.environ.get("LOCAL_RANK", "0")) if device_index is None else device_index
    try:
        import pynvml  # optional: nvidia-ml-py (the gpu extra); the CPU source without it
    except ImportError:
        return _CpuSource("pynvml not installed (pip install nvidia-ml-py)")
    try:
        return _NvmlSource(index)
    except pynvml.NVMLError as exc:  # no driver, no GPU, or no permission
        return _CpuSource(f"NVML unavailable: {exc}")


class Sampler:
    """Background telemetry sampling for one rank; ``start``/``stop`` may be called repeatedly."""

    def __init__(
        self,
        rank: int,
        out_dir: str | os.PathLike | None,
        interval_s: float = 1.0,
        *,
        device_index: int | None = None,
        prefer: str = "auto",
    ):
        if problem := seconds_problem(interval_s):  # inf killed the sampling thread, leaving no telemetry and no error
            raise ValueError(f"interval_s {problem}")
        if prefer not in ("auto", "nvml", "cpu"):
            raise ValueError(f"prefer must be auto, nvml or cpu, got {prefer!r}")
        self.rank, self.interval_s = rank, interval_s
        self.path = None if out_dir is None else os.path.join(os.fspath(out_dir), f"telemetry_rank{rank}.jsonl")
        self._device_index, self._prefer = device_index, prefer
        self._source = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.samples = 0
        """Samples taken so far."""
        self.cpu_s = 0.0
        """CPU seconds the sampling thread spent sampling and writing (its cost)."""

    @property
    def source(self) -> str | None:
        return None if self._source is None else self._source.name

    def start(self) -> None:
        if self._thread is not None:
            return
        if self._source is None:
            self._source = open_source(self._device_index, self._prefer)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"telemetry-rank{self.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None

    def close(self) -> None:
        self.stop()
        if self._source is not None:
            self._source.close()

    def _run(self) -> None:
        pending: list[str] = []
        while True:
            c0 = time.thread_time()
            record = {"t": time.time(), "rank": self.rank, "source": self._source.name, **self._source.sample()}
            pending.append(json.dumps(record))
            self.samples += 1
            self.cpu_s += time.thread_time() - c0
            stopping = self._stop.wait(self.interval_s)
            c0 = time.thread_time()
            if self.path is not None and (stopping or len(pending) >= 16):  # batched: one open per 16 samples
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                with open(self.path, "a") as f:
                    f.write("\n".join(pending) + "\n")
                pending.clear()
            self.cpu_s += time.thread_time() - c0
            if stopping:
                return
