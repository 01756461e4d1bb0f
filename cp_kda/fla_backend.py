"""Optional local pass through flash-linear-attention's ``chunk_kda`` (CUDA only, imported lazily).

Only the local single-device op uses it; the context-parallel wrapper always runs this package's own chunked
kernel, whose forward and backward it controls.
"""

from __future__ import annotations

import torch


def fla_available() -> tuple[bool, str]:
    """``(True, "")`` when FLA can run here, else ``(False, reason)``."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        import fla.ops.kda  # noqa: F401  # optional: flash-linear-attention (the gpu extra)
    except Exception as exc:  # ImportError, or triton failing to initialise
        return False, f"flash-linear-attention not importable: {exc}"
    return True, ""


def fla_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """Same contract as :func:`cp_kda.kda_chunk`; inputs must already be on a CUDA device."""
    ok, reason = fla_available()
    if not ok:
        raise ValueError(f"backend: 'fla' is unavailable ({reason})")
    if not q.is_cuda:
        raise ValueError(f"q: backend 'fla' needs CUDA tensors, got device {q.device}")
    from fla.ops.kda import chunk_kda  # optional: flash-linear-attention (the gpu extra)

    return chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
