"""torchrun worker, the Trainer + TRL family (2 CPU processes, gloo): every check of the Trainer-side drop-ins
under DDP in ONE launch, as a job table (:mod:`hf_accum.testing.jobs`; process start-up, TRL's imports included,
costs more than most checks). Every run is audited against the big batch of both ranks (the auditors gather every
rank's micro-batches). Rank 0 writes ``{job: result}`` to ``argv[1]``; the tests read their job
(tests/distributed/conftest.py, ``trainer_ddp_family``).

* ``trainer_ddp``: AccumTrainer and stock Trainer on ranks with ~10x different token counts,
  ``average_tokens_across_devices`` True and False (stock with False: the negative control), evaluation;
* ``sft``: AccumSFTTrainer and stock TRL SFTTrainer on TRL's own prompt/completion preparation and collator;
* ``dpo``: DPO on ranks holding different numbers of pairs (``even_batches=False``: 11 pairs in micro-batches of 2
  give one rank 6 pairs and the other 5): AccumDPOTrainer (sigmoid; sigmoid + sft, live and precomputed reference),
  the loop with DPOPairLoss, all on the fused log-probs; stock ``DPOTrainer`` with ``even_batches=True`` (it trains
  a repeated pair): the negative control;
* ``grpo``: AccumGRPOTrainer and stock ``trl.GRPOTrainer`` with generation replaced
  (hf_accum/testing/grpo_reference.py), the ranks' completion token counts several-fold apart;
* ``reward``: reward models on ranks holding 8 and 7 pairs: AccumRewardTrainer (Bradley-Terry; margins and
  centering), an evaluation with Accelerate's repeated pairs, the loop with ``RewardPairLoss``, stock
  ``RewardTrainer`` with ``even_batches=True`` (a repeated pair) as the negative control;
* ``dpo_precompute``: AccumDPOTrainer's precomputed reference log-probs with a dataset built in memory, uneven ranks,
  against the live reference; stock ``DPOTrainer`` (FileNotFoundError on rank 1) as the negative control.

Run as ``torchrun --nproc_per_node 2 tests/distributed/trainer_ddp_worker.py OUT.json``.
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import os
import sys

import torch
import torch.distributed as dist
from accelerate import PartialState
from transformers import Trainer

from hf_accum import AccumTrainer
from hf_accum.distributed import leave_process_group
from hf_accum.testing import Scenario, independent_mean_loss, run_trainer
from hf_accum.testing.cases.dpo_precompute_case import dpo_precompute
from hf_accum.testing.cases.trainer_ddp_case import EVAL_BATCH, EVAL_ROWS, scenario
from hf_accum.testing.jobs import run_job_table

# -- AccumTrainer and stock Trainer -------------------------------------------------------------------------


def trainer_ddp(out_dir: str) -> dict:
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
    report["two_process_checkpoint"] = os.path.join(out_dir, "accum_avg_true", "checkpoint-2")
    return report


# -- SFT --------------------------------------------------------------------------------------------------


def sft(out_dir: str) -> dict:
    from trl import SFTConfig, SFTTrainer

    from hf_accum import AccumSFTTrainer
    from hf_accum.testing.sft import sft_model_factory, sft_rows, sft_tokenizer

    micro_batch, tokenizer = 2, sft_tokenizer()
    # Accelerate deals micro-batch i to rank i % 2 (sequential sampler): rank 0 gets only rows with a
    # 30-word prompt and a 20-word answer, rank 1 only 1-word prompts and answers, so the ranks' target
    # counts differ ~10x. 8 micro-batches = 4 per rank = 2 windows of 2 micro-batches.
    rows = sft_rows(16, "prompt_completion", seed=21, prompt_words=(1, 30), answer_words=(1, 20),
                    long_rows=lambda i: (i // micro_batch) % 2 == 0)
    case = Scenario("sft_ddp", sft_model_factory(tokenizer), rows, collator=None, micro_batch=micro_batch,
                    accumulation=2, pad_token_id=tokenizer.pad_token_id,
                    args={"bf16": False, "activation_checkpointing": False, "ddp_find_unused_parameters": False})
    report: dict = {}
    runs = {"accum_avg_true": (AccumSFTTrainer, True), "accum_avg_false": (AccumSFTTrainer, False),
            "stock_avg_false": (SFTTrainer, False)}
    for name, (trainer_cls, average) in runs.items():
        run = run_trainer(case, os.path.join(out_dir, name), trainer_cls, args_cls=SFTConfig,
                          trainer_kwargs={"processing_class": tokenizer}, average_tokens_across_devices=average)
        report[name] = {"errors": run.errors, "targets": [r.targets for r in run.auditor.records],
                        "logs": run.update_logs, "args_world_size": run.trainer.args.world_size}
    return report


# -- DPO --------------------------------------------------------------------------------------------------


def dpo(out_dir: str) -> dict:
    from datasets import load_from_disk
    from trl import DPOTrainer

    from hf_accum import AccumDPOTrainer
    from hf_accum.losses.preference import DPOPairLoss
    from hf_accum.testing.dpo_reference import pair_features, preference_rows, run_dpo_loop, run_dpo_trainer
    from hf_accum.testing.sft import sft_tokenizer

    tokenizer, sigmoid_sft = sft_tokenizer(), dict(loss_type=("sigmoid", "sft"), loss_weights=[1.0, 0.5])
    trainer_runs = {
        "accum_sigmoid": (AccumDPOTrainer, dict(loss_type=("sigmoid",)), False),
        "accum_sigmoid_sft_precomputed": (AccumDPOTrainer, dict(sigmoid_sft, precompute=True), False),
        "accum_sigmoid_sft": (AccumDPOTrainer, sigmoid_sft, False),
        "stock_even_batches": (DPOTrainer, sigmoid_sft, True),
    }
    # On disk: a dataset with cache files (job dpo_precompute covers one built in memory, where stock TRL's
    # precompute fails on rank 1).
    PartialState(cpu=True)  # the process group (gloo), as the trainers will find it
    rows_dir = os.path.join(out_dir, "rows")
    if dist.get_rank() == 0:
        preference_rows(11, seed=5).save_to_disk(rows_dir)
    dist.barrier()
    rows = load_from_disk(rows_dir)
    report: dict = {}
    for name, (trainer_cls, loss, even) in trainer_runs.items():
        run = run_dpo_trainer(trainer_cls, rows, tokenizer, os.path.join(out_dir, name), micro_batch=2,
                              accumulation=2, even_batches=even, **loss)
        fused = getattr(getattr(run["trainer"], "dpo_loss", None), "fused", None)
        report[name] = {"errors": run["errors"], "pairs": run["pairs"], "logs": run["logs"],
                        "metrics": run["metrics"], "fused_forwards": fused.forwards if fused is not None else 0}
    for name, pair_loss in {"loop_sigmoid": DPOPairLoss(beta=0.5),
                            "loop_sigmoid_sft": DPOPairLoss(beta=0.5, sft_weight=0.5)}.items():
        run = run_dpo_loop(pair_features(11, seed=6), pair_loss, micro_batch=2, accumulation=2, even_batches=False)
        report[name] = {"errors": run["errors"], "pairs": run["pairs"], "fused_forwards": pair_loss.fused.forwards,
                        "targets": [update.targets for update in run["result"].updates]}
    return report


# -- GRPO -------------------------------------------------------------------------------------------------


def grpo(out_dir: str) -> dict:
    """12 prompts x 2 generations over 2 ranks: 6 micro-batches per rank, windows of K=2 micro-batches, a
    generation every 3 (steps_per_generation != K)."""
    from trl import GRPOTrainer

    from hf_accum import AccumGRPOTrainer

    runs = {
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
    return {name: _grpo_run(trainer_cls, config, os.path.join(out_dir, name))
            for name, (trainer_cls, config) in runs.items()}


def _grpo_run(trainer_cls, config: dict, out_dir: str) -> dict | None:
    from hf_accum.testing.grpo_reference import build_trainer, update_errors

    trainer, recorder, _ = build_trainer(trainer_cls, out_dir, ddp_find_unused_parameters=False, **config)
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


# -- reward models ----------------------------------------------------------------------------------------


def reward(out_dir: str) -> dict:
    """15 pairs in micro-batches of 2 (``even_batches=False``): one rank 8 pairs, the other 7, so with K = 2 the
    second update's micro-batches are 2, 2 on one rank and 2, 1 on the other."""
    from trl import RewardTrainer

    from hf_accum import AccumRewardTrainer
    from hf_accum.testing.reward_reference import reward_features, reward_rows, run_reward_loop, run_reward_trainer
    from hf_accum.testing.sft import sft_tokenizer

    tokenizer = sft_tokenizer()
    runs = {  # name: (trainer, margins, center_rewards_coefficient, even_batches)
        "accum_bradley_terry": (AccumRewardTrainer, False, None, False),
        "accum_margin_centering": (AccumRewardTrainer, True, 0.05, False),
        "stock_even_batches": (RewardTrainer, False, None, True),
    }
    PartialState(cpu=True)  # the process group (gloo), as the trainers will find it
    report: dict = {}
    for name, (trainer_cls, margins, center, even) in runs.items():
        run = run_reward_trainer(trainer_cls, reward_rows(15, seed=4, margins=margins), tokenizer,
                                 os.path.join(out_dir, name), micro_batch=2, accumulation=2,
                                 center_rewards_coefficient=center, even_batches=even, distinct=True)
        report[name] = {key: run[key] for key in ("errors", "pairs", "logs", "metrics", "losses")}
        report[name]["distinct_pairs"] = run.get("distinct_pairs", [])
        if name == "accum_margin_centering":
            report["evaluation"] = _evaluate_repeated(run["trainer"])
    loop = run_reward_loop(reward_features(15, seed=6, margins=True), tokenizer, center_rewards_coefficient=0.05,
                           micro_batch=2, accumulation=2, even_batches=False)
    report["loop_margin_centering"] = {"errors": loop["errors"], "pairs": loop["pairs"],
                                       "targets": [update.targets for update in loop["result"].updates]}
    return report


def _evaluate_repeated(trainer) -> dict:
    """``evaluate`` on 5 pairs, 2 per rank and step, ``even_batches=True``: the second step repeats 3 pairs to
    even out the ranks. Returns the logged metrics and, on rank 0, the reference loss over the 5 distinct pairs."""
    from hf_accum.testing.reward_reference import reference_loss, reward_rows, update_pairs

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


JOBS = {"trainer_ddp": trainer_ddp, "sft": sft, "dpo": dpo, "grpo": grpo, "reward": reward,
        "dpo_precompute": dpo_precompute}  # hf_accum/testing/cases/dpo_precompute_case.py


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_job_table(JOBS, sys.argv[1])
    leave_process_group()  # a no-op after run_job_table, which left the group
