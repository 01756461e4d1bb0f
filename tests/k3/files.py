"""Small file helpers for the k3 tests: JSON read and written inside with-blocks (no file left open)."""

from __future__ import annotations

import json


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_jsonl(path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f]


def write_json(path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
