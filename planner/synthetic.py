"""Synthetic routing for tests, the bench and the CLI: zipf-skewed loads, top-k lists, drifting traces.

Expert popularity is shared by all ranks (hot experts line up across ranks, as with a real router), so home
groups differ in load and the planner has work to do. All generators are seeded and deterministic.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def zipf_logits(E: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """[E] log-popularity: expert of popularity rank i gets -skew * log(i + 1); ranks randomly permuted."""
    return -skew * np.log1p(rng.permutation(E).astype(np.float64))


def _probs(logits: np.ndarray) -> np.ndarray:
    p = np.exp(logits - logits.max())
    return p / p.sum()


def zipf_counts(R: int, E: int, K: int, S: int, skew: float, seed: int = 0) -> np.ndarray:
    """[R, E] counts: each rank routes exactly S*K slots, drawn multinomially from a zipf(skew) popularity.

    Counts only (a token may pick one expert twice, which the planner allows; at skew 1.2 the hottest expert gets
    more slots than a rank has tokens): use zipf_topk / router_counts for what a top-k router produces.
    """
    rng = np.random.default_rng(seed)
    p = _probs(zipf_logits(E, skew, rng))
    return rng.multinomial(S * K, p, size=R).astype(np.int64)


def zipf_topk(R: int, E: int, K: int, S: int, skew: float, seed: int = 0) -> np.ndarray:
    """[R, S, K] expert ids: K distinct experts per token (Gumbel top-k over the zipf popularity).

    Drawn rank by rank, so memory is O(S * E), not O(R * S * E)."""
    rng = np.random.default_rng(seed)
    logits = zipf_logits(E, skew, rng)
    K = min(K, E)
    out = np.empty((R, S, K), np.int64)
    for r in range(R):
        scores = logits + rng.gumbel(size=(S, E))
        out[r] = np.argpartition(-scores, K - 1, axis=-1)[:, :K]
    return out


def router_counts(R: int, E: int, K: int, S: int, skew: float, seed: int = 0) -> np.ndarray:
    """[R, E] counts of ``zipf_topk``'s lists: what a top-k router produces (no rank sends one expert more than
    S slots), unlike ``zipf_counts``, whose hottest expert can get more slots than a rank has tokens."""
    topk = zipf_topk(R, E, K, S, skew, seed)
    return np.stack([np.bincount(topk[r].ravel(), minlength=E) for r in range(R)]).astype(np.int64)


def drifting_trace(
    R: int, E: int, K: int, S: int, steps: int, skew: float = 1.2, drift: float = 0.05, seed: int = 0
) -> Iterator[np.ndarray]:
    """Yield ``steps`` count matrices [R, E] whose popularity follows a slow random walk in log space.

    drift: standard deviation of each expert's log-popularity change per step (0.05 = about 5 %).
    """
    rng = np.random.default_rng(seed)
    logits = zipf_logits(E, skew, rng)
    for _ in range(steps):
        yield rng.multinomial(S * K, _probs(logits), size=R).astype(np.int64)
        logits = logits + drift * rng.standard_normal(E)


SYNTHETIC_LOADS = {"zipf": zipf_counts, "router": router_counts}
"""load name -> generator (R, E, K, S, skew, seed) -> [R, E] counts: zipf slot counts (a hot expert may get
more slots than a rank has tokens) and the counts of zipf top-k lists (what a router produces)."""


def parse_synthetic(spec: str) -> tuple[str, float]:
    """'zipf:1.2' -> ('zipf', 1.2); 'router:1.2' -> ('router', 1.2) (counts of top-k lists); ValueError else."""
    kind, _, value = spec.partition(":")
    if kind not in SYNTHETIC_LOADS:
        raise ValueError(f"--synthetic must look like zipf:1.2 or router:1.2, got {spec!r}")
    try:
        skew = float(value or "1.0")
    except ValueError:
        raise ValueError(f"--synthetic must look like zipf:1.2 or router:1.2, got {spec!r}") from None
    if not 0 <= skew < float("inf"):  # nan and inf too: they gave an all-zero or warning-laden load
        raise ValueError(f"{kind} skew must be a finite number >= 0, got {value}")
    return kind, skew


def synthetic_counts(spec: str, R: int, E: int, K: int, S: int, seed: int = 0) -> np.ndarray:
    """[R, E] counts for a ``parse_synthetic`` spec (``SYNTHETIC_LOADS``)."""
    kind, skew = parse_synthetic(spec)
    return SYNTHETIC_LOADS[kind](R, E, K, S, skew, seed)
