"""Subprocess worker (2 gloo ranks): resuming from a run directory whose newest checkpoint is damaged.

``torchrun --nproc_per_node 2 tests/distributed/manifest_verify_worker.py OUT.json RUN_DIR``. Every rank runs the recipe's
resume policy (:func:`hf_accum.recipe.resume.resume_checkpoint`) twice: with ``resume_from_checkpoint=true``
(the damaged newest is skipped, the older good one chosen) and naming the damaged one (refused, exit code from
the recipe's own ``run_cli``). Every call of ``hf_accum.checkpointing.manifest.file_digest`` (the sha256 of one file) is
counted per rank. Each rank writes ``OUT.json.rank<r>``; rank 0 also ``OUT.json``.
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import os
import sys

import torch.distributed as dist

from hf_accum.checkpointing import manifest
from hf_accum.distributed import leave_process_group
from hf_accum.recipe.outputs import run_cli
from hf_accum.recipe.resume import resume_checkpoint


def main() -> None:
    out_path, run_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hashed: list[str] = []
    digest = manifest.file_digest

    def counted_digest(path: str) -> str:
        hashed.append(os.path.relpath(path, run_dir))
        return digest(path)

    manifest.file_digest = counted_digest
    chosen = resume_checkpoint(True, run_dir, "resume")
    refusal: list[str] = []

    def resume_the_damaged_one(argv) -> None:
        try:
            resume_checkpoint(os.path.join(run_dir, "checkpoint-4"), run_dir, "resume")
        except Exception as error:
            refusal.append(f"{type(error).__name__}: {error}")
            raise

    dist.barrier()  # both ranks chose before the refusal below tears the process group down (run_cli)
    code = run_cli(resume_the_damaged_one, [])
    report = {"rank": rank, "world_size": world, "chosen": chosen, "hashed": hashed, "refusal": refusal,
              "exit_code": code}
    with open(f"{out_path}.rank{rank}", "w") as handle:
        json.dump(report, handle)
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(report, handle)
    leave_process_group()  # a no-op here: run_cli's early end already tore the group down


if __name__ == "__main__":
    main()
    leave_process_group()  # gloo may abort at exit otherwise (a no-op when main already left it)
