"""torchrun worker: the noise-scale measurement on 2 CPU processes, in both engines.

Run as ``torchrun --nproc_per_node 2 tests/distributed/noise_scale_ddp_worker.py OUT.json``; rank 0 writes the world size,
per engine and mode the relative errors of the logged raw estimates against the independent reference (every
micro-batch of every rank, or every rank's first micro-batch), and the noise scales of a short real (lr > 0) run.
"""

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json
import sys
import tempfile

import torch.distributed as dist

from hf_accum.distributed import leave_process_group
from hf_accum.testing.noise_reference import expected_estimates, relative_errors, run_engine, scenario


def main(out_path: str) -> None:
    report = {}
    for engine in ("loop", "trainer"):
        with tempfile.TemporaryDirectory() as output_dir:
            for mode in ("every", "first"):
                case = scenario(rows=32, accumulation=3, mode=mode)  # 8 micro-batches per rank: windows 3, 3, 2
                updates, model, _ = run_engine(engine, case, output_dir)
                expected = expected_estimates(model, case.collator.batches, case.accumulation, mode)
                report[f"{engine}_{mode}_errors"] = relative_errors(updates, expected)
                report[f"{engine}_{mode}_small_batches"] = [
                    e["micro_batches"] if mode == "every" else len(e["small"]) for e in expected]
            trained, _, advice = run_engine(engine, scenario(rows=64, lr=1e-3, epochs=3), output_dir)
            report[f"{engine}_noise_scales"] = [u["noise_scale"] for u in trained]
            report[f"{engine}_advice"] = advice
    report["world_size"] = dist.get_world_size()  # the Accelerator started the process group
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(report, handle)


if __name__ == "__main__":
    main(sys.argv[1])
    leave_process_group()  # gloo may abort at exit otherwise: see its docstring
