"""The single normalization: summed micro-batch gradients -> the exact mean of one update.

Every front-end (the Accelerate loop, AccumTrainer) calls :func:`exact_mean_factor` and
nothing else to decide how gradients are scaled. The math, for one optimizer update built
from micro-batches ``b_rk`` (rank ``r = 1..W``, micro-step ``k = 1..K``)::

    target:   g = (1 / N) * sum_{r,k} sum_{t in targets(b_rk)} grad(loss_t),   N = sum_{r,k} |targets(b_rk)|

    DDP/FSDP average the per-rank gradients:  g = (1 / W) * sum_r g_r
    so each rank must hold                    g_r = (W / N) * sum_{k,t} grad(loss_t)

i.e. each rank backpropagates *summed* losses and the window is scaled once by ``W / N``
with the *global* ``N`` (all-reduced). Dividing by the local count, by K, or by the number
of micro-batches is what makes naive accumulation wrong on uneven micro-batches.

A window with ``N == 0`` (every label masked) has no mean: it applies no update. Nor does a window with an
inf/NaN loss or gradient: every rank learns of it from the same all-reduce (:meth:`WindowTally.mark_boundary`).

**Units and terms.** Nothing above needs the unit to be a token: a loss returns its *sum* over its units and
the *count* of its units (target tokens; sequences in sequence mode; preference pairs for DPO,
:mod:`hf_accum.losses.preference`). A loss of several terms with different units (DPO per pair + its ``sft`` term
per chosen token) returns one ``(sum, count)`` per term, as two 1-d tensors ``sums[J]``, ``counts[J]``;
term 0 is the *primary* one (its count is ``WindowTotals.targets``, an update without any skips). The
update then applies ``sum_j grad(S_j) / N_j`` (``S_j``, ``N_j`` summed over micro-batches and ranks), and
each rank's share is ``sum_j (W / N_j) grad(S_j)``: :func:`term_factors` gives the ``W / N_j`` (0 for an
extra term without units: it has no mean and contributes nothing), :func:`combine_terms` the one scalar a
front-end that counted the window before backward propagates. A single-term loss keeps 0-d tensors and the
exact arithmetic of :func:`exact_mean_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch


def exact_mean_factor(n_global_targets: int | float, world_size: int) -> float:
    """Factor that turns one rank's summed gradient into its share of the global per-target mean.

    ``W / N``: DDP divides by ``W`` when it averages, we divide by the global ``N`` here.
    Raises on ``N == 0``: callers must skip such a window instead of dividing by zero.
    """
    if n_global_targets <= 0:
        raise ZeroDivisionError("an update window with 0 prediction targets has no mean; skip it")
    return world_size / float(n_global_targets)


def term_factors(counts: Iterable[int | float], world_size: int) -> list[float]:
    """``W / N_j`` per term of a window counted on all ranks. The primary term (index 0) must have units (callers
    skip a window without); an extra term without units has no mean: factor 0 (its sum is 0 as well)."""
    counts = list(counts)
    return [exact_mean_factor(counts[0], world_size)] + [
        exact_mean_factor(n, world_size) if n > 0 else 0.0 for n in counts[1:]
    ]


def combine_terms(loss_sum: torch.Tensor, factors: list[float]) -> torch.Tensor:
    """The one scalar to backpropagate: ``sum_j factors[j] * S_j``. A 0-d (single-term) sum is multiplied by
    its factor alone, exactly as before terms existed (bit-identical token and sequence modes)."""
    if loss_sum.dim() == 0:
        if len(factors) != 1:
            raise ValueError(f"a single-term loss got {len(factors)} factors")
        return loss_sum * factors[0]
    if loss_sum.shape[0] != len(factors):
        raise ValueError(f"the loss returned {loss_sum.shape[0]} terms but the window was counted in {len(factors)}")
    return (loss_sum * torch.tensor(factors, dtype=loss_sum.dtype, device=loss_sum.device)).sum()


def split_terms(loss_sum: torch.Tensor, n_units: Any) -> tuple[torch.Tensor, Any, list[tuple[torch.Tensor, Any]]]:
    """``(primary sum, primary count, [(sum, count) of each extra term])`` of what a loss returned."""
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() == 0:
        return loss_sum, n_units, []
    counts = torch.as_tensor(n_units)
    if counts.shape != loss_sum.shape:
        raise ValueError(f"a loss of {loss_sum.shape[0]} terms must return as many counts (got shape "
                         f"{tuple(counts.shape)})")
    return loss_sum[0], counts[0], [(loss_sum[j], counts[j]) for j in range(1, loss_sum.shape[0])]


def global_sum(values: torch.Tensor, accelerator: Any) -> torch.Tensor:
    """Sum a tensor over all processes (no-op on one process). float64 keeps counts exact to 2**53."""
    if getattr(accelerator, "num_processes", 1) <= 1:
        return values
    return accelerator.reduce(values, reduction="sum")


def rescale_gradients_(parameters: Iterable[torch.nn.Parameter], factor: float) -> None:
    """Multiply every existing ``.grad`` in place (one fused foreach kernel per device/dtype)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def drop_gradients_(parameters: Iterable[torch.nn.Parameter]) -> None:
    """Forget a window's gradients (used when it had no targets: nothing to apply)."""
    for p in parameters:
        p.grad = None


