"""The ``dpo`` and ``grpo`` bench sections (benchmarks/dpo.py, benchmarks/grpo.py) through ``hf-accum bench`` in their
quick mode, at a tiny vocabulary: both trainers run (TRL's and ours), every run is measured, the ratios and the MFU
are printed and written. No timing target is asserted (the machine is shared; the bench judges its own ratios).
"""

from __future__ import annotations

import json
import math
import re

import pytest

pytest.importorskip("trl")

from hf_accum.cli import main  # noqa: E402

QUICK = ["--only", "dpo", "grpo", "--dpo-quick", "--grpo-quick", "--dpo-vocab-sizes", "256", "--grpo-vocab-sizes",
         "256", "--threads", "1", "--no-progress"]


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_quick_dpo_and_grpo_sections_measure_both_trainers(tmp_path, capsys):
    assert main(["bench", *QUICK, "--output-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "bench.json").read_text())
    for section, labels in (("dpo", ("TRL DPOTrainer", "AccumDPOTrainer")),
                            ("grpo", ("TRL GRPOTrainer", "AccumGRPOTrainer"))):
        result = report["sections"][section]
        (row,) = result["rows"]
        assert row["vocab_size"] == 256 and set(row["runs"]) == {"trl", "accum"}
        for runs in row["runs"].values():
            (run,) = runs  # quick: one round
            assert _positive_finite(run["seconds"]) and _positive_finite(run["real_tokens"]), run
            assert _positive_finite(run["peak_bytes"]) and _positive_finite(run["flops"]), run
        # both trainers saw the same data
        assert row["runs"]["trl"][0]["real_tokens"] == row["runs"]["accum"][0]["real_tokens"]
        ratios = result["ratios"]["256"]
        assert all(_positive_finite(r) for r in ratios["tokens_per_s"] + ratios["memory"])
        for label in labels:
            assert re.search(rf"{label}\s+\d+ tokens/s\s+MFU\s+\d+\.\d%", printed), label
        assert re.search(rf"{section}: .*\n.*load average \d", printed)
    summary = [r for r in report["summary"] if r["target"].startswith(("dpo", "grpo"))]
    assert len(summary) == 2 and {r["verdict"] for r in summary} == {"n/a"}  # judged at 262144 only
