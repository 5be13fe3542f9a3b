"""Subprocess worker: ``AccumTrainer`` on a tiny float64 Llama with LoRA (dropout on) and shuffled sampling, a
checkpoint every 2 updates (at most 2 kept), logging every update.

``python hf_accum/testing/cases/trainer_resume_worker.py OUT TAG [injections]`` (see
:mod:`hf_accum.testing.interruptions`), or the same under torchrun. Every run resumes from the latest complete
checkpoint in ``OUT/run`` when there is one: re-running the same command continues an interrupted run. Same data
layout as :mod:`hf_accum.testing.cases.loop_resume_worker`: one process has windows of 4, 4 and a short 3 per
epoch, two processes 3, 3 and a short 1; 6 updates over 2 epochs.
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import argparse
import logging
import os
import sys
from typing import Any

import torch
from transformers import TrainerCallback

from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, Scenario, random_rows, tiny_lora_causal_lm, training_args
from hf_accum.testing.cases.loop_resume_worker import MICRO_BATCH, layout
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


class _Record(TrainerCallback):
    """Per update: the logged exact loss and LR (logging_steps=1), and the SIGTERM injection."""

    def __init__(self, recorder: Recorder, args: argparse.Namespace) -> None:
        self.recorder = recorder
        self.args = args

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        maybe_sigterm(self.args, state.global_step, args.process_index)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs and "train_runtime" not in logs:
            self.recorder.update(state.global_step, logs["learning_rate"], logs["loss"], True)


def build(args: argparse.Namespace, micro_batch: int = MICRO_BATCH, accumulation: int | None = None) -> AccumTrainer:
    """The story's trainer; ``micro_batch``/``accumulation`` let a test ask for another batch plan."""
    logging.getLogger("transformers.trainer").setLevel(logging.WARNING)
    rows, default_accumulation = layout(int(os.environ.get("WORLD_SIZE", "1")))
    scenario = Scenario(
        "resume", tiny_lora_causal_lm, random_rows(rows, seed=31, prompt_masking=True),
        KillAtMicroBatch(PaddingCollator(PAD), args.kill_at_micro_batch), micro_batch=micro_batch,
        accumulation=accumulation or default_accumulation, epochs=2, scheduler="linear", warmup_steps=2,
        max_grad_norm=0.5,
        args={"train_sampling_strategy": "random", "save_strategy": "steps", "save_steps": 2, "save_total_limit": 2,
              "weight_decay": 0.01, "ddp_find_unused_parameters": False},
    )
    model = scenario.model_factory()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=scenario.lr,
                                  weight_decay=0.01)
    recorder = Recorder(args.out, args.tag, int(os.environ.get("RANK", "0")) == 0)
    optimizer.register_step_pre_hook(recorder.optimizer_hook)
    trainer = AccumTrainer(
        model=model, args=training_args(scenario, run_dir(args.out)), train_dataset=scenario.examples,
        data_collator=scenario.collator, optimizers=(optimizer, None), callbacks=[_Record(recorder, args)],
    )
    trainer.recorder = recorder
    return trainer


def run(args: argparse.Namespace, **plan: Any) -> AccumTrainer:
    trainer = build(args, **plan)
    kill_during_checkpoint_write(args.kill_in_save)
    trainer.train(resume_from_checkpoint=resume_argument(args.out))
    trainer.recorder.finish(args.out, args.tag, trainable_weights(trainer.model),
                            {"log_history": trainer.state.log_history, "world_size": trainer.args.world_size})
    return trainer


if __name__ == "__main__":
    run(parse_args(sys.argv[1:]))
    leave_process_group()
