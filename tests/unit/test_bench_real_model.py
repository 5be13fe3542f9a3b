"""The ``real-model`` benchmark section without its models: option parsing, refusals before anything loads, and
the arithmetic and wording of its report (rates over the timed updates, ratios within a round, the update-1 loss
check). Training the real models takes minutes; ``hf-accum bench --only real-model`` does that, not CI."""

from __future__ import annotations

import pytest

from benchmarks.options import OPT_IN, SECTIONS, parse, validate
from benchmarks.real_model import ModelRow, RealModelResult, _timed_seconds
from benchmarks.report import BenchError

MiB = 2**20


def test_the_section_runs_only_when_named():
    common, _ = parse([], "bench")
    assert "real-model" in SECTIONS and "real-model" in OPT_IN and "real-model" not in common.sections
    common, per_section = parse(["--only", "real-model", "--real-models", "gemma3", "--real-rounds", "3",
                                 "--real-trainers", "trainer", "accum_trainer"], "bench")
    options = per_section["real-model"]
    assert common.sections == ["real-model"]
    assert options.real_models == ["gemma3"] and options.real_rounds == 3
    assert options.real_trainers == ["trainer", "accum_trainer"]


def test_an_unknown_model_is_an_argparse_error():
    with pytest.raises(SystemExit) as exit_info:
        parse(["--only", "real-model", "--real-models", "llama3"], "bench")
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--real-warmup-updates", "3", "--real-updates", "3"], "real_warmup_updates=3"),
        (["--real-prompt-fraction", "1.0"], "real_prompt_fraction=1.0"),
        (["--real-seq-length", "4"], "real_seq_length=4"),
        (["--real-rounds", "0"], "real_rounds=0"),
    ],
)
def test_bad_settings_are_refused_before_any_model_loads(args, message):
    common, per_section = parse(["--only", "real-model", *args], "bench")
    with pytest.raises(BenchError, match=message):
        validate(common, per_section)


def _run(trainer: str, cpu: list[float], increment_mib: int, rss_mib: int, loss: float, path: str = "-") -> dict:
    return dict(trainer=trainer, cpu_seconds=cpu, wall_seconds=[2 * c for c in cpu], losses=[loss, loss - 1],
                base_rss=(rss_mib - increment_mib) * MiB, peak_rss=rss_mib * MiB, loss_path=path, extra={})


def _row(accum_loss: float = 4.0) -> ModelRow:
    # 3 updates per run, the first a warm-up: the timed seconds are the clock at update 3 minus that at update 1.
    runs = {
        "trainer": [_run("trainer", [5.0, 7.0, 9.0], 1000, 2000, 4.0), _run("trainer", [5.0, 8.0, 11.0], 1000, 2000, 4.0)],
        "accum_trainer": [_run("accum_trainer", [5.0, 6.0, 7.0], 500, 1500, accum_loss, "fused"),
                          _run("accum_trainer", [5.0, 7.0, 9.0], 400, 1400, accum_loss, "fused")],
    }
    return ModelRow("gemma3", "Gemma 3 270M", tokens_per_update=1024, targets_per_update=760, timed_updates=2, runs=runs)


def test_rates_and_ratios_are_taken_over_the_timed_updates_within_a_round():
    row = _row()
    assert _timed_seconds([5.0, 7.0, 9.0], 2) == 4.0 and _timed_seconds([5.0, 7.0], 2) == 7.0
    assert row.rates("trainer") == [2048 / 4.0, 2048 / 6.0]
    assert row.ratios("accum_trainer", "trainer", "speed") == [2.0, 1.5]
    assert row.ratios("accum_trainer", "trainer", "memory") == [0.5, 0.4]
    assert row.ratios("accum_trainer", "trainer", "rss") == [0.75, 0.7]
    assert row.ratios("trl_sft", "trainer", "speed") is None


def test_the_report_prints_ratios_with_spreads_and_the_loss_check():
    result = RealModelResult("setup", "float32", 2, [1.5, 2.5], [_row()])
    text = result.text()
    assert "1.75 (1.50-2.00)" in text and "0.45 (0.40-0.50)" in text and "fused" in text
    assert "load average 1.5 before, 2.5 after" in text
    assert "max relative difference 0.0e+00: the same" in text
    verdicts = {row["target"]: row["verdict"] for row in result.summary()}
    assert verdicts == {"real-model gemma3: AccumTrainer / stock Trainer": "PASS",
                        "real-model gemma3: same loss at update 1": "PASS"}
    assert result.as_dict()["ratios"]["gemma3"]["accum_trainer"]["tokens_per_s"] == [2.0, 1.5]


def test_a_different_update_one_loss_fails_the_check():
    result = RealModelResult("setup", "float32", 2, [1.0, 1.0], [_row(accum_loss=4.1)])
    assert "DIFFERENT" in result.text()
    check = result.loss_check["gemma3"]
    assert not check["same"] and check["max_relative_difference"] == pytest.approx(0.1 / 4.1)
    assert any(row["verdict"] == "FAIL" for row in result.summary())
