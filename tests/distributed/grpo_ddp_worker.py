"""torchrun worker (2 CPU processes, gloo): AccumGRPOTrainer and stock ``trl.GRPOTrainer`` with generation replaced
(hf_accum/testing/grpo_reference.py), rank 0's completions up to 7 tokens and rank 1's 1-2 tokens, so the ranks' token counts
differ several-fold; AccumGRPOTrainer's log-probs are the fused ones (hf_accum/fused/logprobs.py, its default).
Every update's applied gradient is compared on rank 0 with the reference over both ranks'
micro-batches (gathered). Rank 0 writes a JSON report to ``argv[1]``.

Launched by tests/distributed/test_grpo_ddp.py; all runs share one launch (process start-up dominates).
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import os
import sys

import torch.distributed as dist
from trl import GRPOTrainer  # noqa: E402

from hf_accum import AccumGRPOTrainer  # noqa: E402
from hf_accum.distributed import leave_process_group  # noqa: E402
from hf_accum.testing.grpo_reference import build_trainer, update_errors  # noqa: E402

# name: (trainer class, GRPOConfig overrides); 12 prompts x 2 generations over 2 ranks: 6 micro-batches per rank,
# windows of K=2 micro-batches, a generation every 3 (steps_per_generation != K).
RUNS = {
    "accum_dapo": (AccumGRPOTrainer, {"loss_type": "dapo", "beta": 0.1}),
    "accum_grpo": (AccumGRPOTrainer, {"loss_type": "grpo", "beta": 0.1}),
    "accum_bnpo": (AccumGRPOTrainer, {"loss_type": "bnpo"}),
    "accum_dr_grpo": (AccumGRPOTrainer, {"loss_type": "dr_grpo"}),
    "accum_luspo": (AccumGRPOTrainer, {"loss_type": "luspo", "importance_sampling_level": "sequence"}),
    "accum_dapo_short_window": (AccumGRPOTrainer, {"loss_type": "dapo", "gradient_accumulation_steps": 4}),
    # The entropy bonus's gradient through the fused log-probs' entropy, with the KL term.
    "accum_grpo_entropy": (AccumGRPOTrainer, {"loss_type": "grpo", "beta": 0.1, "entropy_coef": 0.05}),
    "stock_dapo": (GRPOTrainer, {"loss_type": "dapo"}),
    "stock_bnpo": (GRPOTrainer, {"loss_type": "bnpo"}),
}


def run(name: str, out_dir: str) -> dict | None:
    trainer_cls, config = RUNS[name]
    trainer, recorder, _ = build_trainer(trainer_cls, os.path.join(out_dir, name), ddp_find_unused_parameters=False,
                                         **config)
    trainer.train()
    local = [update.micro_batches for update in recorder.updates]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    if dist.get_rank() != 0:
        return None
    per_update = [[mb for rank in gathered for mb in rank[index]] for index in range(len(local))]
    tokens = [[int(mb["completion_mask"].sum()) for mb in rank_updates[0]] for rank_updates in gathered]
    return {"errors": update_errors(trainer, recorder, per_update), "windows": [len(u) for u in local],
            "first_update_tokens_by_rank": tokens, "world_size": trainer.args.world_size,
            "fused_forwards": trainer.fused_logprobs.forwards if hasattr(trainer, "fused_logprobs") else 0}


def main(report_path: str) -> None:
    out_dir = os.path.dirname(report_path)
    report = {name: run(name, out_dir) for name in RUNS}
    report["world_size"] = dist.get_world_size()
    if dist.get_rank() == 0:
        with open(report_path, "w") as handle:
            json.dump(report, handle)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
