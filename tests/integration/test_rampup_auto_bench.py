"""The ``rampup-auto`` benchmark section end to end on tiny settings: every variant and seed trained, its numbers
in bench.json and its table printed (no timing asserted: the machine is shared)."""

from __future__ import annotations

import json
import math

import pytest

from hf_accum.cli import main


@pytest.mark.slow
def test_rampup_auto_section_writes_every_variant(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--only", "rampup-auto", "--rampup-auto-examples", "96", "--rampup-auto-seeds", "1",
                 "--rampup-auto-eval-every", "32", "--threads", "1", "--no-progress", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    section = json.loads((out / "bench.json").read_text())["sections"]["rampup-auto"]
    assert [row["variant"] for row in section["rows"]] == ["fixed 16", "fixed 32", "fixed 64", "auto", "auto m=1"]
    for row in section["rows"]:
        assert len(row["final_loss"]) == 1 and all(math.isfinite(v) and v > 0 for v in row["final_loss"])
        if row["variant"].startswith("fixed"):
            assert row["updates"] == [math.ceil(96 / int(row["batch"]))]
    assert max(section["rows"][i]["final_loss"][0] for i in range(5)) == pytest.approx(section["target_loss"])
    assert set(section["auto_batches"]) == {"auto", "auto m=1"}
    assert section["auto_batches"]["auto"][0].startswith("16 x ")
    assert "Auto batch ramp vs fixed batches" in printed and "updates to target" in printed


def test_rampup_auto_section_refuses_a_ceiling_it_cannot_split(tmp_path, capsys):
    code = main(["bench", "--only", "rampup-auto", "--rampup-auto-max-accumulation", "6", "--output-dir",
                 str(tmp_path / "bench")])
    assert code == 2
    assert "rampup_auto_max_accumulation=6 must be a multiple of 4" in capsys.readouterr().err
    assert not (tmp_path / "bench").exists()
