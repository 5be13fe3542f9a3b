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

A window with ``N == 0`` (every label masked) has no mean: it applies no update.
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


class Fp32GradientAccumulator:
    """Accumulate the gradients of low-precision (bf16/fp16) weights in fp32 across a window.

    ``.grad`` has the weight's dtype, so K micro-batch gradients summed into a bf16 ``.grad`` are
    rounded to 8 mantissa bits K times (measured: +15% on the bf16 compute error at K=8). A
    post-accumulate hook moves each micro-batch's gradient into an fp32 buffer instead, and
    :meth:`write_gradients_` applies the window's scale factor in fp32 and rounds once.

    Single process only: DDP's reducer owns ``.grad`` buckets during the all-reduce.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter]):
        self.parameters = [
            p for p in parameters if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)
        ]
        self._sums: dict[int, torch.Tensor] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._stash) for p in self.parameters]

    def _stash(self, parameter: torch.nn.Parameter) -> None:
        key = id(parameter)
        if key in self._sums:
            self._sums[key].add_(parameter.grad)  # add_ upcasts the bf16 grad into the fp32 sum
        else:
            self._sums[key] = parameter.grad.float()
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

    def clear(self) -> None:
        self._sums.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class WindowTotals:
    """What one update window held, summed over micro-batches and (after ``reduce``) ranks."""

    loss_sum: float = 0.0
    targets: int = 0
    sequences: int = 0
    real_tokens: int = 0
    total_tokens: int = 0
    micro_batches: int = 0

    def add(self, other: "WindowTotals") -> None:
        """Fold another window in (totals over a logging interval of several updates)."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def mean_loss(self) -> float:
        """Exact per-target mean loss of the window (nan when it had no targets)."""
        return self.loss_sum / self.targets if self.targets else float("nan")

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.total_tokens if self.total_tokens else 0.0


@dataclass
class WindowTally:
    """Running per-rank sums of the current window, reduced across ranks in one all-reduce.

    Loss and counts stay tensors on the device (no device->host sync per micro-step for them);
    the window's one sync is :meth:`reduce`, once per update.
    """

    device: torch.device | str = "cpu"
    _sums: torch.Tensor | None = field(default=None, repr=False)

    def add(self, loss_sum: torch.Tensor, n_targets: torch.Tensor, batch: Mapping[str, Any]) -> None:
        sequences, real_tokens, total_tokens = batch_shape_counts(batch)
        row = torch.stack(
            [
                loss_sum.detach().to(torch.float64).reshape(()),
                torch.as_tensor(n_targets).to(self.device, torch.float64).reshape(()),
                torch.as_tensor(sequences).to(self.device, torch.float64).reshape(()),
                torch.as_tensor(real_tokens).to(self.device, torch.float64).reshape(()),
                torch.tensor(float(total_tokens), dtype=torch.float64, device=self.device),
                torch.ones((), dtype=torch.float64, device=self.device),  # one micro-batch
            ]
        ).to(self.device)
        self._sums = row if self._sums is None else self._sums + row

    def reduce(self, accelerator: Any) -> WindowTotals:
        """All ranks' totals of this window. Every rank must call it (it is a collective)."""
        sums = self._sums if self._sums is not None else torch.zeros(6, dtype=torch.float64, device=self.device)
        sums = global_sum(sums, accelerator).tolist()
        return WindowTotals(
            loss_sum=sums[0],
            targets=int(round(sums[1])),
            sequences=int(round(sums[2])),
            real_tokens=int(round(sums[3])),
            total_tokens=int(round(sums[4])),
            micro_batches=int(round(sums[5])),
        )

    def reset(self) -> None:
        self._sums = None


def batch_shape_counts(batch: Mapping[str, Any]) -> tuple[int | torch.Tensor, int | torch.Tensor, int]:
    """(sequences, real tokens, token positions) of a collated micro-batch.

    Padding-free packed batches (``position_ids`` restarting at 0, no attention mask) count
    one sequence per restart and have no padding.
    """
    input_ids = batch.get("input_ids")
    if input_ids is None:
        labels = batch["labels"]
        return int(labels.shape[0]), int(labels.numel()), int(labels.numel())
    total = int(input_ids.numel())
    mask = batch.get("attention_mask")
    position_ids = batch.get("position_ids")
    if mask is None and position_ids is not None and input_ids.shape[0] == 1:
        return position_ids.eq(0).sum(), total, total  # a tensor: counted on the device
    real = mask.sum() if mask is not None else total
    return int(input_ids.shape[0]), real, total

