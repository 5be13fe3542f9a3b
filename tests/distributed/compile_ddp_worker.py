"""torchrun worker: the loop with ``LoopConfig(compile=True)`` on 2 CPU processes (gloo) whose ranks hold very
different token counts (aot_eager: Dynamo's capture and AOTAutograd's joint graph, no C++ build).

Run as ``torchrun --nproc_per_node 2 tests/distributed/compile_ddp_worker.py OUT.json``; rank 0 writes the world
size it really got, the audited gradient errors, the all-reduce rounds and the blocks compiled."""

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import sys

import torch.distributed as dist

from hf_accum.batching import PaddingCollator
from hf_accum.compile import compiled_blocks
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, Scenario, run_exact, tiny_causal_lm
from hf_accum.testing.cases.loop_ddp_case import EXAMPLES, AllReduceCounter


def main(out_path: str) -> None:
    counter = AllReduceCounter()
    models = []
    scenario = Scenario("compiled_ddp", tiny_causal_lm, EXAMPLES, PaddingCollator(PAD), micro_batch=2, accumulation=3,
                        loop_kwargs={"compile": True, "compile_backend": "aot_eager"})

    def attach(model) -> None:
        counter.attach(model)
        models.append(model)

    result, auditor = run_exact(scenario, on_model=attach)
    report = {
        "world_size": dist.get_world_size(),
        "updates": len(result.updates),
        "errors": [r.relative_error for r in auditor.records],
        "allreduce_rounds": counter.rounds,
        "compiled_blocks": compiled_blocks(models[0]),
    }
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(report, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
