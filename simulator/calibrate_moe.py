"""MoE fixed costs measured on this machine's accelerator: the ``moe_copy_ns`` and ``moe_layer_fixed_s`` terms.

One MoE layer's bookkeeping, forward and backward under autograd, with no expert GEMM (the grouped GEMM has its
own efficiency): router logits and fp32 softmax, top-k, the per-expert token counts brought to the host (the
device-to-host sync of a dropless dispatcher, which sizes its buffers from them), the permutation of the ``K``
copies of each token and the probability-weighted un-permutation. Timed at two token counts, the line through
the two medians gives the time per routed copy (slope) and per layer call (intercept).

The cost model adds ``3 x`` its own byte count of these kernels at the HBM rate (``costs._moe_fixed``), so the
profile gets the slope minus that (``moe_copy_ns``) and the intercept (``moe_layer_fixed_s``). ``calibrate`` runs
this on a GPU only: on CPU ranks the host model prices the MoE layer by its op census instead.
"""

from __future__ import annotations

import statistics
import time

import torch


def _layer_seconds(tokens: int, hidden: int, experts: int, top_k: int, repeats: int, device: str) -> float:
    """Median seconds of one MoE bookkeeping forward + backward at ``tokens`` rows."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(hidden, experts, device=device, dtype=dtype, requires_grad=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run() -> None:
        probs = torch.softmax((x @ w).float(), dim=-1)
        top_p, top_i = torch.topk(probs, top_k, dim=-1)
        flat = top_i.flatten()
        order = torch.argsort(flat)
        torch.bincount(flat, minlength=experts).tolist()  # the dropless dispatcher's device-to-host sync
        src = order // top_k
        rows = x.index_select(0, src) * top_p.flatten()[order, None].to(dtype)
        out = torch.zeros_like(x).index_add(0, src, rows)
        out.float().square().mean().backward()
        sync()

    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_moe_fixed(
    tokens: int, hidden: int, experts: int, top_k: int, repeats: int, device: str, hbm_tbps: float
) -> dict:
    """``{"moe_copy_ns", "moe_layer_fixed_s", ...raw}`` from the bookkeeping at ``tokens`` and ``tokens // 4``
    rows (shapes: ``[tokens, hidden]`` activations, ``[hidden, experts]`` router, ``top_k`` copies a token);
    ``hbm_tbps`` is the measured copy rate the model prices the modelled bytes at."""
    if tokens < 8 or min(hidden, experts, top_k, repeats) < 1 or top_k > experts or not hbm_tbps > 0:
        raise ValueError(f"measure_moe_fixed: bad sizes tokens={tokens} hidden={hidden} E={experts} K={top_k}")
    small = tokens // 4
    t_big = _layer_seconds(tokens, hidden, experts, top_k, repeats, device)
    t_small = _layer_seconds(small, hidden, experts, top_k, repeats, device)
    per_copy = max(0.0, (t_big - t_small) / ((tokens - small) * top_k))
    fixed = max(0.0, t_big - per_copy * tokens * top_k)
    modelled = 3.0 * (16.0 * experts + 8.0 * top_k * hidden + 4.0 * hidden) / top_k / (hbm_tbps * 1e12)
    return {
        "moe_copy_ns": max(0.0, per_copy - modelled) * 1e9,
        "moe_layer_fixed_s": fixed,
        "measured_copy_ns": per_copy * 1e9,
        "modelled_copy_ns": modelled * 1e9,
        "seconds": [t_small, t_big],
        "tokens": [small, tokens],
        "hidden": hidden,
        "experts": experts,
        "top_k": top_k,
    }
