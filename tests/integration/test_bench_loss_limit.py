"""The ``loss-limit`` bench section (benchmarks/loss_limit.py) through ``hf-accum bench`` at tiny shapes: it times
ours and the peers against the three bare GEMMs, the peers compute the same loss, and bad settings are refused
before anything is written. No timing target is asserted (the machine is shared; the section judges itself)."""

from __future__ import annotations

import json
import math

from hf_accum.cli import main

TINY = [
    "bench", "--only", "loss-limit", "--loss-limit-positions", "96", "--loss-limit-hidden-sizes", "16",
    "--loss-limit-vocab-sizes", "300", "--loss-limit-plain-positions", "32", "64", "--loss-limit-threads", "1",
    "--loss-limit-dtypes", "float32", "--no-progress",
]


def test_loss_limit_reports_each_variant_as_a_multiple_of_the_floor(tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*TINY, "--output-dir", str(out)]) == 0
    assert "large tensors on transparent huge pages (THP_MEM_ALLOC_ENABLE=1)" in capsys.readouterr().out
    section = json.loads((out / "bench.json").read_text())["sections"]["loss-limit"]
    assert section["huge_pages"] is True
    rows = section["rows"]
    assert [row["dtype"] for row in rows] == ["float32"]
    for row in rows:
        assert len(row["floor_seconds"]) == 2 and all(s > 0 for s in row["floor_seconds"])
        assert len(row["ratios"]["ours"]) == 2 and all(r > 0 and math.isfinite(r) for r in row["ratios"]["ours"])
        assert set(row["seconds"]) == {"ours", "torch", "trl"} and "liger" in row["absent"]
        assert row["peak_bytes"]["ours"] > 0 and row["plain_peak_at_n"] > 0
        # the logits path's peak grows with N: measured at 32 and 64, extrapolated to 96
        assert row["plain_peak_at_n"] > max(int(v) for v in row["plain_peaks"].values())
    float32 = rows[0]["losses"]
    assert abs(float32["torch"] / float32["ours"] - 1) < 1e-5 and abs(float32["trl"] / float32["ours"] - 1) < 1e-5


def test_loss_limit_refuses_plain_positions_beyond_n(tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*TINY, "--loss-limit-plain-positions", "32", "200", "--output-dir", str(out)]) == 2
    assert "loss_limit_plain_positions=[32, 200]" in capsys.readouterr().err
    assert not out.exists()
