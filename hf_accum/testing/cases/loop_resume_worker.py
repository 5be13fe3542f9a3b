"""Subprocess worker: ``hf_accum.train`` on a tiny float64 Llama with LoRA (dropout on, so resuming must restore
the random states too) and a shuffled dataloader, a checkpoint every 2 updates (at most 2 kept).

``python hf_accum/testing/cases/loop_resume_worker.py OUT TAG [injections]`` (see
:mod:`hf_accum.testing.interruptions`), or the same under torchrun. Every run resumes from the latest complete
checkpoint in ``OUT/run`` when there is one: re-running the same command continues an interrupted run.

One process: 22 rows of micro-batch 2 = 11 micro-batches per epoch, K=4: windows of 4, 4 and a short 3;
2 epochs = 6 updates, checkpoints after updates 2 (mid-epoch), 4 (after the short window and the epoch
boundary) and 6. Two processes: 28 rows = 7 micro-batches per rank, K=3: windows 3, 3, 1; same updates.
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import argparse
import os
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader

from hf_accum import LoopConfig, train
from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, fresh_accelerator, random_rows, tiny_lora_causal_lm
from hf_accum.testing.data import map_style
from hf_accum.testing.interruptions import (
    KillAtMicroBatch,
    Recorder,
    kill_during_checkpoint_write,
    maybe_sigterm,
    parse_args,
    resume_argument,
    run_dir,
    trainable_weights,
)

MICRO_BATCH = 2


def layout(world_size: int) -> tuple[int, int]:
    """(rows, accumulation steps) for one or two processes."""
    return (22, 4) if world_size == 1 else (28, 3)


def run(args: argparse.Namespace, micro_batch: int = MICRO_BATCH, accumulation: int | None = None,
        world_size: int | None = None) -> Any:
    """Train (or resume) the story's run; returns the TrainResult. ``micro_batch``/``accumulation`` let a
    test ask for another batch plan than the checkpoints were written with."""
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    rows, default_accumulation = layout(world)
    accelerator = fresh_accelerator(accumulation or default_accumulation)
    model = tiny_lora_causal_lm()
    collator = KillAtMicroBatch(PaddingCollator(PAD), args.kill_at_micro_batch)
    loader = DataLoader(map_style(random_rows(rows, seed=31, prompt_masking=True)), batch_size=micro_batch,
                        shuffle=True, generator=torch.Generator().manual_seed(1234), collate_fn=collator)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    recorder = Recorder(args.out, args.tag, accelerator.is_main_process)
    optimizer.register_step_pre_hook(recorder.optimizer_hook)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    kill_during_checkpoint_write(args.kill_in_save)
    config = LoopConfig(
        num_train_epochs=2, lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=0.5, disable_tqdm=True,
        output_dir=run_dir(args.out), save_steps=2, save_total_limit=2,
    )

    def on_update(update: Any) -> None:
        recorder.update(update.step, update.learning_rate, update.loss, update.applied)
        maybe_sigterm(args, update.step, accelerator.process_index)

    result = train(model, optimizer, loader, accelerator, config, on_update=on_update,
                   resume_from_checkpoint=resume_argument(args.out))
    recorder.finish(args.out, args.tag, trainable_weights(accelerator.unwrap_model(model)),
                    {"updates": result.as_dicts(), "world_size": accelerator.num_processes})
    accelerator.wait_for_everyone()
    return result


if __name__ == "__main__":
    run(parse_args(sys.argv[1:]))
    leave_process_group()
