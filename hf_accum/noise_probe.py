"""Measuring the norms the noise scale needs, inside a training run (the arithmetic is in
:mod:`hf_accum.noise_scale`).

* **The small batch** is the FIRST micro-batch of each window on each rank. Right after its backward,
  before the next micro-batch adds to it, this rank's gradient buffers hold exactly that micro-batch's
  summed-loss gradient times the constant the front-end multiplied its loss by (under DDP the first
  micro-batch runs in ``no_sync``: the buffers are this rank's own). So ::

      |g_small|^2 = |buffers|^2 / (scale * n_1)^2

  one ``torch._foreach_norm`` per update, kept on the device (no host sync). With fp32 sums of bf16
  weights the buffers are the pending fp32 sums, not ``.grad``.
* **The big batch** is the update: the applied gradient's norm before clipping (the clip computed it) and
  ``B = N``. Every rank's small batch travels to every rank in the boundary's one all-reduce
  (:meth:`hf_accum.accumulation.WindowTally.add_small_batch`: a slot per rank in the summed vector).

A window of one micro-batch on a rank measures nothing there: under DDP that micro-batch's backward already
all-reduced its gradient, and on one process it is the whole update (``b = B``: no information).
"""

from __future__ import annotations

from typing import Iterable

import torch

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
    n = torch.as_tensor(n_targets).to(device, torch.float64)
    denominator = (scale * n).square()
    return torch.where(n > 0, squared_norm(buffers, device) / denominator.clamp(min=1e-300),
                       torch.zeros((), dtype=torch.float64, device=device))
