"""Real text with nothing downloaded: byte-level tokens from a folder of text files.

Default corpus: the running interpreter's standard-library ``.py`` sources (``sysconfig`` ``stdlib``), ordered by
path hash, without ``site-packages`` and test suites, capped in bytes. Files go to validation by a hash of their
relative path (each side capped at its share of ``max_bytes``): deterministic and independent of the machine's
file order. Batches are a pure function of (seed, step), so any world size, and any resumed run, sees the same
global batch.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass

import numpy as np
import torch

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg")


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_files(root: str, suffixes: tuple[str, ...]) -> list[str]:
    """Relative paths of text files under root, sorted; skips site-packages, tests and hidden folders."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".")
            and d not in ("site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__")
        )
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(suffixes)]
    return sorted(out)


@dataclass(slots=True)
class Corpus:
    """Byte tokens: ``train`` and ``val`` uint8 arrays (files joined with a NUL separator)."""

    train: np.ndarray
    """[N_train] uint8 tokens."""
    val: np.ndarray
    """[N_val] uint8 tokens."""
    source: str
    """The folder read."""


def load_corpus(path: str | None = None, *, max_bytes: int = 8 << 20, val_fraction: float = 0.05) -> Corpus:
    """Read ``path`` (default: the stdlib sources) into byte tokens and split by file."""
    root = path or stdlib_dir()
    if not os.path.isdir(root):
        raise ValueError(f"data: {root!r} is not a folder")
    # Hash order, not path order: the byte cap then takes a mix of the whole tree instead of its first
    # folders (the stdlib's alphabetically early encodings/ tables are unusually repetitive).
    files = sorted(
        list_files(root, (".py",) if path is None else TEXT_SUFFIXES), key=lambda rel: (zlib.crc32(rel.encode()), rel)
    )
    caps = {"train": max_bytes * (1 - val_fraction), "val": max_bytes * val_fraction}
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    for rel in files:
        name = "val" if zlib.crc32(rel.encode()) % 1000 < val_fraction * 1000 else "train"
        if sizes[name] >= caps[name]:  # this side is full: keep reading until both are
            if all(sizes[k] >= caps[k] for k in caps):
                break
            continue
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        if data:
            parts[name].append(np.frombuffer(data + b"\0", dtype=np.uint8))
            sizes[name] += len(data) + 1
    if not parts["val"] and len(parts["train"]) > 1:  # small folders: the last file (by path) validates
        parts["val"].append(parts["train"].pop())
    if not parts["train"] or not parts["val"]:
        raise ValueError(f"data: {root!r} holds too little text for a train/val split ({len(files)} files)")
    train, val = parts["train"], parts["val"]
    return Corpus(np.concatenate(train), np.concatenate(val), root)


def batch(tokens: np.ndarray, seed: int, step: int, rows: int, seq_len: int) -> torch.Tensor:
    """The global batch of ``step``: [rows, seq_len + 1] int64 windows at offsets drawn from (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=rows)
    return torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))


__all__ = ["Corpus", "load_corpus", "batch", "list_files", "stdlib_dir"]
