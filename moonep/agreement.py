"""Cross-rank agreement on the settings that shape an EP group's exchanges (sizes, dtypes, balancing).

Every rank sends its settings as int64 words in ONE all-gather, together with the verdict of its own local
checks, BEFORE it raises anything: a bad value on one rank must not make that rank leave alone while its peers
wait in the next collective ("connection reset"). Then every rank raises the same ``ValueError``: the first rank
whose own check failed (its own words there, the field and value elsewhere), else every setting that differs,
with its per-rank values. Construction-time only: the one host read here is not on the data path.
"""

from __future__ import annotations

import torch

from collectives.base import Communicator
from planner.slack import slack_num

DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
)
"""dtypes as agreement words (their index); any other dtype is ``len(DTYPES)`` plus its name's length."""

UNREADABLE = -(2**62)
"""the word of a setting that is not an int (its rank's own check names it)."""


def dtype_word(dtype) -> int:
    """A dtype as one int64 word, the same on every rank (``DTYPES`` index)."""
    if dtype in DTYPES:
        return DTYPES.index(dtype)
    return len(DTYPES) + 1000 + len(str(dtype))


def int_word(value) -> int:
    """An int setting as its word (``UNREADABLE`` for anything else, so that the gather still runs)."""
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 2**62:
        return UNREADABLE
    return value


def cost_words(cost) -> list[int]:
    """A ``planner.CostModel`` as four int64 words (float bits, max_slack, candidates), compared exactly."""
    if cost is None:
        return [-1, -1, -1, -1]
    bits = torch.tensor([cost.row_seconds, cost.copy_seconds], dtype=torch.float64).view(torch.int64).tolist()
    return [*bits, slack_num(cost.max_slack), cost.candidates]


def _shown(name: str, word: int) -> str:
    if word == UNREADABLE:
        return "<not an int>"
    if name.endswith("dtype"):
        return str(DTYPES[word]) if 0 <= word < len(DTYPES) else f"<dtype code {word}>"
    return str(word)


def agree_settings(
    comm: Communicator, op: str, settings: dict[str, int], problem: tuple[str, str] | None, hint: str
) -> None:
    """Raise the same ValueError on every rank of ``comm`` when any rank's settings are invalid or differ.

    settings: name -> int64 word (``int_word``, ``dtype_word``; a multi-word setting as ``name#i`` entries, shown
    once). problem: this rank's own failed check as (setting name, message), or None. hint: what to do when the
    settings differ. Collective: every rank calls it at the same point, with the same setting names.
    """
    names = list(settings)
    field = 0 if problem is None else (names.index(problem[0]) + 1 if problem[0] in names else len(names) + 1)
    mine = [field, *(int(v) for v in settings.values())]
    if comm.world_size == 1:
        rows = [mine]
    else:
        gathered = torch.empty(comm.world_size * len(mine), dtype=torch.int64)
        comm.all_gather(gathered, torch.tensor(mine, dtype=torch.int64), validate=False)
        rows = gathered.view(comm.world_size, len(mine)).tolist()
    bad = [r for r, row in enumerate(rows) if row[0]]
    if bad:
        first, f = bad[0], rows[bad[0]][0]
        if problem is not None and first == comm.rank:  # its field is non-zero only with a problem
            what = problem[1]
        elif f <= len(names):
            name = names[f - 1]
            what = f"{name.split('#')[0]}={_shown(name, rows[first][f])} is invalid (rank {first}'s error says why)"
        else:
            what = f"its arguments are invalid (rank {first}'s error says why)"
        also = f" (also ranks {bad[1:]})" if len(bad) > 1 else ""
        raise ValueError(f"moonep.{op}: rank {first}: {what}{also}")
    differ = [n for i, n in enumerate(names) if len({row[i + 1] for row in rows}) > 1]
    if differ:
        per_rank = {}
        for n in differ:
            base = n.split("#")[0]
            if base not in per_rank:
                per_rank[base] = [_shown(n, row[names.index(n) + 1]) for row in rows]
        listed = "; ".join(f"{k}: {v}" for k, v in per_rank.items())
        raise ValueError(
            f"moonep.{op}: ranks build different {op}s ({', '.join(per_rank)} differ; per rank: {listed}); {hint}"
        )


__all__ = ["DTYPES", "agree_settings", "cost_words", "dtype_word", "int_word"]
