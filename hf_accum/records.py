"""What a run reports: one :class:`UpdateLog` per optimizer update and the :class:`TrainResult` of a loop run.

Both front-ends build these records in one place (:meth:`hf_accum.boundary.UpdateBoundary.record`); the loop
returns them in a :class:`TrainResult`, AccumTrainer keeps them in ``AccumTrainer.updates``, and checkpoints
store them (``asdict``) so that a resumed run reports the whole run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hf_accum.planning.schedule import BatchPlan


@dataclass
class UpdateLog:
    """One optimizer update, as logged. ``loss`` is the exact per-target mean of the window."""

    step: int
    epoch: float
    loss: float
    learning_rate: float
    grad_norm: float | None
    targets: int
    sequences: int
    padding_fraction: float
    micro_batches: int
    applied: bool = True
    skip_reason: str = ""
    nonfinite: bool = False
    """Skipped because a loss or gradient was inf/NaN."""
    eval_loss: float | None = None
    """Exact per-token held-out loss after this update, when it was evaluated (``eval_strategy``)."""
    aux_loss: float | None = None
    """MoE models: the router-loss term the update also minimized (``coef`` x the token-weighted mean of its
    micro-batches' aux losses; ``loss`` stays the cross-entropy). None for models without one."""
    noise_scale: float | None = None
    """With noise-scale tracking: ``B_simple`` in targets from the moving averages (None until defined):
    the update size beyond which more targets per update buy little (:mod:`hf_accum.measure.noise_scale`)."""
    grad_sq: float | None = None
    """This update's raw estimate of ``|G|^2`` (None when nothing was measured)."""
    trace_cov: float | None = None
    """This update's raw estimate of ``tr(S)``, the per-target gradient covariance trace."""
    batch_change: str | None = None
    """``rampup_batch_size='auto'``: the change this update's reading decided (the next update's batch), with its
    reason (:meth:`hf_accum.planning.auto_ramp.BatchChange.reason`); None when the batch stays."""
    flops: float | None = None
    """Model FLOPs of this update on all ranks (forward + backward, no recompute:
    :mod:`hf_accum.measure.utilization`)."""
    seconds: float | None = None
    """Wall time from the previous update's end (the run's start for the first) to this one's."""
    flops_per_second: float | None = None
    """Achieved model FLOP/s of this update, all ranks: ``flops / seconds``."""
    mfu: float | None = None
    """Model FLOPs utilization: ``flops_per_second`` over the peak of all ranks' devices (None: peak unknown)."""

    def tracked(self) -> dict[str, float]:
        """The numbers an experiment tracker gets for this update (names as Trainer logs them)."""
        values = {"train/loss": self.loss, "train/learning_rate": self.learning_rate,
                  "train/tokens_per_update": self.targets, "train/sequences_per_update": self.sequences,
                  "train/padding_fraction": self.padding_fraction, "train/epoch": self.epoch}
        if self.grad_norm is not None:
            values["train/grad_norm"] = self.grad_norm
        if self.eval_loss is not None:
            values["eval/loss"] = self.eval_loss
        if self.aux_loss is not None:
            values["train/aux_loss"] = self.aux_loss
        for name in ("noise_scale", "grad_sq", "trace_cov", "flops_per_second", "mfu"):
            if getattr(self, name) is not None:
                values[f"train/{name}"] = getattr(self, name)
        return values

    def line(self) -> str:
        grad = f"{self.grad_norm:.4f}" if self.grad_norm is not None else "-"
        state = "" if self.applied else f" (skipped: {self.skip_reason})"
        state += f" | eval_loss {self.eval_loss:.4f}" if self.eval_loss is not None else ""
        state += f" | aux_loss {self.aux_loss:.4f}" if self.aux_loss is not None else ""
        state += f" | noise_scale {self.noise_scale:.0f}" if self.noise_scale is not None else ""
        state += f" | {self.batch_change}" if self.batch_change else ""
        state += f" | {self.flops_per_second / 1e9:,.1f} GFLOP/s" if self.flops_per_second is not None else ""
        state += f" | MFU {self.mfu:.1%}" if self.mfu is not None else ""
        return (
            f"update {self.step} | epoch {self.epoch:.2f} | loss {self.loss:.4f} | lr {self.learning_rate:.3e} | "
            f"grad_norm {grad} | tokens {self.targets} | seqs {self.sequences} | "
            f"pad {self.padding_fraction:.1%}{state}"
        )


@dataclass
class TrainResult:
    updates: list[UpdateLog] = field(default_factory=list)
    """Every update of the run, the ones before a resume included."""
    batch_plan: BatchPlan | None = None
    checkpoint: str | None = None
    """The last checkpoint this call wrote."""
    noise_scale_advice: str | None = None
    """With noise-scale tracking: the end-of-run line (:func:`hf_accum.measure.noise_scale.batch_size_advice`)."""
    utilization: dict | None = None
    """The run's model FLOPs per update, achieved FLOP/s and MFU (:func:`hf_accum.measure.utilization.summarize`)."""

    def as_dicts(self) -> list[dict]:
        """Every update as a dict (what a checkpoint keeps of the log, and what a resumed run continues)."""
        return [asdict(u) for u in self.updates]

    @property
    def skipped_nonfinite(self) -> list[int]:
        """Updates skipped because a loss or gradient was inf/NaN."""
        return [u.step for u in self.updates if u.nonfinite]
