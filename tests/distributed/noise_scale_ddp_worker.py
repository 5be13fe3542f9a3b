"""torchrun worker: the noise-scale measurement on 2 CPU processes, in both engines.

Run as ``torchrun --nproc_per_node 2 tests/distributed/noise_scale_ddp_worker.py OUT.json``; rank 0 writes the world size,
per engine the relative errors of the logged raw estimates against the independent reference (every rank's first
micro-batch gathered), and the noise scales of a short real (lr > 0) run.
"""

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
            case = scenario(rows=32, accumulation=3)  # 8 micro-batches per rank: windows of 3, 3 and a short 2
            updates, model, _ = run_engine(engine, case, output_dir)
            expected = expected_estimates(model, case.collator.batches, case.accumulation)
            report[f"{engine}_errors"] = relative_errors(updates, expected)
            report[f"{engine}_small_batches"] = [len(e["small"]) for e in expected]
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
