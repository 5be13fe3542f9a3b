"""Measuring the norms the noise scale needs, inside a training run (the arithmetic is in
:mod:`hf_accum.measure.noise_scale`). Two modes pick the small batches (``noise_scale_micro_batches``):

* ``"every"`` (default): **every micro-batch** of the window, on every rank, is a small batch. A tensor hook on
  each trainable parameter sees the gradient a backward adds to ``.grad`` *before* it is added
  (:class:`MicroBatchGradNorms`), so each micro-batch's own ``|c * s_k|^2`` is summed parameter by parameter
  during its backward -- no snapshot of the accumulated gradient, no extra memory (one float64 scalar per
  parameter until the backward ends), and it also sees the window's last micro-batch under DDP, whose
  ``.grad`` is all-reduced (the hook runs before the reducer). Cost: one norm kernel per parameter per
  micro-batch (the bench's ``noise_scale`` section measures it). The boundary's all-reduce carries two sums,
  ``m`` and ``sum_k b_k |g_k|^2`` (:func:`hf_accum.measure.noise_scale.pooled_estimate`). It needs each parameter's
  gradient to arrive in one piece per backward: reentrant gradient checkpointing with a parameter shared by
  several checkpointed segments delivers it in parts, which is detected and refused (use ``"first"``).
* ``"first"``: the FIRST micro-batch of each window on each rank. Right after its backward, before the next
  micro-batch adds to it, this rank's gradient buffers hold exactly that micro-batch's summed-loss gradient
  times the constant the front-end multiplied its loss by (under DDP the first micro-batch runs in
  ``no_sync``: the buffers are this rank's own), so one ``torch._foreach_norm`` per update reads it. With
  fp32 sums of bf16 weights the buffers are the pending fp32 sums, not ``.grad``. Every rank's small batch
  travels in the boundary's one all-reduce (a slot per rank,
  :meth:`hf_accum.accumulation.WindowTally.add_small_batch`). A window of one micro-batch on a rank measures
  nothing there. It needs ~18x more updates than ``"every"`` for the same precision at K=4 (docs/recipe.md).

In both, a micro-batch's buffers (or hooked gradients) hold ``scale * grad(its summed loss)``, so ::

    |g_small|^2 = |measured|^2 / (scale * n_k)^2

and **the big batch** is the update: the applied gradient's norm before clipping (the clip computed it)
and ``B = N``. Everything stays on the device until the boundary (no host sync per micro-batch).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

# Which micro-batches are the small batches: the values and their check are the setting's (re-exported).

NOT_UNDER_DEEPSPEED = (
    "noise_scale=True is not available under DeepSpeed: the engine keeps the micro-batch gradients in its own "
    "buffers, so the first micro-batch's gradient cannot be read; use DDP or a single process"
)


NOT_UNDER_FSDP = (
    "noise_scale=True is not available under FSDP yet: each rank holds a shard of the micro-batch gradient, so "
    "its norm needs a sum over shards the measurement does not do; use DDP or a single process"
)


def squared_norm(tensors: Iterable[torch.Tensor | None], device: torch.device | str) -> torch.Tensor:
    """``sum |t|^2`` over the tensors as a float64 scalar on ``device`` (one fused norm kernel, no host sync)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]
    if not local:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([norm.to(device, torch.float64) for norm in torch._foreach_norm(local)])
    return norms.square().sum()


def small_batch_grad_sq(buffers: Iterable[torch.Tensor | None], scale: float, n_targets: torch.Tensor | int,
                        device: torch.device | str) -> torch.Tensor:
    """``|g_small|^2`` of the micro-batch whose gradient alone is in ``buffers``, which hold
    ``scale * grad(its summed loss)``; its per-target mean gradient is that over ``scale * n_targets``.
    0 when it has no target (the estimator then ignores it: ``b = 0``)."""
    return micro_batch_grad_sq(squared_norm(buffers, device), scale, n_targets, device)


class GradientInPartsError(RuntimeError):
    """A parameter's gradient arrived in several parts within one backward: its hooks cannot give its norm."""


class MicroBatchGradNorms:
    """Each backward's own gradient squared norm (``|sum of what this backward adds to .grad|^2``), from a tensor
    hook per parameter that sees the incoming gradient before it is accumulated (and before DDP's reducer).

    The hook only computes a norm (kept on the device: no host sync) and returns None, so the gradient is
    unchanged. :meth:`take` after each backward returns the sum and starts over. Remove with :meth:`remove`.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], device: torch.device | str) -> None:
        self.device = device
        self._norms: list[torch.Tensor] = []
        self._seen: set[int] = set()
        self._in_parts: str | None = None
        unique = {id(p): p for p in parameters if p.requires_grad}  # a tied weight listed twice: one hook
        self._handles = [p.register_hook(self._hook(key, f"parameter {i} {tuple(p.shape)}"))
                         for i, (key, p) in enumerate(unique.items())]

    def _hook(self, key: int, name: str) -> Callable[[torch.Tensor], None]:
        def add(grad: torch.Tensor) -> None:
            if key in self._seen:  # a second part in the same backward: |a|^2 + |b|^2 is not |a + b|^2
                self._in_parts = name
            self._seen.add(key)
            low = grad.dtype in (torch.bfloat16, torch.float16)  # accumulate a low-precision norm in fp32
            self._norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32 if low else None))
        return add

    def take(self) -> torch.Tensor:
        """``sum |grad|^2`` over what the parameters received since the last call, a float64 device scalar."""
        norms, self._norms, self._seen = self._norms, [], set()
        if self._in_parts is not None:
            name, self._in_parts = self._in_parts, None
            raise GradientInPartsError(
                f"noise_scale_micro_batches='every': {name} received its gradient in several parts within one "
                "backward (reentrant gradient checkpointing with a parameter shared by several checkpointed "
                "segments?), so the micro-batch's gradient norm cannot be summed from hooks; use "
                "noise_scale_micro_batches='first' or non-reentrant checkpointing (use_reentrant=False)")
        if not norms:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        if len({n.device for n in norms}) > 1:  # a model spread over devices (device_map)
            norms = [n.to(self.device) for n in norms]
        return torch.stack(norms).to(self.device, torch.float64).square().sum()  # stack promotes mixed dtypes

    def reset(self) -> None:
        """Forget what arrived since the last :meth:`take` (a retried window: an OOM mid-backward)."""
        self._norms, self._seen, self._in_parts = [], set(), None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def micro_batch_grad_sq(measured_sq: torch.Tensor, scale: float, n_targets: torch.Tensor | int,
                        device: torch.device | str) -> torch.Tensor:
    """``|g_k|^2`` from ``|scale * grad(summed loss)|^2`` as measured; 0 without targets (then not counted)."""
    n = torch.as_tensor(n_targets).to(device, torch.float64)
    return torch.where(n > 0, measured_sq.to(device, torch.float64) / (scale * n).square().clamp(min=1e-300),
                       torch.zeros((), dtype=torch.float64, device=device))
