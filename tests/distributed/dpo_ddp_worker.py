"""torchrun worker (2 CPU processes, gloo): DPO on ranks holding different numbers of pairs
(``even_batches=False``: 11 pairs in micro-batches of 2 give one rank 6 pairs and the other 5), audited against
the big-batch reference on rank 0 (hf_accum/testing/dpo_reference.py gathers every rank's micro-batches). Runs:
AccumDPOTrainer (sigmoid; sigmoid + sft, live and precomputed reference), the loop with DPOPairLoss (one and two
terms) -- all on the fused log-probs (hf_accum/fused/logprobs.py, their default) --, and stock ``DPOTrainer`` (sigmoid + sft) with Accelerate's default ``even_batches=True`` (it trains a
repeated pair; with ``even_batches=False`` its metric gathers fail). Rank 0 writes a JSON report to ``argv[1]``.

Launched by tests/distributed/test_dpo_ddp.py.
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
from datasets import load_from_disk
from trl import DPOTrainer

from hf_accum import AccumDPOTrainer  # noqa: E402
from hf_accum.distributed import leave_process_group  # noqa: E402
from hf_accum.losses.preference import DPOPairLoss  # noqa: E402
from hf_accum.testing.dpo_reference import pair_features, preference_rows, run_dpo_loop, run_dpo_trainer  # noqa: E402
from hf_accum.testing.sft import sft_tokenizer  # noqa: E402

TOKENIZER = sft_tokenizer()
ROWS = preference_rows(11, seed=5)
TRAINER_RUNS = {
    "accum_sigmoid": (AccumDPOTrainer, dict(loss_type=("sigmoid",)), False),
    "accum_sigmoid_sft_precomputed": (AccumDPOTrainer, dict(loss_type=("sigmoid", "sft"), loss_weights=[1.0, 0.5],
                                                            precompute=True), False),
    "accum_sigmoid_sft": (AccumDPOTrainer, dict(loss_type=("sigmoid", "sft"), loss_weights=[1.0, 0.5]), False),
    "stock_even_batches": (DPOTrainer, dict(loss_type=("sigmoid", "sft"), loss_weights=[1.0, 0.5]), True),
}
LOOP_RUNS = {
    "loop_sigmoid": DPOPairLoss(beta=0.5),
    "loop_sigmoid_sft": DPOPairLoss(beta=0.5, sft_weight=0.5),
}


def main(report_path: str) -> None:
    torch.set_num_threads(1)
    out_dir = os.path.dirname(report_path)
    report: dict = {}
    # On disk, so that TRL's precomputed reference log-probs are cached where every rank finds them (an in-memory
    # dataset caches them in a temporary directory of rank 0's own).
    PartialState(cpu=True)  # the process group (gloo), as the trainers will find it
    rows_dir = os.path.join(out_dir, "rows")
    if dist.get_rank() == 0:
        ROWS.save_to_disk(rows_dir)
    dist.barrier()
    rows = load_from_disk(rows_dir)
    for name, (trainer_cls, loss, even) in TRAINER_RUNS.items():
        run = run_dpo_trainer(trainer_cls, rows, TOKENIZER, os.path.join(out_dir, name), micro_batch=2,
                              accumulation=2, even_batches=even, **loss)
        fused = getattr(getattr(run["trainer"], "dpo_loss", None), "fused", None)
        report[name] = {"errors": run["errors"], "pairs": run["pairs"], "logs": run["logs"],
                        "metrics": run["metrics"], "fused_forwards": fused.forwards if fused is not None else 0}
    for name, loss in LOOP_RUNS.items():
        run = run_dpo_loop(pair_features(11, seed=6), loss, micro_batch=2, accumulation=2, even_batches=False)
        report[name] = {"errors": run["errors"], "pairs": run["pairs"], "fused_forwards": loss.fused.forwards,
                        "targets": [update.targets for update in run["result"].updates]}
    report["world_size"] = dist.get_world_size()
    _write(report, report_path)
    dist.barrier()


def _write(report: dict, path: str) -> None:
    if dist.get_rank() == 0:
        with open(path, "w") as handle:
            json.dump(report, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
