"""AccumTrainer across restarts: resuming reproduces the uninterrupted run (gradients and LRs, per
update, across an epoch boundary with a short last window); a checkpoint trained with other batch
arithmetic is refused; auto_find_batch_size keeps the effective batch."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from transformers import Trainer

from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.testing import PAD, Scenario, random_rows, run_trainer, tiny_causal_lm
from hf_accum.verify import BigBatchAuditor

# 11 micro-batches per epoch, K=4: windows of 4, 4, 3; 2 epochs = 6 updates; shuffled each epoch.
SCENARIO = Scenario(
    "resume", tiny_causal_lm, random_rows(22, seed=12, prompt_masking=True), PaddingCollator(PAD),
    epochs=2, scheduler="linear", warmup_steps=2, args={"train_sampling_strategy": "random", "save_strategy": "steps",
                                                         "save_steps": 2},
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_trainer(SCENARIO, str(tmp_path_factory.mktemp("full")), AccumTrainer, record_grads=True)


def test_resume_reproduces_gradients_and_lrs_across_the_epoch_boundary(uninterrupted, tmp_path):
    checkpoint = os.path.join(uninterrupted.trainer.args.output_dir, "checkpoint-2")  # before the short window
    resumed = run_trainer(SCENARIO, str(tmp_path), AccumTrainer, resume_from_checkpoint=checkpoint, record_grads=True)

    assert len(uninterrupted.grads) == 6 and len(resumed.grads) == 4  # updates 3..6: short window, epoch 2
    for full, again in zip(uninterrupted.grads[2:], resumed.grads):
        assert torch.linalg.vector_norm(full - again) <= 1e-12 * torch.linalg.vector_norm(full)
    assert resumed.lrs == pytest.approx(uninterrupted.lrs[2:], abs=1e-15)
    assert uninterrupted.lrs == pytest.approx(SCENARIO.big_batch_learning_rates(6), abs=1e-15)
    assert max(uninterrupted.errors + resumed.errors) < 1e-10
    assert [r.micro_batches for r in resumed.auditor.records] == [3, 4, 4, 3]  # short window, then epoch 2


@pytest.mark.parametrize(
    "change, message",
    [({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps 4 -> 2"),
     ({"per_device_train_batch_size": 1}, "per-device micro-batch 2 -> 1")],
)
def test_resume_with_other_batch_arithmetic_is_refused(uninterrupted, tmp_path, change, message):
    checkpoint = os.path.join(uninterrupted.trainer.args.output_dir, "checkpoint-2")
    with pytest.raises(ValueError, match=message) as error:
        run_trainer(SCENARIO, str(tmp_path), AccumTrainer, resume_from_checkpoint=checkpoint, **change)
    assert "effective batch 8 = 2 per device x 4 accumulation x 1 process" in str(error.value)


def test_stock_trainer_resumes_silently_with_another_accumulation(uninterrupted, tmp_path):
    checkpoint = os.path.join(uninterrupted.trainer.args.output_dir, "checkpoint-2")
    stock = run_trainer(SCENARIO, str(tmp_path), Trainer, resume_from_checkpoint=checkpoint,
                        gradient_accumulation_steps=2)
    # Negative control: it continues with windows of 2 micro-batches -- another effective batch.
    assert max(r.micro_batches for r in stock.auditor.records) == 2


# -- auto_find_batch_size -------------------------------------------------------------------------

def _oom_above_two_rows(base: type[Trainer], auditor: BigBatchAuditor) -> type[Trainer]:
    class OutOfMemoryAboveTwoRows(base):
        """Simulates an accelerator that cannot fit more than 2 rows per micro-batch."""

        def compute_loss(self, model, inputs, *args, **kwargs):
            if inputs["input_ids"].shape[0] > 2:
                auditor._pending.clear()  # the failed attempt's batches never reach an optimizer step
                raise RuntimeError("CUDA out of memory. (simulated)")
            return super().compute_loss(model, inputs, *args, **kwargs)

    return OutOfMemoryAboveTwoRows


AUTO = Scenario("auto_batch", tiny_causal_lm, random_rows(24, seed=13), PaddingCollator(PAD),
                       micro_batch=4, accumulation=2, args={"auto_find_batch_size": True})


@pytest.mark.slow
def test_auto_find_batch_size_keeps_the_effective_batch(tmp_path, caplog):
    auditor = BigBatchAuditor()
    with caplog.at_level(logging.INFO, logger="hf_accum.trainer"):
        run = run_trainer(AUTO, str(tmp_path), _oom_above_two_rows(AccumTrainer, auditor), auditor=auditor)
    assert run.trainer.args.gradient_accumulation_steps == 4
    assert "gradient_accumulation_steps 2 -> 4" in caplog.text
    assert "effective batch 8 = 2 per device x 4 accumulation x 1 process" in caplog.text
    assert [log["sequences_per_update"] for log in run.update_logs] == [8, 8, 8]
    assert run.max_error < 1e-10


@pytest.mark.slow
def test_stock_auto_find_batch_size_halves_the_effective_batch(tmp_path):
    auditor = BigBatchAuditor()
    run = run_trainer(AUTO, str(tmp_path), _oom_above_two_rows(Trainer, auditor), auditor=auditor)
    assert run.trainer.args.gradient_accumulation_steps == 2
    assert {r.micro_batches for r in run.auditor.records} == {2}  # 2 x 2 = 4 sequences per update, not 8
