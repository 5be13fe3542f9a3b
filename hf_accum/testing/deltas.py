"""Weight-delta audit: the update a run applied vs the big-batch update, for engines that keep the
gradients out of reach (DeepSpeed ZeRO shards them inside its engine, so ``.grad`` is empty).

With SGD (no momentum, no weight decay) an update is ``w_n = w_{n-1} - lr_n * g_n``: the weight
delta reveals the applied gradient times the applied LR. :class:`DeltaRecorder` records, at every
update, the full weights (gathered from the ZeRO-3 shards) and the micro-batches of the window on
every rank; :func:`delta_errors` recomputes each update independently -- the big-batch gradient of
the mean loss over all targets (:meth:`hf_accum.verify.BigBatchAuditor.reference_gradient`, plain
``torch.nn.functional.cross_entropy``, float64) at ``w_{n-1}`` times the big-batch run's LR -- and
returns the relative error of each applied delta.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hf_accum.distributed import gathered_state_dict
from hf_accum.verify import BigBatchAuditor


class DeltaRecorder:
    """Wrap the collator, watch the model, call :meth:`record_update` after every optimizer update
    (on every rank: gathering ZeRO-3 weights is a collective)."""

    def __init__(self, collator: Callable) -> None:
        self._collator = collator
        self._pending: deque = deque()
        self._forwards = 0
        self.windows: list[list[dict]] = []  # every rank's micro-batches of each update (main process)
        self.weights: list[dict[str, torch.Tensor]] = []  # full weights after each update (main process)

    def collate(self, examples: Sequence[Any]) -> dict[str, Any]:
        batch = self._collator(examples)
        self._pending.append({k: v.clone() for k, v in batch.items() if torch.is_tensor(v)})
        return batch

    def watch(self, module: torch.nn.Module) -> None:
        """Count training forwards on the bare module (a DataLoader collates ahead of the forwards)."""

        def count(mod: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if mod.training:
                self._forwards += 1

        module.register_forward_pre_hook(count)

    def record_update(self, module: torch.nn.Module) -> None:
        window = [self._pending.popleft() for _ in range(self._forwards)]
        self._forwards = 0
        main = not dist.is_initialized() or dist.get_rank() == 0
        gathered: list = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(gathered, window)
        else:
            gathered = [window]
        weights = gathered_state_dict(module, keep=main)
        if main:
            self.windows.append([batch for rank_window in gathered for batch in rank_window])
            self.weights.append(weights)


def delta_errors(
    model_factory: Callable[[], torch.nn.Module],
    initial: dict[str, torch.Tensor],
    recorder: DeltaRecorder,
    learning_rates: list[float],
    loss_kind: str = "causal_lm",
    pad_token_id: int = 0,
) -> list[float]:
    """Relative error ``|delta_n + lr_n g_n| / |lr_n g_n|`` of every recorded update, in float64.

    ``model_factory()`` builds the architecture (its weights are overwritten), ``initial`` are the
    weights before update 1, ``learning_rates`` the big-batch run's LR at each update.
    """
    holder = model_factory().to(torch.float64)
    auditor = BigBatchAuditor(loss_kind=loss_kind, pad_token_id=pad_token_id)
    auditor.attach(holder, torch.optim.SGD(holder.parameters(), lr=0.0))
    errors = []
    before = initial
    for window, after, lr in zip(recorder.windows, recorder.weights, learning_rates):
        holder.load_state_dict({name: tensor.to(torch.float64) for name, tensor in before.items()})
        gradients, _, _ = auditor.reference_gradient(window)
        diff, norm = 0.0, 0.0
        for name, gradient in gradients.items():
            expected = -lr * gradient
            applied = after[name].to(torch.float64) - before[name].to(torch.float64)
            diff += float((applied - expected).pow(2).sum())
            norm += float(expected.pow(2).sum())
        errors.append((diff / norm) ** 0.5)
        before = after
    return errors
