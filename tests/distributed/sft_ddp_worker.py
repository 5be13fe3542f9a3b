"""torchrun worker (2 CPU processes, gloo): AccumSFTTrainer and stock TRL SFTTrainer on TRL's own
prompt/completion preparation and collator, with ranks holding very different token counts and
``average_tokens_across_devices`` True and False (stock: False), under a BigBatchAuditor that gathers every rank's
micro-batches. Rank 0 writes a JSON report to ``argv[1]``.

Launched by tests/distributed/test_sft_ddp.py; all runs share one launch (process start-up dominates).
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import os
import sys

import torch.distributed as dist
from trl import SFTConfig, SFTTrainer

from hf_accum import AccumSFTTrainer
from hf_accum.distributed import leave_process_group
from hf_accum.testing import Scenario, run_trainer
from hf_accum.testing.sft import sft_model_factory, sft_rows, sft_tokenizer

MICRO_BATCH, ACCUMULATION, ROWS = 2, 2, 16
TOKENIZER = sft_tokenizer()


def scenario() -> Scenario:
    # Accelerate deals micro-batch i to rank i % 2 (sequential sampler): rank 0 gets only rows with a
    # 30-word prompt and a 20-word answer, rank 1 only 1-word prompts and answers, so the ranks' target
    # counts differ ~10x. 8 micro-batches = 4 per rank = 2 windows of 2 micro-batches.
    rows = sft_rows(ROWS, "prompt_completion", seed=21, prompt_words=(1, 30), answer_words=(1, 20),
                    long_rows=lambda i: (i // MICRO_BATCH) % 2 == 0)
    return Scenario(
        "sft_ddp", sft_model_factory(TOKENIZER), rows, collator=None, micro_batch=MICRO_BATCH,
        accumulation=ACCUMULATION, pad_token_id=TOKENIZER.pad_token_id,
        args={"bf16": False, "activation_checkpointing": False, "ddp_find_unused_parameters": False},
    )


def main(report_path: str) -> None:
    out_dir = os.path.dirname(report_path)
    report: dict = {}
    runs = {
        "accum_avg_true": (AccumSFTTrainer, True),
        "accum_avg_false": (AccumSFTTrainer, False),
        "stock_avg_false": (SFTTrainer, False),
    }
    for name, (trainer_cls, average) in runs.items():
        run = run_trainer(
            scenario(), os.path.join(out_dir, name), trainer_cls, args_cls=SFTConfig,
            trainer_kwargs={"processing_class": TOKENIZER}, average_tokens_across_devices=average,
        )
        report[name] = {
            "errors": run.errors,
            "targets": [r.targets for r in run.auditor.records],
            "logs": run.update_logs,
            "args_world_size": run.trainer.args.world_size,
        }
    report["world_size"] = dist.get_world_size()
    if dist.get_rank() == 0:
        with open(report_path, "w") as handle:
            json.dump(report, handle)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
