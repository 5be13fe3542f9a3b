"""The core's (sum, count) per term (hf_accum/accumulation.py, hf_accum/boundary.py) and the preference math
(hf_accum/losses/preference.py) on small tensors: factors per term, one scalar to backpropagate, the window tally with
an extra term in the same all-reduce, the count check, DPOPairLoss's counts and TRL's formulas."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_accum.accumulation import WindowTally, combine_terms, exact_mean_factor, term_factors
from hf_accum.boundary import UpdateBoundary, count_window_units
from hf_accum.control import NonFiniteGuard, TrainingControl
from hf_accum.loop import LoopConfig, LoopConfigError
from hf_accum.loop.run import _micro_batch_loss
from hf_accum.losses.preference import DPOPairLoss, collate_pairs, completion_logps, pair_losses
from hf_accum.testing.models import tiny_causal_lm

ONE_PROCESS = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"), is_main_process=True)


def test_each_term_gets_its_own_factor():
    assert term_factors([4, 10], 2) == [2 / 4, 2 / 10]
    assert term_factors([4, 0], 1) == [0.25, 0.0]  # an extra term without units contributes nothing
    with pytest.raises(ZeroDivisionError):
        term_factors([0, 5], 1)  # the primary term decides: no mean, the window is skipped


def test_single_term_scaling_is_bit_identical():
    loss = torch.tensor(3.7, dtype=torch.float64)
    factor = exact_mean_factor(7, 2)
    assert torch.equal(combine_terms(loss, [factor]), loss * factor)
    terms = torch.tensor([3.0, 5.0], dtype=torch.float64)
    assert float(combine_terms(terms, [0.5, 0.1])) == pytest.approx(3.0 * 0.5 + 5.0 * 0.1)
    with pytest.raises(ValueError, match="counted in 3"):
        combine_terms(terms, [1.0, 1.0, 1.0])


def _batch(rows: int = 2, length: int = 4) -> dict:
    return {"input_ids": torch.ones(rows, length, dtype=torch.long), "labels": torch.ones(rows, length)}


def test_window_tally_carries_extra_terms_in_one_reduce():
    tally = WindowTally(extra_terms=("sft",))
    tally.add(torch.tensor([2.0, 6.0]), torch.tensor([1.0, 3.0]), _batch())
    tally.add(torch.tensor([4.0, 10.0]), torch.tensor([3.0, 2.0]), _batch())
    totals = tally.reduce(ONE_PROCESS)
    assert (totals.loss_sum, totals.targets) == (6.0, 4)
    assert totals.extra_terms == {"sft": [16.0, 5]}
    assert totals.term_counts == [4, 5]
    assert totals.mean_loss == pytest.approx(6.0 / 4 + 16.0 / 5)
    assert totals.term_means() == {"sft": pytest.approx(16.0 / 5)}


def test_an_inf_in_an_extra_term_skips_the_window():
    tally = WindowTally(extra_terms=("sft",))
    tally.add(torch.tensor([2.0, math.inf]), torch.tensor([1.0, 3.0]), _batch())
    assert tally.reduce(ONE_PROCESS).nonfinite


def test_a_loss_with_another_number_of_terms_is_refused():
    with pytest.raises(ValueError, match="returned 2 term"):
        WindowTally().add(torch.tensor([2.0, 1.0]), torch.tensor([1.0, 3.0]), _batch())


def test_the_count_check_compares_every_term():
    boundary = UpdateBoundary(ONE_PROCESS, TrainingControl(), NonFiniteGuard(5), logging.getLogger("test"),
                              count_source="loss_sum_fn", extra_terms=("sft",))
    boundary.add(torch.tensor([2.0, 6.0]), torch.tensor([1.0, 3.0]), _batch())
    with pytest.raises(ValueError, match=r"counted \[1, 3\] units.*counted \[1, 4\]"):
        boundary.close(1, counted=[1, 4])


def test_window_units_are_counted_per_term():
    loss = DPOPairLoss(sft_weight=0.5)
    features = [{"chosen_input_ids": [5, 6, 7], "chosen_labels": [-100, 6, 7], "rejected_input_ids": [5, 8],
                 "rejected_labels": [-100, 8]}] * 3
    batches = [collate_pairs(features[:2], 0), collate_pairs(features[2:], 0)]
    assert count_window_units(batches, lambda b: loss.count_units(b["labels"], b), ONE_PROCESS) == [3, 6]
    assert count_window_units(batches, lambda b: DPOPairLoss().count_units(b["labels"], b), ONE_PROCESS) == [3]


def test_completion_logps_keep_float64_and_the_causal_shift():
    logits = torch.randn(2, 4, 6, dtype=torch.float64)
    labels = torch.tensor([[-100, 2, 3, -100], [-100, -100, 5, 1]])
    logps, counts = completion_logps(logits, labels)
    assert logps.dtype == torch.float64 and counts.tolist() == [2, 2]
    log_p = logits.log_softmax(-1)
    expected = log_p[0, 0, 2] + log_p[0, 1, 3]
    assert float(logps[0]) == pytest.approx(float(expected), abs=1e-15)


def test_pair_losses_are_trls_formulas():
    chosen, rejected = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    ref_chosen, ref_rejected = torch.tensor([-3.5, -4.0]), torch.tensor([-3.0, -2.5])
    delta = 0.5 * ((chosen - ref_chosen) - (rejected - ref_rejected))
    sigmoid = pair_losses(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
    assert torch.allclose(sigmoid, -F.logsigmoid(delta))
    hinge = pair_losses(chosen, rejected, ref_chosen, ref_rejected, beta=0.5, loss_type="hinge")
    assert torch.allclose(hinge, torch.relu(1 - delta))
    with pytest.raises(ValueError, match="chosen_lengths"):
        pair_losses(chosen, rejected, ref_chosen, ref_rejected, beta=0.5, loss_type="ipo")
    with pytest.raises(ValueError, match="'aot' depends on the whole batch"):
        pair_losses(chosen, rejected, ref_chosen, ref_rejected, beta=0.5, loss_type="aot")


def test_a_token_budget_is_refused_for_a_pair_loss():
    config = LoopConfig(tokens_per_update=64).validate()
    with pytest.raises(LoopConfigError, match="counts pairs"):
        _micro_batch_loss(tiny_causal_lm(), config, DPOPairLoss())
