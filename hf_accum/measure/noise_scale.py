"""The gradient noise scale, measured from the micro-batches accumulation already computes.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", App. A.1): with the squared
norms of a gradient measured at two batch sizes ``b < B`` (in *targets*, since our loss is a per-target
mean), ::

    E|g_b|^2 = |G|^2 + tr(S) / b

so the two unbiased estimates are ::

    |G|^2 ~ (B |g_B|^2 - b |g_b|^2) / (B - b)
    tr(S) ~ (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

and ``B_simple = tr(S) / |G|^2`` estimates the critical batch: the update size (in targets) beyond which
more targets per update buy little. Each estimate is noisy (a difference of two noisy norms), so the paper
keeps exponential moving averages of ``|G|^2`` and ``tr(S)`` *separately* and divides the averages
(:class:`NoiseScaleTracker`); a ratio of noisy numbers is not averaged.

In an update the big batch is the update itself (``B = N`` targets, all micro-batches and ranks: the
gradient that is applied, before clipping) and the small batches are micro-batches (``b = n_k`` targets,
their summed gradient divided by ``n_k``). With only each window's first micro-batch per rank measured
(``noise_scale_micro_batches="first"``), every (small batch, update) pair gives one two-size estimate and the
estimates of one update are averaged (:func:`update_estimates`): with unequal ``n_k`` averaging the
per-micro-batch estimates was the least biased variant measured (weighting by the harmonic mean of
``n_k`` was the worst).

What population this targets: a dataloader samples *rows*, and the tokens of a row are correlated, so
``tr(S)`` here is the row-sampling one, ``sum_r |s_r - n_r G|^2 / sum_r n_r`` (``s_r`` a row's summed
gradient, ``n_r`` its targets) -- about twice the per-token covariance trace on text. The noise scale is
therefore in targets of *rows as the loader draws them*, which is the quantity that decides how many
targets an update should hold.

**Every micro-batch a small batch** (:func:`pooled_estimate`, the default mode): the K micro-batches of a
window (on every rank) partition the update, so their estimates can be pooled instead of taking the first
one alone. With ``s_k`` a micro-batch's *summed* gradient over its ``b_k`` targets (not a mean: micro-batches
carry different numbers of targets), ``g_k = s_k / b_k``, ``B = sum_k b_k`` and ``g_B = sum_k s_k / B``, the
model above says ``E|s_k|^2 = b_k^2 |G|^2 + b_k tr(S)``, i.e. ::

    E[b_k |g_k|^2] = b_k |G|^2 + tr(S)          (each micro-batch, whatever its b_k)
    E[sum_k b_k |g_k|^2] = B |G|^2 + m tr(S)     (m: the micro-batches with a target)
    E[B |g_B|^2]         = B |G|^2 +   tr(S)

and subtracting the last from the sum gives the unbiased pair, for any uneven sizes ::

    tr(S) ~ (sum_k b_k |g_k|^2 - B |g_B|^2) / (m - 1)  =  sum_k b_k |g_k - g_B|^2 / (m - 1)
    |G|^2 ~ |g_B|^2 - tr(S) / B

-- the weighted within-window variance of the micro-batch gradients (never negative), exactly the
per-micro-batch mean of :func:`two_size_estimate` when the sizes are equal. It needs only two sums over
micro-batches and ranks (``m`` and ``sum_k b_k |g_k|^2``), which ride in the boundary's one all-reduce
whatever K is (ramp-up, token budgets). On the held-out population of ``tests/unit/test_noise_scale.py``
(K=4) it reaches a 10% error of ``B_simple`` (90% of draws) in about 63 windows against about 1130 for the
first micro-batch alone (docs/recipe.md); its bias there is about -4% against -3% for the first-micro-batch mode.
(Averaging the per-micro-batch two-size estimates instead is as precise and a little less biased there, but its
terms depend on ``B`` nonlinearly, so each micro-batch's pair would have to travel in the all-reduce: a number
of slots that grows with K.)

This module is pure arithmetic on norms; the front-ends measure the norms (:mod:`hf_accum.measure.noise_probe`:
each micro-batch's own gradient, or the first micro-batch's local gradient, and the applied gradient's norm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

DEFAULT_EMA_DECAY = 0.9
"""Weight of the past in the moving averages: about the last 10 updates count."""


@dataclass(frozen=True)
class SmallBatch:
    """One micro-batch's gradient as a small-batch measurement."""

    targets: float
    """Its prediction targets ``b``."""
    grad_sq: float
    """``|g_b|^2``: the squared norm of its per-target mean gradient (summed gradient / ``b``)."""


@dataclass(frozen=True)
class TwoSizeEstimate:
    """The unbiased estimates of ``|G|^2`` and ``tr(S)`` from one small and one big batch."""

    grad_sq: float
    trace_cov: float


def two_size_estimate(small: SmallBatch, big_targets: float, big_grad_sq: float) -> TwoSizeEstimate | None:
    """McCandlish App. A.1 from one pair of sizes; None when the two sizes are equal (no information)."""
    b, B = float(small.targets), float(big_targets)
    if b <= 0 or B <= b:
        return None
    grad_sq = (B * big_grad_sq - b * small.grad_sq) / (B - b)
    trace_cov = (small.grad_sq - big_grad_sq) / (1.0 / b - 1.0 / B)
    return TwoSizeEstimate(grad_sq, trace_cov)


