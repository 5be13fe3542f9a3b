"""An inf/NaN micro-batch never reaches the weights, in both engines.

One epoch of 11 micro-batches (K=4: windows of 4, 4 and 3), a NaN injected into micro-batch 6 (window 2).
The run must end exactly where a run ends that never had window 2's update: the reference trains on the same
rows without window 2's micro-batches. Weights, AdamW's moments and step counts and the LR must be equal. The
LR schedule (constant with 3 warmup updates) does not depend on the horizon, and is still warming up at the
skip: had the skipped update stepped the scheduler, every later LR would differ.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import Trainer

from hf_accum import AccumTrainer, LoopConfig, train
from hf_accum.batching import PaddingCollator
from hf_accum.checkpointing.checkpoint import checkpoint_path, is_complete_checkpoint
from hf_accum.control import NonFiniteLossError
from hf_accum.testing import PAD, Scenario, fresh_accelerator, random_rows, run_trainer, tiny_causal_lm

MICRO_BATCH, ACCUMULATION = 2, 4
ROWS = random_rows(22, seed=41, prompt_masking=True)
BAD_MICRO_BATCH = 6  # inside window 2 (micro-batches 5..8)
WITHOUT_WINDOW_2 = ROWS[:8] + ROWS[16:]  # windows 1 and 3, grouped exactly as before


def nan_loss(loss_sum, outputs):
    return loss_sum * float("nan")


def inf_gradient(loss_sum, outputs):
    """The loss stays finite; the gradient flowing into the logits becomes inf/nan."""
    outputs.logits.register_hook(lambda grad: grad * float("inf"))
    return loss_sum


def injecting(loss_sum_fn, injection, bad: set[int]):
    """Wrap a loss: ``injection`` applies to the micro-batches numbered in ``bad`` (1-based, in call order)."""
    calls = {"n": 0}

    def wrapped(outputs, labels, inputs):
        calls["n"] += 1
        loss_sum, n_targets = loss_sum_fn(outputs, labels, inputs)
        return (injection(loss_sum, outputs) if calls["n"] in bad else loss_sum), n_targets

    return wrapped


# -- the loop ---------------------------------------------------------------------------------------------


def loop_run(rows, injection=None, bad=frozenset(), **config):
    from hf_accum.losses.token_loss import token_loss_sum

    accelerator = fresh_accelerator(ACCUMULATION)
    model = tiny_causal_lm(seed=0)
    loader = DataLoader(rows, batch_size=MICRO_BATCH, shuffle=False, collate_fn=PaddingCollator(PAD))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loop_config = LoopConfig(lr_scheduler_type="constant_with_warmup", warmup_steps=3, disable_tqdm=True,
                             loss_kind="causal_lm", **config)
    def loss_sum_fn(outputs, labels, inputs):  # the logits path, with or without an injection
        return token_loss_sum(outputs.logits, labels, "causal_lm")

    if injection is not None:
        loss_sum_fn = injecting(loss_sum_fn, injection, set(bad))
    result = train(model, optimizer, loader, accelerator, loop_config, loss_sum_fn=loss_sum_fn)
    return result, model, optimizer


def assert_same_training_state(model, optimizer, reference_model, reference_optimizer):
    for (name, p), (_, q) in zip(model.named_parameters(), reference_model.named_parameters()):
        assert torch.equal(p, q), name
    state, reference = optimizer.state_dict(), reference_optimizer.state_dict()
    assert state["state"].keys() == reference["state"].keys()
    for index, moments in reference["state"].items():
        for key, value in moments.items():  # step, exp_avg, exp_avg_sq
            assert torch.equal(state["state"][index][key], value), (index, key)
    assert state["param_groups"][0]["lr"] == reference["param_groups"][0]["lr"]


@pytest.fixture(scope="module")
def loop_reference():
    return loop_run(WITHOUT_WINDOW_2)


@pytest.mark.parametrize("injection, reason", [(nan_loss, "inf/nan loss in 1 micro-batch(es)"),
                                               (inf_gradient, "inf/nan gradients")])
def test_loop_skips_a_nonfinite_window_entirely(loop_reference, injection, reason, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_accum.loop"):
        result, model, optimizer = loop_run(ROWS, injection, {BAD_MICRO_BATCH})
    reference_result, reference_model, reference_optimizer = loop_reference
    assert [u.applied for u in result.updates] == [True, False, True]
    assert result.skipped_nonfinite == [2] and result.updates[1].skip_reason == reason
    untouched = "skipped (weights, optimizer state and LR schedule untouched), 1 in a row"
    assert f"update 2: {reason}; {untouched}" in caplog.text
    # The applied updates used the reference's LRs: the skip did not step the scheduler.
    applied = [u.learning_rate for u in result.updates if u.applied]
    assert applied == [u.learning_rate for u in reference_result.updates] == pytest.approx([0.0, 1e-2 / 3])
    assert_same_training_state(model, optimizer, reference_model, reference_optimizer)


def test_loop_stops_after_too_many_nonfinite_updates_with_a_checkpoint(tmp_path):
    bad = set(range(5, 12))  # windows 2 and 3
    with pytest.raises(NonFiniteLossError, match=r"updates 2\.\.3: 2 consecutive updates had inf/NaN") as error:
        loop_run(ROWS, nan_loss, bad, max_consecutive_nonfinite=2, output_dir=str(tmp_path), save_steps=100)
    checkpoint = checkpoint_path(str(tmp_path), 3)
    assert f"checkpoint {checkpoint}" in str(error.value) and is_complete_checkpoint(checkpoint)


# -- AccumTrainer -----------------------------------------------------------------------------------------


def trainer_scenario(rows) -> Scenario:
    return Scenario("nonfinite", tiny_causal_lm, rows, PaddingCollator(PAD), micro_batch=MICRO_BATCH,
                    accumulation=ACCUMULATION, scheduler="constant_with_warmup", warmup_steps=3)


def injecting_trainer(injection, bad: set[int]) -> type[AccumTrainer]:
    """AccumTrainer whose summed loss of the micro-batches numbered in ``bad`` goes through ``injection``."""

    class Injected(AccumTrainer):
        calls = 0

        def loss_sum_and_count(self, outputs, labels, inputs):
            loss_sum, n_targets = super().loss_sum_and_count(outputs, labels, inputs)
            type(self).calls += 1
            return (injection(loss_sum, outputs) if type(self).calls in bad else loss_sum), n_targets

    return Injected


@pytest.fixture(scope="module")
def trainer_reference(tmp_path_factory):
    # The same class with nothing injected: the same (logits) loss path, so weights compare bitwise.
    return run_trainer(trainer_scenario(WITHOUT_WINDOW_2), str(tmp_path_factory.mktemp("reference")),
                       injecting_trainer(nan_loss, set()))


@pytest.mark.parametrize("injection", [nan_loss, inf_gradient])
def test_trainer_skips_a_nonfinite_window_entirely(trainer_reference, injection, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_accum.trainer"):
        run = run_trainer(trainer_scenario(ROWS), str(tmp_path),
                          injecting_trainer(injection, {BAD_MICRO_BATCH}))
    reason = "inf/nan loss in 1 micro-batch(es)" if injection is nan_loss else "inf/nan gradients"
    assert f"update 2: {reason}; skipped (weights, optimizer state and LR schedule untouched)" in caplog.text
    assert [log.get("updates_skipped_nonfinite") for log in run.update_logs] == [None, 1, None]
    assert run.grads_were_none == [False, True, False]  # the optimizer was handed no gradient at update 2
    assert run.trainer.state.global_step == 3
    reference = trainer_reference
    assert [run.lrs[0], run.lrs[2]] == reference.lrs == pytest.approx([0.0, 1e-2 / 3])
    assert run.trainer.lr_scheduler.last_epoch == reference.trainer.lr_scheduler.last_epoch == 2
    assert_same_training_state(run.trainer.model, run.trainer.optimizer, reference.trainer.model,
                               reference.trainer.optimizer)


def test_stock_trainer_lets_the_nan_into_the_weights(tmp_path):
    """Negative control: stock Trainer steps on the NaN window."""

    class NanTrainer(Trainer):
        calls = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            type(self).calls += 1
            return loss * float("nan") if type(self).calls == BAD_MICRO_BATCH else loss

    run = run_trainer(trainer_scenario(ROWS), str(tmp_path), NanTrainer)
    assert any(torch.isnan(p).any() for p in run.trainer.model.parameters())


def test_trainer_stops_after_too_many_nonfinite_updates_with_a_checkpoint(tmp_path):
    trainer_cls = injecting_trainer(nan_loss, set(range(5, 12)))
    with pytest.raises(NonFiniteLossError, match=r"updates 2\.\.3: 2 consecutive updates had inf/NaN") as error:
        run_trainer(trainer_scenario(ROWS), str(tmp_path), trainer_cls,
                    trainer_kwargs={"max_consecutive_nonfinite": 2})
    checkpoint = checkpoint_path(str(tmp_path), 3)
    assert f"checkpoint {checkpoint}" in str(error.value) and is_complete_checkpoint(checkpoint)