LOW_PRECISION = (torch.bfloat16, torch.float16)


def low_precision_parameters(parameters: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The trainable bf16/fp16 weights: the ones whose micro-batch gradients need fp32 sums."""
    return [p for p in parameters if p.requires_grad and p.dtype in LOW_PRECISION]


class Fp32GradientAccumulator:
    """Accumulate the gradients of low-precision (bf16/fp16) weights in fp32 across a window.

    ``.grad`` has the weight's dtype, so K micro-batch gradients summed into a bf16 ``.grad`` are
    rounded to 8 mantissa bits K times (measured: +15% on the bf16 compute error at K=8). A
    post-accumulate hook moves each micro-batch's gradient into an fp32 buffer instead, and
    :meth:`write_gradients_` applies the window's scale factor in fp32 and rounds once.

    Single process only: DDP's reducer owns ``.grad`` buckets during the all-reduce.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter]):
        self.parameters = low_precision_parameters(parameters)
        self._sums: dict[int, torch.Tensor] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._stash) for p in self.parameters]

    def _stash(self, parameter: torch.nn.Parameter) -> None:
        key = id(parameter)
        grad = parameter.grad
        assert grad is not None  # a post-accumulate-grad hook runs once the gradient is there
        if key in self._sums:
            self._sums[key].add_(grad)  # add_ upcasts the bf16 grad into the fp32 sum
        else:
            self._sums[key] = grad.float()
        parameter.grad = None

    def write_gradients_(self, factor: float) -> None:
        """``.grad = round(factor * fp32 sum)`` for every low-precision weight; the buffers are freed."""
        for parameter in self.parameters:
            total = self._sums.pop(id(parameter), None)
            if total is not None:
                parameter.grad = total.mul_(factor).to(parameter.dtype)

    def other_parameters(self, parameters: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """The parameters this accumulator does not handle (fp32 weights keep their own .grad)."""
        mine = {id(p) for p in self.parameters}
        return [p for p in parameters if id(p) not in mine]

    def pending_sums(self) -> list[torch.Tensor]:
        """The fp32 sums of the window so far (what ``.grad`` will hold after :meth:`write_gradients_`)."""
        return list(self._sums.values())

    def clear(self) -> None:
        self._sums.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class WindowTotals:
    """What one update window held, summed over micro-batches and (after ``reduce``) ranks."""

    loss_sum: float = 0.0
    """Summed cross-entropy (the model's known extra terms, e.g. a MoE router loss, are in ``aux_loss_sum``)."""
    targets: int = 0
    sequences: int = 0
    real_tokens: int = 0
    total_tokens: int = 0
    squared_lengths: int = 0
    """Sum over the window's sequences of their squared lengths: the attention part of its model FLOPs
    (:func:`squared_sequence_lengths`, :mod:`hf_accum.measure.utilization`)."""
    micro_batches: int = 0
    nonfinite_losses: int = 0
    """Micro-batches whose summed loss was inf/NaN."""
    nonfinite_gradients: int = 0
    """Ranks whose window gradient held an inf/NaN (not counted under fp16's GradScaler, which skips itself)."""
    stop_requests: int = 0
    """Ranks asked to stop (a signal or :meth:`hf_accum.control.TrainingControl.request_stop`) by the boundary."""
    checkpoint_requests: int = 0
    """Ranks asked for a checkpoint by the boundary."""
    aux_loss_sum: float = 0.0
    """Summed ``coef * aux_k * n_k`` of the micro-batches (MoE router losses;
    hf_accum.losses.micro_batch.MicroBatchLoss)."""
    small_batches: tuple = field(default=(), compare=False)
    """Noise scale: each rank's measured small batch, ``(targets, |g_small|^2)`` pairs (empty when not measured)."""
    pooled_small_batches: tuple = field(default=(), compare=False)
    """Noise scale from every micro-batch: ``(m, sum_k b_k |g_k|^2)`` over all ranks' micro-batches with a target
    (empty when not measured; :func:`hf_accum.measure.noise_scale.pooled_estimate`)."""
    extra_terms: dict = field(default_factory=dict, compare=False)
    """A loss of several terms: ``{name: [sum, count]}`` of each term after the primary one (whose sum and count
    are ``loss_sum`` and ``targets``), e.g. DPO's ``sft`` term per chosen token."""

    def add(self, other: WindowTotals) -> None:
        """Fold another window in (totals over a logging interval of several updates; the small batches are
        one update's own measurement and are not folded)."""
        for name in _TALLY_COLUMNS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name, (term_sum, count) in other.extra_terms.items():
            mine = self.extra_terms.setdefault(name, [0.0, 0])
            mine[0] += term_sum
            mine[1] += count

    @property
    def term_counts(self) -> list[int]:
        """Every term's count, the primary one first."""
        return [self.targets] + [count for _, count in self.extra_terms.values()]

    @property
    def mean_loss(self) -> float:
        """Exact mean loss of the window: ``sum_j S_j / N_j`` over its terms (one term: the per-target mean; nan
        when the primary term had no units; an extra term without units adds nothing)."""
        if not self.targets:
            return float("nan")
        return self.loss_sum / self.targets + sum(s / n for s, n in self.extra_terms.values() if n)

    def term_means(self) -> dict[str, float]:
        """Each extra term's own mean (for logs), by name."""
        return {name: s / n for name, (s, n) in self.extra_terms.items() if n}

    @property
    def mean_aux_loss(self) -> float:
        """The update's router-loss term: ``coef`` x the token-weighted mean of its micro-batches' aux losses."""
        return self.aux_loss_sum / self.targets if self.targets else float("nan")

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def nonfinite(self) -> bool:
        """The window must not reach the weights: some loss or gradient was inf/NaN."""
        return bool(self.nonfinite_losses or self.nonfinite_gradients)

    @property
    def nonfinite_reason(self) -> str:
        """Why the window was skipped ('' when it was finite), for logs."""
        if self.nonfinite_losses:
            return f"inf/nan loss in {self.nonfinite_losses} micro-batch(es)"
        return "inf/nan gradients" if self.nonfinite_gradients else ""


class DeviceSums:
    """Per-rank float64 sums of named columns, kept on the device and summed over ranks in one all-reduce.

    The one implementation of "add up numbers per micro-batch without a host sync, reduce once": the window
    tally below and TRL's metric sums (:mod:`hf_accum.trainer.sft`) are both built on it. float64 keeps counts exact
    to 2**53 and loss sums far beyond what one update holds.
    """

    def __init__(self, columns: Iterable[str], device: torch.device | str = "cpu") -> None:
        self.columns = tuple(columns)
        self.device = device
        self._sums: torch.Tensor | None = None

    def add(self, **values: Any) -> None:
        """Add one row (missing columns add 0); values may be Python numbers or 0-d tensors on any device."""
        row = torch.stack(
            [torch.as_tensor(values.get(name, 0.0)).to(self.device, torch.float64).reshape(()) for name in self.columns]
        )
        self._sums = row if self._sums is None else self._sums + row

    def reduce(self, accelerator: Any) -> dict[str, float]:
        """This rank's sums, summed over all ranks, by column; the sums are cleared. A collective: every rank
        must call it."""
        sums = self._sums
        if sums is None:
            sums = torch.zeros(len(self.columns), dtype=torch.float64, device=self.device)
        self._sums = None
        return dict(zip(self.columns, global_sum(sums, accelerator).tolist()))

    def reset(self) -> None:
        self._sums = None


class LoggedMeans:
    """TRL's logged metrics made exact over the update: per-rank sums over units (``unit``: pairs, ...) of
    ``metrics`` (:class:`DeviceSums`: one all-reduce per update), their totals over all ranks since the last log
    line, and the per-unit means of those totals. ``extra`` columns (a token count) are summed, not averaged.
    Shared by the preference trainers (:mod:`hf_accum.trainer.dpo`, :mod:`hf_accum.trainer.reward`)."""

    def __init__(self, unit: str, metrics: Iterable[str], device: torch.device | str = "cpu",
                 extra: Iterable[str] = ()) -> None:
        self.unit = unit
        self.metrics = tuple(metrics)
        self.columns = (unit, *self.metrics, *extra)
        self._pending = DeviceSums(self.columns, device)
        self._totals = torch.zeros(len(self.columns), dtype=torch.float64)

    def add(self, **sums: Any) -> None:
        self._pending.add(**sums)

    def reduce(self, accelerator: Any) -> dict[str, float]:
        """Fold this rank's pending sums, summed over all ranks, into the totals; returns that reduced row. A
        collective: every rank must call it."""
        reduced = self._pending.reduce(accelerator)
        self._totals += torch.tensor([reduced[name] for name in self.columns], dtype=torch.float64)
        return reduced

    def take_means(self) -> dict[str, float]:
        """Per-unit means of the metrics over the totals (then cleared); empty when no unit was seen."""
        totals = dict(zip(self.columns, self._totals.tolist()))
        self._totals.zero_()
        units = totals[self.unit]
        return {name: totals[name] / units for name in self.metrics} if units else {}

    def reset(self) -> None:
        self._pending.reset()
        self._totals.zero_()


# The columns of a window tally, summed over micro-batches and then over ranks in one all-reduce.
_TALLY_COLUMNS = tuple(name for name in WindowTotals.__dataclass_fields__
                       if name not in ("small_batches", "pooled_small_batches", "extra_terms"))
_POOLED_COLUMNS = ("pooled_micro_batches", "pooled_weighted_grad_sq")


class WindowTally:
    """Running per-rank sums of the current window, reduced across ranks in one all-reduce.

    Loss and counts stay tensors on the device (no device->host sync per micro-step for them);
    the window's one sync is :meth:`reduce`, once per update. The same all-reduce carries the flags
    every rank must agree on (inf/NaN, stop and checkpoint requests): no extra collective.
    """

    def __init__(self, device: torch.device | str = "cpu", small_batch_slots: int = 0,
                 extra_terms: Iterable[str] = (), pooled_small_batches: bool = False) -> None:
        # Noise scale: one (targets, |g|^2) slot pair per rank. Each rank writes only its own slot, so the
        # summed vector holds every rank's pair after the one all-reduce -- a gather without a collective.
        self.slots = small_batch_slots
        self._slot_columns = [(f"small_targets_{r}", f"small_grad_sq_{r}") for r in range(small_batch_slots)]
        # A loss of several terms: a (sum, count) column pair per term after the primary one, in the same vector.
        self.extra_terms = tuple(extra_terms)
        self._term_columns = [(f"term_sum/{name}", f"term_count/{name}") for name in self.extra_terms]
        # Noise scale from every micro-batch: two sums over micro-batches and ranks, whatever K is (kept in a
        # 2-vector of their own per micro-batch, folded into the tally once per window: fewer ops per micro-batch).
        self.pooled = pooled_small_batches
        self._pooled_pending: torch.Tensor | None = None
        pairs = self._slot_columns + self._term_columns + ([_POOLED_COLUMNS] if pooled_small_batches else [])
        columns = _TALLY_COLUMNS + tuple(column for pair in pairs for column in pair)
        self._sums = DeviceSums(columns, device)

    @property
    def device(self) -> torch.device | str:
        return self._sums.device

    def add(
        self, loss_sum: torch.Tensor, n_targets: torch.Tensor, batch: Mapping[str, Any],
        aux_sum: torch.Tensor | None = None,
    ) -> None:
        """One micro-batch; ``aux_sum``: the part of ``loss_sum`` that is the model's extra terms (logged apart).
        A loss of several terms passes 1-d ``loss_sum`` / ``n_targets`` (:func:`split_terms`)."""
        loss_sum, n_targets, extra = split_terms(loss_sum, n_targets)
        if len(extra) != len(self._term_columns):
            raise ValueError(f"the loss returned {1 + len(extra)} term(s) but the window tallies "
                             f"{1 + len(self._term_columns)} ({('primary',) + self.extra_terms})")
        terms = {}
        for (sum_column, count_column), (term_sum, count) in zip(self._term_columns, extra):
            terms[sum_column] = term_sum.detach()
            terms[count_column] = count
        sequences, real_tokens, total_tokens = batch_shape_counts(batch)
        loss = loss_sum.detach().to(torch.float64).reshape(())
        aux = aux_sum.detach().to(loss.device, torch.float64).reshape(()) if aux_sum is not None else None
        nonfinite = ~torch.isfinite(loss)
        for term_sum, _ in extra:
            nonfinite = nonfinite | ~torch.isfinite(term_sum.detach().to(loss.device))
        self._sums.add(
            loss_sum=loss - aux if aux is not None else loss,
            aux_loss_sum=aux if aux is not None else 0.0,
            targets=n_targets,
            sequences=sequences,
            real_tokens=real_tokens,
            total_tokens=float(total_tokens),
            squared_lengths=squared_sequence_lengths(batch),
            micro_batches=1.0,
            nonfinite_losses=nonfinite.to(torch.float64),  # stays on the device: no sync
            **terms,
        )

    def mark_boundary(
        self, nonfinite_gradients: torch.Tensor | bool = False, stop_requested: bool = False,
        checkpoint_requested: bool = False,
    ) -> None:
        """Before :meth:`reduce` at the window's end: this rank's flags, so that every rank decides alike."""
        self._sums.add(
            nonfinite_gradients=torch.as_tensor(nonfinite_gradients, device=self.device).to(torch.float64),
            stop_requests=float(stop_requested),
            checkpoint_requests=float(checkpoint_requested),
        )

    def add_small_batch(self, rank: int, targets: torch.Tensor, grad_sq: torch.Tensor) -> None:
        """This rank's noise-scale small batch of the window (into its own slot)."""
        targets_column, grad_sq_column = self._slot_columns[rank]
        self._sums.add(**{targets_column: targets, grad_sq_column: grad_sq})

    def add_micro_batch_small(self, targets: torch.Tensor, grad_sq: torch.Tensor) -> None:
        """One micro-batch as a noise-scale small batch (every-micro-batch mode): ``m += 1`` and
        ``+= b |g|^2`` when it has a target."""
        has_targets = (targets > 0).to(torch.float64)
        row = torch.stack((has_targets, has_targets * targets * grad_sq))
        self._pooled_pending = row if self._pooled_pending is None else self._pooled_pending + row

    def reduce(self, accelerator: Any) -> WindowTotals:
        """All ranks' totals of this window (the tally starts over). Every rank must call it (a collective)."""
        if self._pooled_pending is not None:
            self._sums.add(**dict(zip(_POOLED_COLUMNS, self._pooled_pending.unbind())))
            self._pooled_pending = None
        values = self._sums.reduce(accelerator)
        pooled = tuple(values.pop(name) for name in _POOLED_COLUMNS) if self.pooled else ()
        losses = {name: values.pop(name) for name in ("loss_sum", "aux_loss_sum")}  # inf/nan stay: counts are exact
        small = tuple((values.pop(n), values.pop(g)) for n, g in self._slot_columns)
        terms = {name: [values.pop(s), int(round(values.pop(c)))]
                 for name, (s, c) in zip(self.extra_terms, self._term_columns)}
        # WindowTotals' float and int columns, named at run time (Any: mypy cannot match names to fields)
        columns: dict[str, Any] = {**losses, **{name: int(round(value)) for name, value in values.items()}}
        totals = WindowTotals(**columns)
        totals.small_batches = tuple(pair for pair in small if pair[0] > 0)
        totals.pooled_small_batches = pooled
        totals.extra_terms = terms
        return totals

    def reset(self) -> None:
        self._sums.reset()
        self._pooled_pending = None


def nonfinite_flag(tensors: Iterable[torch.Tensor | None], device: torch.device | str) -> torch.Tensor:
    """1.0 when any tensor holds an inf/NaN, else 0.0, as a float64 scalar on ``device`` (no host sync).

    The max-norm (largest magnitude) is finite exactly when every element is, and unlike the 2-norm it
    cannot overflow in fp16/bf16.
    """
    # Sharded gradients (DTensor): this rank's shard; the flags are summed over ranks afterwards.
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]
    if not local:
        return torch.zeros((), dtype=torch.float64, device=device)
    largest = torch.stack([norm.to(device, torch.float64) for norm in torch._foreach_norm(local, float("inf"))])
    return (~torch.isfinite(largest)).any().to(torch.float64)


