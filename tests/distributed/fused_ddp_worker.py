"""torchrun worker (2 CPU processes, gloo): the fused loss under DDP, ranks with very different token counts.

* the loop with the fused loss and with the logits path: exact, and the same number of gradient
  all-reduce rounds (one per update) -- the fused head runs inside DDP's forward;
* AccumTrainer with Trainer's default ``ddp_find_unused_parameters`` (True for these models), where
  every parameter with a gradient must be reachable from the forward's outputs: a plain Llama and the
  recipe's LoRA + ``modules_to_save=["lm_head", "embed_tokens"]``.

Rank 0 writes a JSON report to ``argv[1]``; launched by tests/distributed/test_fused_ddp.py.
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model

from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, Scenario, run_exact, run_trainer, tiny_causal_lm
from hf_accum.testing.cases.loop_ddp_case import EXAMPLES, AllReduceCounter


class FusedDecisions(logging.Handler):
    """Counts the fused loss's one-per-run decision lines."""

    def __init__(self):
        super().__init__()
        self.on = 0
        self.off = 0

    def emit(self, record):
        message = record.getMessage()
        self.on += "fused linear cross-entropy on" in message
        self.off += "fused linear cross-entropy off" in message


def _modules_to_save():
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        modules_to_save=["lm_head", "embed_tokens"])
    return get_peft_model(tiny_causal_lm(), config).to(torch.float64)


def scenario(factory=tiny_causal_lm, **loop_kwargs) -> Scenario:
    return Scenario("fused_ddp", factory, EXAMPLES, PaddingCollator(PAD), micro_batch=2, accumulation=3,
                    loop_kwargs=loop_kwargs)


def _loop(decisions: FusedDecisions, **loop_kwargs) -> dict:
    counter = AllReduceCounter()
    before = decisions.on
    result, auditor = run_exact(scenario(**loop_kwargs), on_model=counter.attach)
    return {"errors": [r.relative_error for r in auditor.records], "updates": len(result.updates),
            "allreduce_rounds": counter.rounds, "fused": decisions.on > before}


def _trainer(decisions: FusedDecisions, factory, out_dir: str) -> dict:
    before = decisions.on
    run = run_trainer(scenario(factory), out_dir, AccumTrainer)  # ddp_find_unused_parameters left to Trainer
    find_unused = getattr(run.trainer.model_wrapped, "find_unused_parameters", None)
    return {"errors": run.errors, "fused": decisions.on > before, "find_unused_parameters": find_unused}


def main(report_path: str) -> None:
    decisions = FusedDecisions()
    logging.getLogger("hf_accum.fused.loss").addHandler(decisions)
    logging.getLogger("hf_accum.fused.loss").setLevel(logging.INFO)
    out_dir = os.path.dirname(report_path)
    report = {
        "loop_fused": _loop(decisions),
        "loop_logits": _loop(decisions, fused_loss=False),
        "trainer_plain": _trainer(decisions, tiny_causal_lm, os.path.join(out_dir, "plain")),
        "trainer_modules_to_save": _trainer(decisions, _modules_to_save, os.path.join(out_dir, "mts")),
        "fused_off_lines": decisions.off,
        "world_size": dist.get_world_size(),  # after the first run: Accelerate initializes the process group
    }
    if dist.get_rank() == 0:
        with open(report_path, "w") as handle:
            json.dump(report, handle)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
