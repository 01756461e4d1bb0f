"""Input validation shared by every KDA entry point.

Every failure is a ``ValueError`` whose message starts with the offending argument's name, so a caller (or a
test) can tell at once which tensor was wrong. Axis letters: ``B`` batch, ``T`` tokens, ``H`` heads, ``K`` key
dim, ``V`` value dim, ``N`` sequences.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of recurrent states and of the internal compute: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_cu_seqlens(cu_seqlens: torch.Tensor | None, total: int, batch: int) -> list[int] | None:
    """Validate packed-sequence boundaries ``[N+1]`` (0 = first, strictly increasing, last = ``total``).

    Returns the boundaries as a Python list (one host sync), or None when ``cu_seqlens`` is None.
    """
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens: expected a 1-D integer tensor [N+1] with N >= 1")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens: expected an integer dtype, got {cu_seqlens.dtype}")
    if batch != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got B={batch}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens: must start at 0, starts at {bounds[0]}")
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens: must be strictly increasing, got {bounds}")
    if bounds[-1] != total:
        raise ValueError(f"cu_seqlens: must end at T={total}, ends at {bounds[-1]}")
    return bounds


def check_kda_inputs(q, k, v, g, beta, initial_state=None, cu_seqlens=None, validate=False):
    """Check shapes, dtypes and devices of a KDA call; return the sequence boundaries (list) or None.

    q, k ``[B,T,H,K]``; v ``[B,T,H,V]``; g ``[B,T,H,K]``; beta ``[B,T,H]``; initial_state ``[N,H,K,V]`` in the
    state dtype (fp32, or fp64 for fp64 inputs). ``validate=True`` also checks ``g <= 0`` (a host sync).
    """
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: expected a floating dtype, got {t.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q: expected [B,T,H,K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    expected = {"k": (B, T, H, K), "g": (B, T, H, K), "beta": (B, T, H)}
    for name, shape in expected.items():
        if tuple(named[name].shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(named[name].shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v: expected [B,T,H,V] with B,T,H = {(B, T, H)}, got {tuple(v.shape)}")
    for name in ("k", "v"):
        if named[name].dtype != q.dtype:
            raise ValueError(f"{name}: dtype {named[name].dtype} does not match q's {q.dtype}")
    for name, t in named.items():
        if t.device != q.device:
            raise ValueError(f"{name}: device {t.device} does not match q's {q.device}")
    if T == 0:
        raise ValueError("q: the sequence is empty (T = 0)")
    bounds = check_cu_seqlens(cu_seqlens, T, B)
    n_seq = B if bounds is None else len(bounds) - 1
    if initial_state is not None:
        _check_state("initial_state", initial_state, (n_seq, H, K, v.shape[-1]), q)
    if validate and bool((g > 0).any()):
        raise ValueError("g: log decay must be <= 0 (a positive value makes the state grow)")
    return bounds


def _check_state(name, state, shape, q):
    if not isinstance(state, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(state).__name__}")
    if tuple(state.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} ([N,H,K,V]), got {tuple(state.shape)}")
    if state.dtype != state_dtype(q.dtype):
        raise ValueError(f"{name}: expected dtype {state_dtype(q.dtype)}, got {state.dtype}")
    if state.device != q.device:
        raise ValueError(f"{name}: device {state.device} does not match q's {q.device}")


def resolve_scale(scale, K: int) -> float:
    """The query scale: ``K ** -0.5`` unless given."""
    return float(K) ** -0.5 if scale is None else float(scale)
