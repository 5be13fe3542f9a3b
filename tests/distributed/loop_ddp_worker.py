"""torchrun worker: the loop on 2 CPU processes (gloo) whose ranks hold very different token counts.

Run as ``torchrun --nproc_per_node 2 tests/distributed/loop_ddp_worker.py OUT.json``; rank 0 writes the world
size it really got, the audited gradient errors of the exact and naive loops, the LRs, and the
number of gradient all-reduce rounds counted by a DDP comm hook; and, on a tiny LLaVA whose CLIP
``post_layernorm`` gets no gradient, the same with the loop's default DDP setting and, as the negative control,
with DDP as ``accelerator.prepare`` built it (``ddp_find_unused_parameters=False``).
"""

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import logging
import sys

import torch.distributed as dist

from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, Scenario, run_exact, run_naive, tiny_causal_lm
from hf_accum.testing.cases.loop_ddp_case import EXAMPLES, AllReduceCounter
from hf_accum.testing.families import VisionCollator, tiny_llava, vlm_rows
from hf_accum.testing.float64 import float64_arithmetic


def scenario() -> Scenario:
    return Scenario("ddp", tiny_causal_lm, EXAMPLES, PaddingCollator(PAD), micro_batch=2, accumulation=3,
                    epochs=2, scheduler="linear", warmup_steps=1)


def uneven_ranks_refusal() -> str:
    """26 rows with even_batches=False: 7 micro-batches on rank 0, 6 on rank 1. Without the check,
    rank 0's last window would wait forever in an all-reduce rank 1 never joins."""
    from accelerate import DataLoaderConfiguration

    uneven = Scenario("uneven", tiny_causal_lm, EXAMPLES[:26], PaddingCollator(PAD), micro_batch=2, accumulation=3,
                      accelerator_kwargs={"dataloader_config": DataLoaderConfiguration(even_batches=False)})
    try:
        run_exact(uneven)
    except ValueError as error:
        return str(error)
    return ""


def unused_parameters(find_unused: bool | None) -> dict:
    """LLaVA (``vision_feature_layer=-1``: CLIP's ``post_layernorm`` gets no gradient), 2 updates of K=3 per
    rank; the loop's DDP setting ``find_unused`` (None: the loop decides, as Trainer does). The run's audited
    errors, all-reduce rounds, the loop's log lines about it, or the error that stopped it."""
    scenario = Scenario("llava", tiny_llava, vlm_rows(24, seed=3), VisionCollator(PAD), micro_batch=2,
                        accumulation=3, loop_kwargs={"ddp_find_unused_parameters": find_unused})
    counter, lines = AllReduceCounter(), _LogLines()
    logging.getLogger("hf_accum.loop").addHandler(lines)
    logging.getLogger("hf_accum.loop").setLevel(logging.INFO)
    run: dict = {"error": "", "errors": [], "updates": 0}
    try:
        with float64_arithmetic():
            result, exact = run_exact(scenario, on_model=counter.attach)
        run.update(updates=len(result.updates), errors=[r.relative_error for r in exact.records])
    except RuntimeError as error:  # the negative control: DDP's reducer
        run["error"] = str(error).splitlines()[0]
    finally:
        logging.getLogger("hf_accum.loop").removeHandler(lines)
    run.update(allreduce_rounds=counter.rounds, ddp_lines=[m for m in lines.messages if "find_unused" in m])
    return run


class _LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(out_path: str) -> None:
    counter = AllReduceCounter()
    result, exact = run_exact(scenario(), on_model=counter.attach)
    naive = run_naive(scenario())
    report = {
        "world_size": dist.get_world_size(),
        "updates": len(result.updates),
        "targets_per_update": [u.targets for u in result.updates],
        "exact_errors": [r.relative_error for r in exact.records],
        "naive_errors": [r.relative_error for r in naive.records],
        "learning_rates": [r.learning_rate for r in exact.records],
        "allreduce_rounds": counter.rounds,
        "uneven_ranks_error": uneven_ranks_refusal(),
        "llava": unused_parameters(None),
        "llava_plain_ddp": unused_parameters(False),  # last: it stops in DDP's reducer
    }
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(report, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
