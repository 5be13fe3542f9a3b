"""torchrun worker (2 CPU processes, gloo): reward models on ranks holding different numbers of pairs
(``even_batches=False``: 15 pairs in micro-batches of 2 give one rank 8 pairs and the other 7, so with K = 2 the
second update's micro-batches are 2, 2 on one rank and 2, 1 on the other), audited against the big-batch reference
on rank 0 (hf_accum/testing/reward_reference.py gathers every rank's micro-batches). Runs: AccumRewardTrainer
(Bradley-Terry; with margins and centering), an evaluation with Accelerate's repeated pairs (``even_batches=True``),
``hf_accum.train`` with ``RewardPairLoss`` (margins and centering), and stock ``RewardTrainer`` with
``even_batches=True`` (with ``even_batches=False`` its metric gathers fail): it trains a repeated pair, measured
against the update's distinct pairs. Rank 0 writes a JSON report to ``argv[1]``.

Launched by tests/distributed/test_reward_ddp.py. A worker of its own rather than jobs in dpo_ddp_worker.py, which
the DPO work changes independently: one small launch (~35 s on 2 shared cores).
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate import PartialState
from trl import RewardTrainer

from hf_accum import AccumRewardTrainer  # noqa: E402
from hf_accum.distributed import leave_process_group  # noqa: E402
from hf_accum.testing.reward_reference import (  # noqa: E402
    reference_loss,
    reward_features,
    reward_rows,
    run_reward_loop,
    run_reward_trainer,
    update_pairs,
)
from hf_accum.testing.sft import sft_tokenizer  # noqa: E402

TOKENIZER = sft_tokenizer()
RUNS = {  # name: (trainer, margins, center_rewards_coefficient, even_batches)
    "accum_bradley_terry": (AccumRewardTrainer, False, None, False),
    "accum_margin_centering": (AccumRewardTrainer, True, 0.05, False),
    "stock_even_batches": (RewardTrainer, False, None, True),
}


def main(report_path: str) -> None:
    torch.set_num_threads(1)
    out_dir = os.path.dirname(report_path)
    PartialState(cpu=True)  # the process group (gloo), as the trainers will find it
    report: dict = {"world_size": dist.get_world_size()}
    for name, (trainer_cls, margins, center, even) in RUNS.items():
        run = run_reward_trainer(trainer_cls, reward_rows(15, seed=4, margins=margins), TOKENIZER,
                                 os.path.join(out_dir, name), micro_batch=2, accumulation=2,
                                 center_rewards_coefficient=center, even_batches=even, distinct=True)
        report[name] = {key: run[key] for key in ("errors", "pairs", "logs", "metrics", "losses")}
        report[name]["distinct_pairs"] = run.get("distinct_pairs", [])
        if name == "accum_margin_centering":
            report["evaluation"] = evaluate_repeated(run["trainer"])
    loop = run_reward_loop(reward_features(15, seed=6, margins=True), TOKENIZER, center_rewards_coefficient=0.05,
                           micro_batch=2, accumulation=2, even_batches=False)
    report["loop_margin_centering"] = {"errors": loop["errors"], "pairs": loop["pairs"],
                                       "targets": [update.targets for update in loop["result"].updates]}
    if dist.get_rank() == 0:
        with open(report_path, "w") as handle:
            json.dump(report, handle)
    dist.barrier()


def evaluate_repeated(trainer: AccumRewardTrainer) -> dict:
    """``evaluate`` on 5 pairs, 2 per rank and step, ``even_batches=True``: the second step repeats 3 pairs to
    even out the ranks. Returns the logged metrics and, on rank 0, the reference loss over the 5 distinct pairs."""
    recorded: list[dict] = []
    collator = trainer.data_collator

    def record(examples: list[dict]) -> dict:
        batch = collator(examples)
        recorded.append({key: value.clone() for key, value in batch.items() if torch.is_tensor(value)})
        return batch

    trainer.data_collator = record
    trainer.accelerator.even_batches = True
    trainer.args.per_device_eval_batch_size = 2
    metrics = trainer.evaluate(eval_dataset=reward_rows(5, seed=9, margins=True))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, recorded)
    batches = [batch for rank_batches in gathered for batch in rank_batches]
    pairs = update_pairs([batches], distinct=True)[0]
    with torch.no_grad():
        expected = float(reference_loss(trainer.model.eval(), pairs, 0.05))
    return {"metrics": metrics, "reference_loss": expected, "distinct_pairs": len(pairs),
            "evaluated_pairs": sum(batch["input_ids"].shape[0] // 2 for batch in batches)}


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
