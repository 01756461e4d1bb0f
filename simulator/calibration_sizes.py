"""The job shapes a calibration measures at: a module of its own, so that ``simulator.calibrate`` and
``simulator.calibrate_host`` both take it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from simulator.specs import load_model


@dataclass(kw_only=True, frozen=True)
class CalibrationSizes:
    """The job shapes the host and GEMM measurements are taken at (``from_model`` reads them off a model)."""

    tokens: int = 256
    """Tokens per rank per micro-batch (activation rows)."""
    hidden: int = 64
    """Model width (activation columns)."""
    seq_len: int = 64
    """Sequence length (KDA kernel and attention)."""
    kda_heads: int = 2
    """KDA heads of the kernel measurement."""
    kda_head_dim: int = 16
    """KDA head width of the kernel measurement."""
    experts: int = 8
    """Routed experts of the MoE bookkeeping measurement (``simulator.calibrate_moe``, GPU only)."""
    top_k: int = 2
    """Experts per token of that measurement."""

    def __post_init__(self):
        for name in ("tokens", "hidden", "seq_len", "kda_heads", "kda_head_dim", "experts", "top_k"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"CalibrationSizes.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.tokens % self.seq_len or self.tokens < 2:
            raise ValueError(
                f"CalibrationSizes.tokens {self.tokens} must be a multiple of seq_len {self.seq_len} and >= 2"
            )

    @classmethod
    def from_model(cls, model, seq_len: int | None = None, micro_batch: int = 1) -> CalibrationSizes:
        """Sizes of ``model`` (anything ``load_model`` takes) at ``micro_batch`` sequences of ``seq_len``."""
        spec = load_model(model)
        seq = seq_len or spec.seq_len
        return cls(
            tokens=micro_batch * seq,
            hidden=spec.hidden,
            seq_len=seq,
            kda_heads=spec.kda_heads or 2,
            kda_head_dim=spec.kda_head_dim or 16,
            experts=spec.num_experts or 8,
            top_k=spec.top_k or 2,
        )
