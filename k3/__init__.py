"""k3: the exact Kimi K3 architecture as a single-device reference model, trained on MoonEP.

Public API (imported lazily so ``import k3.cli`` stays light): ``K3Config``, ``count_parameters``,
``count_model_parameters``, ``K3Model``, ``build_model``, ``init_weights``, ``load_hf_checkpoint``,
``train``. See ``k3/README.md``.
"""

from __future__ import annotations

from moonep_base import lazy_exports

_EXPORTS = {
    "K3Config": ".config",
    "LinearAttnConfig": ".config",
    "count_parameters": ".params",
    "count_model_parameters": ".params",
    "K3Model": ".model",
    "build_model": ".model",
    "init_weights": ".model",
    "token_loss_sum": ".model",
    "KDALayer": ".kda",
    "GatedMLA": ".mla",
    "LatentMoE": ".moe",
    "AttnResQuery": ".attnres",
    "situ_glu": ".layers",
    "RMSNorm": ".layers",
    "TrainConfig": ".train",
    "train": ".train",
    "load_hf_checkpoint": ".hf",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
