"""torchrun worker (2 CPU processes, gloo): what a model's own loss holds beyond our cross-entropy, under DDP
(launched by tests/distributed/test_moe_ddp.py).

* The MoE router loss: for Mixtral and Qwen2-MoE, float64 without float32 islands, with the loop and
  AccumTrainer on the fused and logits paths: every update against the rule's reference (the token-weighted mean
  of every micro-batch's router loss, all ranks), and with every micro-batch on both ranks holding the same rows,
  against the big batch's own gradient and router loss -- its weight does not grow with the number of ranks.
* Encoder-decoders (T5, UMT5, BART, mBART, Marian, Pegasus), whose own loss builds the decoder inputs from the
  labels: labels-only batches and batches with ``decoder_input_ids``, equal and unequal source/target lengths,
  both front-ends, every update against the model's own ``forward(labels=...)`` loss on the update's joined
  batch of both ranks (:class:`hf_accum.testing.seq2seq.Seq2SeqAuditor`).

Rank 0 writes a JSON report to ``argv[1]``.
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import functools
import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate import DistributedDataParallelKwargs

from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, Scenario, random_rows, run_exact, run_trainer
from hf_accum.testing.cases.seq2seq_ddp_case import SEQ2SEQ_DDP_JOBS
from hf_accum.testing.float64 import float64_arithmetic
from hf_accum.testing.models import MOE_FAMILIES, tiny_moe_causal_lm
from hf_accum.testing.seq2seq import seq2seq_rows, seq2seq_scenario

COEF = 0.02
UNEVEN = random_rows(24, seed=21, min_len=3, max_len=40, prompt_masking=True, long_rows=lambda i: (i // 2) % 2 == 0)
SAME = random_rows(2, seed=4, prompt_masking=True) * 12  # every micro-batch of both ranks: the same 2 rows


def scenario(family: str, rows, router_loss: str, fused: bool) -> Scenario:
    factory = functools.partial(tiny_moe_causal_lm, family, router_aux_loss_coef=COEF)
    return Scenario(
        f"moe_ddp:{family}", factory, rows, PaddingCollator(PAD), micro_batch=2, accumulation=3,
        router_loss=router_loss, loop_kwargs={"fused_loss": fused},
        # An expert no token of a micro-batch picks gets no gradient.
        accelerator_kwargs={"kwargs_handlers": [DistributedDataParallelKwargs(find_unused_parameters=True)]},
    )


def _run(front_end: str, family: str, rows, router_loss: str, out_dir: str) -> dict:
    fused = front_end.endswith("fused")
    run_scenario = scenario(family, rows, router_loss, fused)
    if front_end.startswith("loop"):
        result, auditor = run_exact(run_scenario)
        updates = result.updates
    else:
        directory = os.path.join(out_dir, f"{front_end}-{family}-{router_loss}")
        run = run_trainer(run_scenario, directory, AccumTrainer, trainer_kwargs={"fused_loss": fused})
        auditor, updates = run.auditor, run.trainer.updates
    return {"errors": [r.relative_error for r in auditor.records], "aux_loss": [u.aux_loss for u in updates],
            "loss": [u.loss for u in updates], "reference_loss": [r.reference_loss for r in auditor.records]}


def one_copy_router_term(family: str) -> float:
    """``coef * aux`` of one micro-batch of SAME, at the initial weights."""
    batch = PaddingCollator(PAD)(SAME[:2])
    batch.pop("labels")
    with torch.no_grad():
        return float(COEF * tiny_moe_causal_lm(family, router_aux_loss_coef=COEF)(**batch).aux_loss)


def seq2seq_errors(family: str, lengths: str, decoder_inputs: bool, front_end: str, out_dir: str) -> list[float]:
    """One encoder-decoder job: 12 rows per rank, K = 3 micro-batches of 2 rows, 2 updates."""
    rows = seq2seq_rows(24, seed=11, equal_lengths=lengths == "equal_lengths")
    run_scenario = seq2seq_scenario(family, rows, decoder_inputs)
    if front_end == "loop":
        return [r.relative_error for r in run_exact(run_scenario)[1].records]
    directory = os.path.join(out_dir, f"seq2seq-{family}-{lengths}-{decoder_inputs}")
    return run_trainer(run_scenario, directory, AccumTrainer).errors


def main(report_path: str) -> None:
    out_dir = os.path.dirname(report_path)
    report = {}
    with float64_arithmetic():
        for job in SEQ2SEQ_DDP_JOBS:
            report[":".join(job)] = seq2seq_errors(*job[:2], job[2] == "decoder_input_ids", job[3], out_dir)
        for family in MOE_FAMILIES:
            for front_end in ("loop_fused", "loop_logits", "trainer_fused", "trainer_logits"):
                report[f"{family}:{front_end}:uneven"] = _run(front_end, family, UNEVEN, "per_micro_batch", out_dir)
            for front_end in ("loop_fused", "trainer_fused"):
                report[f"{family}:{front_end}:same"] = _run(front_end, family, SAME, "big_batch", out_dir)
            report[f"{family}:one_copy_router_term"] = one_copy_router_term(family)
    report["world_size"] = dist.get_world_size()
    if dist.get_rank() == 0:
        with open(report_path, "w") as handle:
            json.dump(report, handle)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
