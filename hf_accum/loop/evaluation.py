"""Held-out evaluation inside the loop: the exact per-token loss of an evaluation set (one all-reduce)."""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from hf_accum.accumulation import WindowTally
from hf_accum.distributed import is_fsdp_sharded, is_partitioned
from hf_accum.loop.config import LoopConfig
from hf_accum.loop.steppers import split_labels
from hf_accum.losses.micro_batch import MicroBatchLoss
from hf_accum.losses.model_loss import is_encoder_decoder, training_inputs


def evaluation_due(config: LoopConfig, step: int, total_updates: int, epoch_ended: bool) -> bool:
    if config.eval_strategy == "epoch":
        return epoch_ended
    if config.eval_strategy == "steps":
        every = max(1, int(config.eval_steps or 1))
        return step % every == 0 or step == total_updates
    return False


@torch.no_grad()
def evaluate_loss(model: nn.Module, dataloader: Any, accelerator: Accelerator,
                  micro_batch_loss: MicroBatchLoss) -> float:
    """The exact per-token loss of a held-out set: every batch's summed loss and target count are
    added up on each rank and all-reduced once, then divided once (not a mean of batch means).

    Each rank evaluates the batches *its* ``dataloader`` yields: give each rank a disjoint shard
    (e.g. ``examples[rank::world_size]``) and do not ``prepare`` it -- a prepared loader with
    ``even_batches`` repeats examples to even out the ranks, which would count them twice. The
    forward runs on the unwrapped model, so ranks may hold different numbers of batches (a DDP
    forward would broadcast buffers, a collective, per batch) -- except under ZeRO-3, where every
    forward gathers the parameters from all ranks: there the ranks with fewer batches run extra
    forwards that count no target. Every rank must call it (it ends in one all-reduce). ``dataloader``: any
    iterable of batches (Any: a DataLoader, a list, or None, refused here)."""
    if dataloader is None:
        raise ValueError("LoopConfig.eval_strategy is set but train() got no eval_dataloader")
    tally = WindowTally(device=accelerator.device, extra_terms=micro_batch_loss.extra_terms)
    bare = accelerator.unwrap_model(model)
    was_training = bare.training
    bare.eval()
    inputs = labels = None
    batches = dataloader if hasattr(dataloader, "__len__") else list(dataloader)
    shortfall = _forward_shortfall(bare, batches, accelerator)  # agreed before any forward
    for batch in batches:
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        labels, inputs = split_labels(batch)
        with accelerator.autocast():
            _, loss_sum, n_targets = micro_batch_loss(bare, inputs, labels)
        tally.add(loss_sum, n_targets, batch)
    if shortfall:
        _extra_forwards(bare, shortfall, inputs, labels, accelerator)
    bare.train(was_training)
    return tally.reduce(accelerator).mean_loss


def _forward_shortfall(model: nn.Module, batches: Sized, accelerator: Accelerator) -> int:
    """How many forwards this rank must add to run as many as the rank with the most batches: under
    ZeRO-3 and FSDP2 each forward is a collective (parameter gathers), and a rank that stopped early would leave
    the others waiting forever. 0 for a model that is not sharded."""
    if not (is_partitioned(model) or is_fsdp_sharded(model)):
        return 0
    most = torch.tensor([len(batches)], device=accelerator.device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most) - len(batches)


def _extra_forwards(model: nn.Module, count: int, inputs: dict[str, Any] | None, labels: torch.Tensor | None,
                    accelerator: Accelerator) -> None:
    """Forwards that count nothing: the last batch again (as it trained: an encoder-decoder's decoder inputs built
    from its labels, :func:`~hf_accum.losses.model_loss.training_inputs`), or one token where this rank had no batch."""
    if inputs is None:
        one_token = torch.zeros((1, 1), dtype=torch.long, device=accelerator.device)
        inputs = {"input_ids": one_token, **({"decoder_input_ids": one_token} if is_encoder_decoder(model) else {})}
    else:
        inputs = training_inputs(model, inputs, labels)
    with torch.no_grad(), accelerator.autocast():
        for _ in range(count):
            model(**inputs)
