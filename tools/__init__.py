"""tools: straggler diagnosis from per-rank traces (which rank or link, why, since when, what it costs), read
from our JSON lines, PyTorch profiler traces or Flight Recorder dumps, or live in the loop (``StragglerDetector``).

    from tools import analyse
    report, tables = analyse("trace/")          # stable JSON (see tools/README.md) + the per-rank tables
    report["findings"]                          # [] when nothing is wrong

Reads traces only (``collectives`` writes them); may ask the simulator what-if (``tools.simwhatif``). The fault
specs of the demo and of ``moonep train`` (``Slowdown``, ``DataDelay``, ``LinkDelay`` and their parsers) live in
``collectives.faults``.
"""

from tools.analysis import Tables, build_tables, load_tables
from tools.detect import KINDS, Finding, Thresholds
from tools.detector import DetectorConfig, StragglerDetector
from tools.findings import diagnose, rank_scores
from tools.follow import Tail, follow
from tools.plots import plot, timeline
from tools.probe import ProbeConfig, run_probe
from tools.report import SCHEMA_VERSION, analyse, apply_probe, format_report
from tools.sources import FORMATS, load_folder
from tools.telemetry import Sampler
from tools.trace_lines import TraceWarning
from tools.traces import Coverage, TraceFormatError, load_dir, load_dir_coverage
from tools.workload import WorkloadConfig, run_local, run_workload

__all__ = [
    "Coverage",
    "DetectorConfig",
    "FORMATS",
    "StragglerDetector",
    "TraceFormatError",
    "load_folder",
    "KINDS",
    "SCHEMA_VERSION",
    "Finding",
    "ProbeConfig",
    "Sampler",
    "Tables",
    "Tail",
    "Thresholds",
    "TraceWarning",
    "WorkloadConfig",
    "analyse",
    "apply_probe",
    "build_tables",
    "diagnose",
    "follow",
    "format_report",
    "load_dir",
    "load_dir_coverage",
    "load_tables",
    "plot",
    "rank_scores",
    "run_local",
    "run_probe",
    "run_workload",
    "timeline",
]
