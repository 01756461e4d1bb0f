"""cp_kda: Kimi Delta Attention (recurrent reference, chunked with its own backward), its gates and short
convolution, and context parallelism that passes recurrent states between ranks.

Ops (``naive``, ``chunk``, ``gate``, ``conv``, ``transfer``, ``cp_in_process``) are pure math; only ``cp`` talks
to a ``collectives.Communicator``. Layout follows flash-linear-attention: q, k, g ``[B,T,H,K]``, v ``[B,T,H,V]``,
beta ``[B,T,H]``, states ``[N,H,K,V]`` fp32.

Names are imported on first use (PEP 562), so ``import cp_kda.cli`` (the command line) does not load torch.
"""

from __future__ import annotations

from moonep_base import lazy_exports

_EXPORTS = {
    "kda_recurrent": ".naive",
    "kda_chunk": ".chunk",
    "kda_gate": ".gate",
    "kda_gate_naive": ".naive",
    "short_conv": ".conv",
    "short_conv_naive": ".naive",
    "context_parallel_kda": ".cp",
    "context_parallel_short_conv": ".cp",
    "simulate_context_parallel": ".cp_in_process",
    "transfer_map": ".transfer",
    "fold": ".transfer",
    "reverse_fold": ".transfer",
    "RankPlan": ".partition",
    "plan_rank": ".partition",
    "plan_ranks": ".partition",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
