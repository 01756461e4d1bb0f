"""Reading torch Flight Recorder dumps: safely unpickled or JSON, every entry checked, as ``FRCall`` / ``FRRun``.

A dump is one rank's ring buffer of collectives (``TORCH_FR_BUFFER_SIZE``), written on a watchdog timeout to
``TORCH_FR_DUMP_TEMP_FILE<rank>`` (pickle) or on demand (``torch._C._distributed_c10d._dump_fr_trace()``, pickle,
or ``_dump_fr_trace_json()``, JSON). Keys: ``version``, ``pg_config`` (group name -> ``ranks`` as a string),
``pg_status``, ``entries``; an entry has ``collective_seq_id``, ``profiling_name`` (``gloo:all_reduce``),
``process_group`` ([name, desc]), ``input_sizes`` / ``input_dtypes``, ``state``, ``time_created_ns`` (when the
rank issued it: its arrival), ``time_discovered_started_ns`` / ``_completed_ns`` (0 or None on gloo), ``frames``.
The dump does not hold its rank: it comes from the file name (trailing digits) or ``--rank-from``. An entry whose
fields have the wrong type (a damaged or hand-edited dump) is dropped and counted in ``FRRun.warnings``.

A pickle a user hands us is untrusted: ``SafeUnpickler`` admits builtin containers and scalars only (a dump holds
nothing else) and refuses every global, so nothing in the file runs.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from dataclasses import dataclass, field

from tools.trace_lines import count, rank_id, whole
from tools.traces import TraceFormatError

_TRAILING_DIGITS = re.compile(r"(\d+)$")


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that builds dicts, lists, tuples, strings and numbers and refuses every global."""

    path = ""

    def find_class(self, module, name):
        raise TraceFormatError(
            f"{self.path}: the pickle holds {module}.{name}, not plain containers: refusing to unpickle it (a "
            f"Flight Recorder dump holds only dicts, lists, tuples, strings and numbers)"
        )


def _head(path: str, n: int = 1 << 16) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def looks_like_fr(path: str) -> bool:
    """A pickle, or a JSON object with Flight Recorder keys (``entries`` and ``collective_seq_id``/``pg_config``)."""
    try:
        head = _head(path)
    except OSError:
        return False
    if head[:1] == b"\x80":
        return True
    text = head.lstrip()[:1]
    return (
        text == b"{"
        and b'"entries"' in head
        and b'"traceEvents"' not in head
        and any(key in head for key in (b'"collective_seq_id"', b'"pg_config"', b'"comm_lib_version"'))
    )


def load_dump(path: str) -> dict:
    """The dump as plain data; a damaged file, a pickle with objects, or no ``entries`` list: ``TraceFormatError``."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise TraceFormatError(f"{path}: unreadable ({type(exc).__name__})") from None
    if raw[:1] == b"\x80":
        unpickler = SafeUnpickler(io.BytesIO(raw))
        unpickler.path = path
        try:
            doc = unpickler.load()
        except TraceFormatError:
            raise
        except Exception as exc:
            raise TraceFormatError(f"{path}: damaged or truncated pickle ({type(exc).__name__})") from None
    else:
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise TraceFormatError(f"{path}: not JSON, or cut short ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise TraceFormatError(f"{path}: not a Flight Recorder dump (no entries list)")
    return doc


def rank_of(path: str, rank_from: str | None = None) -> int | None:
    """The dump's rank: ``rank_from``'s first group on the file name, else the name's trailing digits (before
    any extension: ``fr_trace_3``, ``fr3.json``, ``rank3.pkl``); None when neither gives one."""
    name = os.path.basename(path)
    if rank_from:
        match = re.search(rank_from, name)
        return int(match.group(1)) if match and match.groups() and (match.group(1) or "").isdigit() else None
    match = _TRAILING_DIGITS.search(name.split(".")[0])
    return int(match.group(1)) if match else None


@dataclass(slots=True)
class FRCall:
    """One collective as one rank's dump recorded it."""

    group: tuple[int, ...]
    """Global ranks of its process group."""
    pg: str
    """Process group name (description when it has one)."""
    seq: int
    """``collective_seq_id`` within the group."""
    op: str
    """``profiling_name`` without the backend prefix (``all_reduce``)."""
    sizes: list
    """Input sizes."""
    dtypes: list
    """Input dtypes."""
    arrival_s: float
    """When the rank issued (or, when known, started) it: epoch seconds."""
    completed_s: float | None
    """When it completed, when the dump knows (None on gloo)."""
    state: str
    """``scheduled``, ``started`` or ``completed``."""
    where: str = ""
    """The outermost user frame that issued it (``file:line (function)``), when the dump has frames."""

    def signature(self) -> str:
        return f"{self.op} {self.sizes} {','.join(map(str, self.dtypes))}"


