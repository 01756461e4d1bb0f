"""``TrainConfig``: one K3 training run, every field checked in ``__post_init__`` (so a bad run fails in one
line before any rank starts). ``k3.train`` runs it and re-exports it."""

from __future__ import annotations

from dataclasses import dataclass

from collectives.faults import DataDelay, LinkDelay, Slowdown, check_fault_ranks
from collectives.launch import check_device
from moonep_base import check_folder


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """One training run (everything that decides the numbers, plus where to write)."""

    preset: str = "tiny"
    """Model preset (``K3Config.preset``)."""
    steps: int = 300
    """Optimizer steps in total (a resumed run continues up to this)."""
    schedule_steps: int | None = None
    """Length of the LR schedule (cosine reaches its floor here, and stays there after); None = the first run's
    ``steps`` (recorded in the run's checkpoints, so extending a run with ``--resume --steps N`` keeps it)."""
    seq_len: int = 64
    """Tokens (bytes) per training row."""
    global_batch: int = 16
    """Rows per step over all ranks (split evenly; must be divisible by the world size)."""
    lr: float = 1e-2
    """Peak learning rate of both groups (linear warmup, cosine to 10%); 1e-2 beat 3e-3 for Muon on tiny."""
    warmup: int = 10
    """Warmup steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices."""
    grad_clip: float = 1.0
    """Global grad-norm clip (over all ranks' experts and the replicated parameters)."""
    optimizer: str = "muon"
    """``muon`` (Per-Head Muon + AdamW for the rest) or ``adamw`` (everywhere)."""
    qk_clip_tau: float = 100.0
    """QK-Clip threshold on MLA max logits (K2's value; K3's is not public); 0 = off."""
    balance: str = "qb"
    """Router-bias update: ``qb`` (Quantile Balancing), ``sign`` (DeepSeek-V3) or ``none``."""
    val_every: int = 50
    """Validation every this many steps (and at the last step)."""
    val_batches: int = 2
    """Global batches of held-out text per validation."""
    ckpt_every: int = 100
    """Checkpoint every this many steps (and at the last step); 0 = only at the end."""
    seed: int = 0
    """Init and data seed."""
    world_size: int = 4
    """Local ranks to launch (ignored under torchrun / mpiexec)."""
    device: str = "cpu"
    """``cpu``, or ``cuda``: each rank on its own GPU (``collectives.rank_device``; NCCL needs one GPU per rank)."""
    cp: int = 1
    """Context-parallel size: each sequence is split over ``cp`` consecutive ranks (KDA via cp_kda, MLA by
    gathering keys/values); world_size / cp data-parallel groups."""
    data: str | None = None
    """Text folder; None = the interpreter's standard-library sources."""
    max_data_bytes: int = 8 << 20
    """Bytes read from the corpus."""
    run_dir: str = "out/k3-train"
    """Run folder: metrics.jsonl, plots, config, checkpoints."""
    resume: bool = False
    """Continue from the latest checkpoint in run_dir (an error when it holds none)."""
    progress: bool = True
    """tqdm bar on rank 0."""
    trace_dir: str | None = None
    """Per-rank trace folder (``rank<N>.jsonl``, read by ``moonep diagnose``); None = ``$MOONEP_TRACE_DIR`` or off."""
    slowdowns: tuple[Slowdown, ...] = ()
    """Injected compute slowdowns (stretched in thread CPU time, so a factor means the same on any machine)."""
    data_delays: tuple[DataDelay, ...] = ()
    """Injected data-loading delays (a sleep in the rank's data phase)."""
    link_delays: tuple[LinkDelay, ...] = ()
    """Injected link delays (``comm.inject_link_delay`` when their step starts)."""

    def __post_init__(self) -> None:
        # launch() passes dataclasses.asdict(tc) to the ranks, which turns the specs into dicts: rebuild them
        for name, kind in (("slowdowns", Slowdown), ("data_delays", DataDelay), ("link_delays", LinkDelay)):
            setattr(self, name, tuple(x if isinstance(x, kind) else kind(**x) for x in getattr(self, name)))
        for name in ("steps", "seq_len", "global_batch", "warmup", "val_batches", "world_size", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.schedule_steps is not None and self.schedule_steps < 1:
            raise ValueError(f"schedule_steps: must be >= 1, got {self.schedule_steps}")
        if self.world_size % self.cp:
            raise ValueError(f"cp: {self.cp} does not divide world_size {self.world_size}")
        if self.global_batch % (self.world_size // self.cp):
            raise ValueError(
                f"global_batch: {self.global_batch} is not divisible by the data-parallel size "
                f"{self.world_size // self.cp}"
            )
        if self.seq_len % self.cp or self.seq_len // self.cp < 3:
            raise ValueError(f"seq_len: {self.seq_len} must split into cp={self.cp} slices of >= 3 tokens")
        check_device(self.device)
        if self.balance not in ("qb", "sign", "none"):
            raise ValueError(f"balance: expected qb, sign or none, got {self.balance!r}")
        if self.seed < 0:  # numpy's generators refuse it inside every rank, with a message naming no flag
            raise ValueError(f"seed: must be >= 0, got {self.seed}")
        check_folder("run_dir", self.run_dir)
        if self.trace_dir:
            check_folder("trace_dir", self.trace_dir)
        self._check_fault_steps()

    def _check_fault_steps(self) -> None:
        """ValueError for a fault that starts at or after ``steps``: it would never apply, and the job would run
        clean while the user expects a fault."""
        for name, flag, specs in (
            ("slowdowns", "--inject-slowdown", self.slowdowns),
            ("data_delays", "--inject-data-delay", self.data_delays),
            ("link_delays", "--inject-link-delay", self.link_delays),
        ):
            for spec in specs:
                if spec.from_step >= self.steps:
                    raise ValueError(
                        f"{name} ({flag}): from_step={spec.from_step} is not below steps={self.steps}, "
                        f"so the fault would never apply"
                    )

    def check_fault_ranks(self, world_size: int) -> None:
        """ValueError naming every injected rank that is not below ``world_size``."""
        check_fault_ranks(world_size, self.slowdowns, self.data_delays, self.link_delays)