def update_estimates(
    small_batches: Iterable[SmallBatch], big_targets: float, big_grad_sq: float
) -> TwoSizeEstimate | None:
    """The mean of the per-micro-batch two-size estimates of one update (None when none is defined:
    one micro-batch on one rank is the whole update)."""
    candidates = [two_size_estimate(small, big_targets, big_grad_sq) for small in small_batches]
    estimates = [e for e in candidates if e is not None and math.isfinite(e.grad_sq) and math.isfinite(e.trace_cov)]
    if not estimates:
        return None
    return TwoSizeEstimate(
        grad_sq=sum(e.grad_sq for e in estimates) / len(estimates),
        trace_cov=sum(e.trace_cov for e in estimates) / len(estimates),
    )


def pooled_estimate(micro_batches: float, weighted_grad_sq: float, big_targets: float,
                    big_grad_sq: float) -> TwoSizeEstimate | None:
    """The every-micro-batch estimate of one update (module docstring): ``micro_batches`` = ``m``, the
    micro-batches with a target (all ranks), ``weighted_grad_sq`` = ``sum_k b_k |g_k|^2`` over them,
    ``big_targets`` = ``B`` (their targets), ``big_grad_sq`` = ``|g_B|^2``. None when ``m < 2`` (one
    micro-batch is the whole update: no information)."""
    m, B = float(micro_batches), float(big_targets)
    if m < 2 or B <= 0:
        return None
    trace_cov = (weighted_grad_sq - B * big_grad_sq) / (m - 1)
    grad_sq = big_grad_sq - trace_cov / B
    if not (math.isfinite(trace_cov) and math.isfinite(grad_sq)):
        return None
    return TwoSizeEstimate(grad_sq, trace_cov)


@dataclass
class NoiseScaleReading:
    """What one update logs: the raw estimates of this update and the smoothed noise scale."""

    grad_sq: float | None = None
    """This update's estimate of ``|G|^2`` (raw; None when undefined)."""
    trace_cov: float | None = None
    """This update's estimate of ``tr(S)`` (raw)."""
    noise_scale: float | None = None
    """``B_simple`` in targets from the moving averages; None until defined (positive averages)."""


class NoiseScaleTracker:
    """Moving averages of the two estimates over updates, and ``B_simple`` from them.

    Bias-corrected like Adam's moments (the averages start at 0), so the first updates are not pulled
    towards 0. ``noise_scale`` stays None while the averaged ``|G|^2`` is not positive: early in
    training the estimate of ``|G|^2`` can be negative (it is a difference of noisy norms), and a
    negative or huge ratio would mislead.
    """

    def __init__(self, ema_decay: float = DEFAULT_EMA_DECAY, warmup_updates: int = 3) -> None:
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        self.ema_decay = ema_decay
        self.warmup_updates = warmup_updates
        self._grad_sq = 0.0
        self._trace_cov = 0.0
        self._weight = 0.0  # sum of the EMA weights so far: the bias correction
        self.measured_updates = 0

    def observe(self, estimate: TwoSizeEstimate | None) -> NoiseScaleReading:
        """Fold one update's estimate in and return what that update logs."""
        if estimate is None:
            return NoiseScaleReading(noise_scale=self.noise_scale)
        decay = self.ema_decay
        self._grad_sq = decay * self._grad_sq + (1 - decay) * estimate.grad_sq
        self._trace_cov = decay * self._trace_cov + (1 - decay) * estimate.trace_cov
        self._weight = decay * self._weight + (1 - decay)
        self.measured_updates += 1
        return NoiseScaleReading(estimate.grad_sq, estimate.trace_cov, self.noise_scale)

    @property
    def noise_scale(self) -> float | None:
        """``B_simple = tr(S) / |G|^2`` (targets) from the bias-corrected averages, or None."""
        if self.measured_updates < self.warmup_updates or self._weight <= 0:
            return None
        grad_sq, trace_cov = self._grad_sq / self._weight, self._trace_cov / self._weight
        if grad_sq <= 0 or trace_cov <= 0:
            return None
        return trace_cov / grad_sq

    def state_dict(self) -> dict[str, float]:
        """For checkpoints: a resumed run continues the same averages."""
        return {"grad_sq": self._grad_sq, "trace_cov": self._trace_cov, "weight": self._weight,
                "measured_updates": self.measured_updates}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._grad_sq, self._trace_cov = float(state["grad_sq"]), float(state["trace_cov"])
        self._weight, self.measured_updates = float(state["weight"]), int(state["measured_updates"])


def batch_size_advice(targets_per_update: float, noise_scale: float | None, margin: float = 2.0) -> str:
    """The end-of-run line comparing the updates' size with the measured noise scale."""
    if noise_scale is None:
        return ("gradient noise scale: not measured (it needs at least 2 micro-batches per update and a few "
                "updates with a positive estimate of |G|^2)")
    held, measured = _tokens(targets_per_update), _tokens(noise_scale)
    if noise_scale > margin * targets_per_update:
        verdict = "larger updates would still pay off (fewer, bigger updates for the same targets)"
    elif noise_scale * margin < targets_per_update:
        verdict = "updates this large buy little over smaller ones (smaller updates would train faster per target)"
    else:
        verdict = "the update size is near the critical batch"
    return f"your updates hold {held} targets; the measured noise scale is ~{measured}: {verdict}"


def _tokens(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 10_000 else f"{value:.0f}"
