"""Per-sequence normalization (``normalization='sequence'``): every applied float64 gradient equals that of the
mean over the update's sequences of each sequence's mean token loss (1e-10), with padding, packing, prompt
masking, a short last window and 2 ranks, in both engines; the token mode fails the same check."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_accum.batching import PackingCollator, PaddingCollator
from hf_accum.loop import LoopConfig, LoopConfigError
from hf_accum.testing import PAD, random_rows
from hf_accum.testing.launch import job_report
from hf_accum.testing.sequence_reference import run

EXACT = 1e-10
# 18 rows of 3..40 tokens (masked prompts), micro-batch 2, K=4: windows of 4, 4 and a short 1.
CASES = {
    "padding_prompt_masking_short_window": (lambda: PaddingCollator(PAD), random_rows(18, seed=31, prompt_masking=True),
                                            2),
    # micro-batch 3 packed into one row (3 sequences per row), 7 micro-batches: windows of 4 and a short 3.
    "packing": (PackingCollator, random_rows(21, seed=32, prompt_masking=True), 3),
}


@pytest.mark.parametrize("engine", ["loop", "trainer"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sequence_mode_equals_the_mean_of_sequence_means(engine, case, tmp_path, caplog):
    collator, examples, micro = CASES[case]
    with caplog.at_level(logging.INFO, logger="hf_accum.fused.loss"):
        errors, updates = run(engine, collator(), examples, "sequence", str(tmp_path), micro_batch=micro)
    assert len(errors) == len(updates) >= 2
    assert max(errors) < EXACT, errors
    # on the fused path: the per-sequence weights go into the chunked loss (no logits materialized)
    assert "fused linear cross-entropy on" in caplog.text


@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_token_mode_fails_the_same_check(engine, tmp_path):
    collator, examples, micro = CASES["packing"]
    errors, _ = run(engine, collator(), examples, "token", str(tmp_path), micro_batch=micro)
    assert max(errors) > 1e-3, errors


def test_bad_values_are_refused_in_one_line():
    with pytest.raises(LoopConfigError, match="LoopConfig.normalization='row'; allowed: 'token', 'sequence'"):
        LoopConfig(normalization="row")
    with pytest.raises(LoopConfigError, match="needs loss_kind 'causal_lm'"):
        LoopConfig(normalization="sequence", loss_kind="sequence")
    from hf_accum.losses.micro_batch import MicroBatchLoss

    with pytest.raises(ValueError, match="MicroBatchLoss\\(normalization\\)='sequences'; allowed: 'token', 'sequence'"):
        MicroBatchLoss(normalization="sequences")
    with pytest.raises(ValueError, match="custom loss_sum_fn must do its own weighting"):
        MicroBatchLoss(loss_sum_fn=lambda outputs, labels, inputs: (labels.sum(), labels.numel()),
                       normalization="sequence")


@pytest.fixture(scope="module")
def ddp_report(loop_ddp_family):
    return job_report(loop_ddp_family, "sequence")  # the loop DDP family's one launch (conftest.py)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_two_ranks(ddp_report, engine):
    assert ddp_report["world_size"] == 2
    assert max(ddp_report[f"{engine}_sequence"]) < EXACT, ddp_report
    assert max(ddp_report[f"{engine}_token"]) > 1e-3, ddp_report


def test_packed_sequences_are_found_wherever_positions_restart():
    from hf_accum.losses.sequence_norm import sequence_weights

    # one packed row: sequences of 4, 3 and 5 positions; labels -100 at each sequence's first position
    labels = torch.tensor([[-100, 5, 6, 7, -100, 8, 9, -100, 10, 11, 12, 13]])
    from_zero = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    weights, sequences = sequence_weights(labels, from_zero)
    assert int(sequences) == 3
    # the logit at i predicts label i + 1: 3, 2 and 4 targets, each weighted 1 / its sequence's targets
    assert weights[0].tolist() == pytest.approx([1 / 3] * 3 + [0] + [1 / 2] * 2 + [0] + [1 / 4] * 4 + [0])
    for start in (1, 7):  # collators that count positions from elsewhere find the same sequences
        again, count = sequence_weights(labels, from_zero + start)
        assert int(count) == 3 and torch.equal(again, weights)
    # without position ids a row is one sequence
    assert int(sequence_weights(labels)[1]) == 1
