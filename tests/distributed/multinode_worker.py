"""torchrun worker for a 2-node job on one host (``--nnodes 2``, 1 process per node, c10d rendezvous):
the loop and AccumTrainer, float64, uneven prompt-masked rows, under the BigBatchAuditor. Global
rank 0 writes the audited errors, the batch-plan lines both engines logged, and torchrun's view of
the node layout to ``argv[1]``.
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import logging
import os
import sys

import torch.distributed as dist

from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, Scenario, random_rows, run_exact, run_trainer, tiny_causal_lm

# 8 per device x 2 accumulation x 2 processes = 32 sequences per update; 80 rows = 10 micro-batches,
# 5 per process: windows of 2, 2 and a short 1.
EXAMPLES = random_rows(80, seed=5, min_len=3, max_len=24, prompt_masking=True)


def scenario() -> Scenario:
    return Scenario("nodes", tiny_causal_lm, EXAMPLES, PaddingCollator(PAD), micro_batch=8, accumulation=2,
                    scheduler="linear", warmup_steps=1)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main(out_path: str) -> None:
    lines = Lines()
    for name in ("hf_accum.loop", "hf_accum.trainer"):
        logging.getLogger(name).addHandler(lines)
        logging.getLogger(name).setLevel(logging.INFO)
    result, loop_audit = run_exact(scenario())
    trainer_run = run_trainer(scenario(), os.path.join(os.path.dirname(out_path), "trainer"), AccumTrainer,
                              ddp_find_unused_parameters=False)
    report = {
        "world_size": dist.get_world_size(),
        "env": {key: os.environ.get(key) for key in ("GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_RANK")},
        "loop_errors": [r.relative_error for r in loop_audit.records],
        "loop_updates": len(result.updates),
        "loop_plan": result.batch_plan.describe(),
        "trainer_errors": trainer_run.errors,
        "log_lines": lines.lines,
    }
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(report, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
