"""torchrun worker (2 CPU processes, gloo): AccumTrainer and stock Trainer on ranks with very different
token counts, with ``average_tokens_across_devices`` True and False, under a BigBatchAuditor that
gathers every rank's micro-batches. Rank 0 writes a JSON report to ``argv[1]``.

Launched by tests/distributed/test_trainer_ddp.py; all scenarios share one launch (process start-up dominates).
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import os
import sys

import torch.distributed as dist
from transformers import Trainer

from hf_accum import AccumTrainer
from hf_accum.distributed import leave_process_group
from hf_accum.testing import independent_mean_loss, run_trainer
from hf_accum.testing.cases.trainer_ddp_case import EVAL_BATCH, EVAL_ROWS, scenario


def main(report_path: str) -> None:
    out_dir = os.path.dirname(report_path)
    report: dict = {}
    runs = {
        "accum_avg_true": (AccumTrainer, True),
        "accum_avg_false": (AccumTrainer, False),
        "stock_avg_true": (Trainer, True),
        "stock_avg_false": (Trainer, False),
    }
    for name, (trainer_cls, average) in runs.items():
        # One run leaves checkpoints (trained on 2 processes) for the resume-on-1-process refusal test.
        saving = {"save_strategy": "steps", "save_steps": 2} if name == "accum_avg_true" else {}
        run = run_trainer(
            scenario(), os.path.join(out_dir, name), trainer_cls, average_tokens_across_devices=average,
            ddp_find_unused_parameters=False, per_device_eval_batch_size=EVAL_BATCH, **saving,
        )
        # 10 held-out rows in batches of 3 on 2 ranks: the last step repeats 2 rows (even_batches).
        eval_loss = run.trainer.evaluate(eval_dataset=EVAL_ROWS)["eval_loss"]
        report[name] = {
            "errors": run.errors,
            "learning_rates": run.lrs,
            "scheduler_steps": run.trainer.lr_scheduler.last_epoch,
            "targets": [r.targets for r in run.auditor.records],
            "logged_tokens": [log.get("tokens_per_update") for log in run.update_logs],
            "args_world_size": run.trainer.args.world_size,
            "plan": run.trainer.batch_plan.describe() if isinstance(run.trainer, AccumTrainer) else None,
            "eval_loss": eval_loss,
            "independent_eval_loss": independent_mean_loss(run.trainer.accelerator.unwrap_model(run.trainer.model),
                                                           EVAL_ROWS),
        }
    report["world_size"] = dist.get_world_size()
    report["two_process_checkpoint"] = os.path.join(out_dir, "accum_avg_true", "checkpoint-2")
    if dist.get_rank() == 0:
        with open(report_path, "w") as handle:
            json.dump(report, handle)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