@dataclass(slots=True)
class FRRun:
    """The dumps of one job, by rank."""

    calls: dict[int, list[FRCall]]
    """rank -> its collectives (point-to-point left out), by sequence number."""
    paths: dict[int, str]
    """rank -> dump file."""
    world: int
    """Ranks of the largest group."""
    warnings: list[str] = field(default_factory=list)
    """What the dumps cannot show (a wrapped ring buffer, a rank without a dump)."""


def _group(entry: dict, pg_config: dict, fallback: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    pg = entry.get("process_group") or ["", ""]
    name, desc = (str(pg[0]), str(pg[1])) if isinstance(pg, (list, tuple)) and len(pg) == 2 else (str(pg), "")
    configs = [c for c in pg_config.values() if isinstance(c, dict)]
    cfg = pg_config.get(name) or next((c for c in configs if c.get("desc") == desc), None)
    if cfg is None and len(configs) == 1:
        cfg = configs[0]
    ranks = cfg.get("ranks") if isinstance(cfg, dict) else None
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks)
        except ValueError:
            ranks = None
    good = isinstance(ranks, list) and ranks and all(rank_id(r) for r in ranks)
    return desc or name, tuple(ranks) if good else fallback


def _where(frames) -> str:
    for f in reversed(frames or []):  # innermost first: the last user frame is the outermost caller
        if isinstance(f, dict) and "site-packages" not in str(f.get("filename", "")):
            return f"{os.path.basename(str(f.get('filename')))}:{f.get('line')} ({f.get('name')})"
    return ""


_TIMES = ("time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns")
_TYPES = {"input_sizes": list, "input_dtypes": list, "frames": list, "profiling_name": str, "state": str}


def entry_problem(entry) -> str | None:
    """Why ``entry`` is not a collective a dump could hold (None when it is; point-to-point ones are skipped)."""
    if not isinstance(entry, dict):
        return "not a JSON object"
    if entry.get("is_p2p"):  # skipped by ``_call`` whatever else it holds
        return None
    seq = entry.get("collective_seq_id")
    if not (whole(seq) and seq >= 0):
        return f"collective_seq_id {seq!r} is not a sequence number"
    for key in _TIMES:
        t = entry.get(key)
        if t is not None and not count(t):
            return f"{key} {t!r} is not a time"
    bad = next((k for k, kind in _TYPES.items() if entry.get(k) is not None and not isinstance(entry[k], kind)), None)
    return None if bad is None else f"{bad} is not a {_TYPES[bad].__name__}"


def _call(entry: dict, pg_config: dict, fallback) -> FRCall | None:
    if entry.get("is_p2p"):
        return None
    pg, group = _group(entry, pg_config, fallback)
    started = entry.get("time_discovered_started_ns") or 0
    arrival = (started or entry.get("time_created_ns") or 0) / 1e9
    done = entry.get("time_discovered_completed_ns") or 0
    op = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
    return FRCall(group, pg, entry["collective_seq_id"], op, entry.get("input_sizes") or [],
                  entry.get("input_dtypes") or [], arrival, done / 1e9 if done else None,
                  str(entry.get("state", "")), _where(entry.get("frames")))  # fmt: skip


def read_flight_recorder(paths: dict[int, str]) -> FRRun:
    """Load every rank's dump (``TraceFormatError`` for a damaged one, or dumps of two world sizes)."""
    calls, worlds, warnings = {}, {}, []
    fallback = tuple(sorted(paths))
    for rank, path in sorted(paths.items()):
        doc = load_dump(path)
        pg_config = doc.get("pg_config") if isinstance(doc.get("pg_config"), dict) else {}
        checked = [(e, entry_problem(e)) for e in doc["entries"]]
        problems = [why for _, why in checked if why]
        if problems:  # a damaged or hand-edited dump: what is left is still read
            warnings.append(f"{path}: {len(problems)} entries dropped (the first: {problems[0]})")
        mine = [c for e, why in checked if not why and (c := _call(e, pg_config, fallback))]
        mine.sort(key=lambda c: (c.pg, c.seq))
        calls[rank] = mine
        if mine:
            worlds.setdefault(max(len(c.group) for c in mine), path)
            first = min(c.seq for c in mine)
            if first > 1:
                warnings.append(f"{path}: the ring buffer wrapped (oldest call #{first}): earlier calls are gone")
    if len(worlds) > 1:
        (a, pa), (b, pb) = list(worlds.items())[:2]
        raise TraceFormatError(f"Flight Recorder dumps of two world sizes: {a} ranks in {pa}, {b} in {pb}")
    world = next(iter(worlds), len(paths))
    missing = sorted(set(range(world)) - set(paths))
    if missing:
        warnings.append(f"no Flight Recorder dump for ranks {missing}: their calls are unknown")
    return FRRun(calls, dict(paths), world, warnings)
