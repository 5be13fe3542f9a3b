"""torchrun worker: per-sequence normalization on 2 CPU processes, both engines (sequence mode and, as the
negative control, token mode). Rank 0 writes the relative gradient errors against the reference."""

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import sys
import tempfile

import torch.distributed as dist

from hf_accum.batching import PaddingCollator
from hf_accum.distributed import leave_process_group
from hf_accum.testing import PAD, random_rows
from hf_accum.testing.sequence_reference import run

# 28 rows, micro-batch 2: 7 micro-batches per rank, K=3: windows of 3, 3 and a short 1 on each rank.
EXAMPLES = random_rows(28, seed=33, prompt_masking=True)


def main(out_path: str) -> None:
    report = {}
    for engine in ("loop", "trainer"):
        for mode in ("sequence", "token"):
            with tempfile.TemporaryDirectory() as output_dir:
                errors, _ = run(engine, PaddingCollator(PAD), EXAMPLES, mode, output_dir, accumulation=3)
            report[f"{engine}_{mode}"] = errors
    report["world_size"] = dist.get_world_size()
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(report, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
