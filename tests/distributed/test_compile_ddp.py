"""``LoopConfig(compile=True)`` under DDP (2 CPU processes, gloo): the blocks compiled inside the DDP module, the
float64 big-batch gradient over all ranks (1e-10), one gradient all-reduce per update."""

from __future__ import annotations

import pytest

from hf_accum.testing.launch import job_report


@pytest.mark.slow
def test_compiled_ddp_gradient_equals_big_batch(loop_ddp_family):
    report = job_report(loop_ddp_family, "compile")  # the loop DDP family's one launch (conftest.py)
    assert report["world_size"] == 2
    assert report["compiled_blocks"] == 2
    assert report["updates"] == 3 and max(report["errors"]) < 1e-10, report["errors"]
    assert report["allreduce_rounds"] == report["updates"]