def packed_sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Where each sequence of padding-free packed rows starts (bool, ``position_ids``' shape): wherever the
    positions do not increase -- a packed row restarts them, at 0 (``PackingCollator``,
    ``DataCollatorWithFlattening``) or at 1 for collators counting from 1 -- and at each row's first position."""
    starts = torch.ones(position_ids.shape, dtype=torch.bool, device=position_ids.device)
    starts[..., 1:] = position_ids[..., 1:] <= position_ids[..., :-1]
    return starts


def batch_shape_counts(batch: Mapping[str, Any]) -> tuple[int | torch.Tensor, int | torch.Tensor, int]:
    """(sequences, real tokens, token positions) of a collated micro-batch.

    Padding-free packed batches (``position_ids`` restarting, no attention mask) count one sequence per
    restart (:func:`packed_sequence_starts`) and have no padding.
    """
    input_ids = batch.get("input_ids")
    if input_ids is None:
        labels = batch["labels"]
        return int(labels.shape[0]), int(labels.numel()), int(labels.numel())
    total = int(input_ids.numel())
    mask = batch.get("attention_mask")
    position_ids = batch.get("position_ids")
    if mask is None and position_ids is not None and input_ids.shape[0] == 1:
        return packed_sequence_starts(position_ids).sum(), total, total  # a tensor: counted on the device
    real = mask.sum() if mask is not None else total
    return int(input_ids.shape[0]), real, total


def squared_sequence_lengths(batch: Mapping[str, Any]) -> int | torch.Tensor:
    """Sum over a collated micro-batch's sequences of (real length)^2, the same sequences as
    :func:`batch_shape_counts` (padded rows: the attention mask's ones; padding-free packed rows: each restart of
    ``position_ids``). On the device, no host sync."""
    input_ids = batch.get("input_ids")
    if input_ids is None:
        labels = batch["labels"]
        return int(labels.shape[0]) * (int(labels.shape[-1]) if labels.dim() > 1 else 1) ** 2
    mask = batch.get("attention_mask")
    position_ids = batch.get("position_ids")
    if mask is None and position_ids is not None and input_ids.shape[0] == 1:
        sequence = packed_sequence_starts(position_ids).reshape(-1).cumsum(0) - 1
        return torch.bincount(sequence).pow(2).sum()
    if mask is not None and mask.dim() == 2:
        return mask.sum(-1).pow(2).sum()
    rows, length = (int(input_ids.shape[0]), int(input_ids.shape[-1])) if input_ids.dim() > 1 else (1, len(input_ids))
    return rows * length**2
