"""Every model family the docs list, as one table (:data:`hf_accum.testing.families.FAMILIES`): tiny from
config, seed 0, float64 without float32 islands, one update of K=3 micro-batches with uneven target counts, label
smoothing 0.1, through both front-ends (``hf_accum.train`` and ``AccumTrainer``). Each run's applied gradient is
compared with the independent big-batch reference (:class:`hf_accum.verify.BigBatchAuditor`), relative error
< 1e-10, and the loss path the family takes (fused or logits) is asserted. Negative control: the naive ``loss / K``
loop fails the same audit. Adding a family is one line in the table."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from hf_accum import AccumTrainer
from hf_accum.testing import run_exact, run_naive, run_trainer
from hf_accum.testing.families import FAMILY_NAMES, family, family_scenario
from hf_accum.testing.float64 import float64_arithmetic

EXACT = 1e-10
NAIVE_IS_WRONG = 1e-3
FUSED_ON = "fused linear cross-entropy on"
FRONT_ENDS = ("loop", "accum_trainer")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _errors(name: str, front_end: str, output_dir: str) -> list[float]:
    scenario = family_scenario(family(name))
    if front_end == "loop":
        return [record.relative_error for record in run_exact(scenario)[1].records]
    return run_trainer(scenario, output_dir, AccumTrainer).errors


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_family_is_exact_on_its_path(name, front_end, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_accum.fused.loss"), float64_arithmetic():
        errors = _errors(name, front_end, str(tmp_path))
    print(f"FAMILY {name} {front_end} {max(errors):.1e}")  # docs/models.md's table: pytest -s -k ...
    assert len(errors) == 1 and errors[0] < EXACT, errors
    assert (FUSED_ON in caplog.text) == family(name).fused, caplog.text


def test_micro_batches_hold_uneven_target_counts():
    """Every family's update: 3 micro-batches whose target counts differ (a sequence head: one per row)."""
    for name in FAMILY_NAMES:
        scenario = family_scenario(family(name))
        if scenario.loss_kind == "sequence":
            continue
        rows = scenario.examples
        counts = [int(scenario.collator(rows[i:i + 2])["labels"].ne(-100).sum()) for i in range(0, 6, 2)]
        assert len(set(counts)) == 3, (name, counts)


@pytest.mark.parametrize("name", ["llama", "llava", "llama_token_classification"])
def test_naive_loop_fails_the_same_audit(name):
    """Negative control, without label smoothing (the model's own loss, which the naive loop takes, has none): what
    fails is the per-micro-batch mean alone."""
    scenario = dataclasses.replace(family_scenario(family(name)), label_smoothing=0.0)
    with float64_arithmetic():
        assert run_naive(scenario).max_relative_error > NAIVE_IS_WRONG
