"""``rampup_batch_size='auto'``: the controller on a synthetic noise-scale series (batch sequence, hysteresis,
minimum spacing, the LR rules), every update of an auto-ramped loop run exact in float64 (1e-10), the LR of each
update from the samples consumed before it and its batch, kill + resume mid-ramp, and the refusals."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from hf_accum import LoopConfig, train
from hf_accum.batching import PaddingCollator
from hf_accum.loop.config import LoopConfigError
from hf_accum.planning.auto_ramp import AutoRampSettings, BatchController, RampSchedule, schedule_shape
from hf_accum.testing import PAD, Scenario, fresh_accelerator, random_rows, run_exact, tiny_causal_lm

EXACT = 1e-10
ROWS = 64  # micro-batch 2 -> 32 micro-batches per epoch
# Thresholds low enough that the tiny model's noise scale (hundreds of targets) crosses them within a few updates.
EAGER = {"margin": 0.5, "release": 0.25, "patience": 2, "min_updates": 2}


# -- the controller alone, on a synthetic series ---------------------------------------------------------------------

def _controller(**settings) -> BatchController:
    return BatchController(AutoRampSettings(**{"min_updates": 1, **settings}), per_round=4, max_accumulation=16)


def _feed(controller: BatchController, series: list[float | None], targets_per_sequence: float = 10.0) -> list[int]:
    """The batch (sequences) of every update while the series is read; targets grow with the batch."""
    batches = []
    for update, reading in enumerate(series, start=1):
        batches.append(controller.batch)
        controller.observe(update, reading, controller.batch * targets_per_sequence)
    return batches


def test_batch_grows_after_patience_readings_above_the_margin_up_to_the_global_batch():
    # Start 2 x 4 = 8 sequences (80 targets): threshold 160; 16 seqs: 320 (200 holds there); 32 seqs: 640; cap 64.
    controller = _controller(patience=2)
    batches = _feed(controller, [200, 200, 200, 200, 400, 400, 10_000, 10_000, 10_000, 10_000])
    assert batches == [8, 8, 16, 16, 16, 16, 32, 32, 64, 64]
    assert [(c.update, c.old_batch, c.new_batch) for c in controller.changes] == [(2, 8, 16), (6, 16, 32), (8, 32, 64)]
    first = controller.changes[0]
    assert (first.noise_scale, first.targets, first.threshold) == (200, 80, 160)
    assert "200 targets > threshold 160" in first.reason()


def test_hysteresis_holds_between_the_thresholds_and_resets_below_release():
    # 80 targets: growth threshold 160 (margin 2), reset threshold 80 (release 1).
    held = _controller(patience=3)
    assert _feed(held, [200, 100, 200, 120, 200, 50]) == [8] * 5 + [16]  # 100, 120 hold the count: 3rd above grows
    reset = _controller(patience=3)
    assert _feed(reset, [200, 200, 50, 200, 200, 200, 50]) == [8] * 6 + [16]  # 50 resets: three more needed
    assert reset.changes[0].update == 6


def test_no_reading_changes_nothing_and_min_updates_spaces_the_changes():
    controller = _controller(patience=1, min_updates=3)
    batches = _feed(controller, [None, 10_000, 10_000, None, 10_000, 10_000, 10_000])
    # Update 3 is the third at 8 sequences: grow; then updates 4-6 at 16, grow after 6.
    assert batches == [8, 8, 8, 16, 16, 16, 32]
    skipped = _controller(patience=1)
    skipped.observe(1, 10_000, 80, full_window=False)  # an epoch's short last window: no reading
    assert skipped.batch == 8 and skipped.above == 0


def test_decisions_are_deterministic_and_survive_a_state_round_trip():
    series = [150, 170, 90, 200, 210, 60, 400, 500, 800, 900, 1500, 1600]
    one, two = _controller(patience=2), _controller(patience=2)
    assert _feed(one, series) == _feed(two, series)
    half, rest = _controller(patience=2), _controller(patience=2)
    first = _feed(half, series[:7])
    rest.load_state_dict(half.state_dict())
    later = []
    for update, reading in enumerate(series[7:], start=8):
        later.append(rest.batch)
        rest.observe(update, reading, rest.batch * 10.0)
    assert first + later == _feed(_controller(patience=2), series)


@pytest.mark.parametrize("rule, factors", [
    ("constant", [1.0, 1.0, 1.0, 1.0]),
    ("sqrt", [math.sqrt(8 / 64), math.sqrt(16 / 64), math.sqrt(32 / 64), 1.0]),
    ("seesaw", [1.0, 2 ** -0.5, 0.5, 2 ** -1.5]),  # 1/sqrt(2) per doubling
])
def test_lr_rule_applies_exactly_at_the_update_where_the_batch_changes(rule, factors):
    controller = _controller(patience=1, lr_rule=rule)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    schedule = RampSchedule(optimizer, controller, horizon=1000, name="linear", warmup=0)
    shape = schedule_shape("linear", 0, 1000)
    consumed, lrs, expected = 0, [], []
    for update, reading in enumerate([10_000] * 4, start=1):
        schedule.open_window(controller.accumulation)
        lrs.append(schedule.get_last_lr()[0])
        expected.append(0.1 * shape(consumed) * factors[update - 1])
        consumed += controller.batch
        schedule.step()
        controller.observe(update, reading, controller.batch * 10.0)
    assert lrs == pytest.approx(expected, rel=1e-14, abs=0)


def test_settings_refuse_bad_values_naming_the_key():
    with pytest.raises(ValueError, match=r"rampup_auto.lr_rule='cosine'; allowed: constant, sqrt, seesaw"):
        AutoRampSettings.of({"lr_rule": "cosine"})
    with pytest.raises(ValueError, match=r"rampup_auto.release=3.0 must be <= margin=2.0"):
        AutoRampSettings.of({"release": 3.0})
    with pytest.raises(ValueError, match=r"rampup_auto.speed: unknown key"):
        AutoRampSettings.of({"speed": 2})
    with pytest.raises(ValueError, match=r"min_batch_size=6 must be a multiple of micro-batch x processes = 4"):
        BatchController(AutoRampSettings(min_batch_size=6), per_round=4, max_accumulation=16)


# -- the loop --------------------------------------------------------------------------------------------------------

def _scenario(lr_rule: str = "seesaw", **kwargs) -> Scenario:
    values = dict(micro_batch=2, accumulation=8, epochs=2, scheduler="linear",
                  loop_kwargs={"rampup_batch_size": "auto", "warmup_ratio": 0.1,
                               "rampup_auto": {**EAGER, "lr_rule": lr_rule}})
    values.update(kwargs)
    return Scenario("auto_ramp", tiny_causal_lm, random_rows(ROWS, seed=41, prompt_masking=True), PaddingCollator(PAD),
                    **values)


def _nominal_batches(updates) -> list[int]:
    """The controller's batch at every update, from the logged changes (an epoch's short window keeps it)."""
    batch, batches = 4, []
    for update in updates:
        batches.append(batch)
        if update.batch_change:
            batch = int(re.match(r"batch \d+ -> (\d+)", update.batch_change).group(1))
    return batches


def test_auto_ramped_updates_equal_the_big_batch_of_their_rows():
    result, auditor = run_exact(_scenario())
    errors = [r.relative_error for r in auditor.records]
    assert len(errors) == len(result.updates) > 0
    assert max(errors) < EXACT, errors
    assert [r.micro_batches for r in auditor.records] == [u.micro_batches for u in result.updates]
    sequences = [u.sequences for u in result.updates]
    assert sequences[0] == 4 and max(sequences) == 16, sequences  # it grew, to the configured global batch
    assert sum(sequences) == 2 * ROWS  # every row of both epochs, none twice
    changes = [u for u in result.updates if u.batch_change]
    assert len(changes) == 2 and all("threshold" in u.batch_change for u in changes)


def test_lr_of_each_update_is_the_schedule_at_the_samples_consumed_before_it_times_the_rule():
    result, _ = run_exact(_scenario("seesaw"))
    horizon = 2 * ROWS
    shape = schedule_shape("linear", math.ceil(0.1 * horizon), horizon)
    consumed, expected = 0, []
    for update, batch in zip(result.updates, _nominal_batches(result.updates)):
        expected.append(1e-2 * shape(consumed) * math.sqrt(4 / batch))
        consumed += update.sequences
    assert [u.learning_rate for u in result.updates] == pytest.approx(expected, rel=1e-12, abs=0)


def _auto_run(output_dir, resume=None, eval_dataloader=None, auto=True, **changes):
    accelerator = fresh_accelerator(8)
    torch.manual_seed(0)
    model = tiny_causal_lm()
    loader = DataLoader(random_rows(ROWS, seed=41, prompt_masking=True), batch_size=2, shuffle=True,
                        collate_fn=PaddingCollator(PAD))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    settings = dict(num_train_epochs=2, lr_scheduler_type="cosine", warmup_ratio=0.1, disable_tqdm=True,
                    output_dir=str(output_dir) if output_dir else None, save_steps=1,
                    rampup_batch_size="auto" if auto else None,
                    rampup_auto={**EAGER, "lr_rule": "seesaw"} if auto else None)
    loop = LoopConfig(**{**settings, **changes})
    result = train(model, optimizer, loader, accelerator, loop, resume_from_checkpoint=resume,
                   eval_dataloader=eval_dataloader)
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    return result, weights


def test_resume_mid_ramp_reproduces_the_uninterrupted_run(tmp_path):
    full, weights = _auto_run(tmp_path / "full")
    changes = [u.step for u in full.updates if u.batch_change]
    assert len(changes) >= 2, [u.sequences for u in full.updates]
    middle = changes[0] + 1  # after the first change, before the second
    assert middle < changes[1]
    resumed, resumed_weights = _auto_run(tmp_path / "again", resume=str(tmp_path / "full" / f"checkpoint-{middle}"))
    assert [u.sequences for u in resumed.updates] == [u.sequences for u in full.updates]
    assert [u.batch_change for u in resumed.updates] == [u.batch_change for u in full.updates]
    assert [u.loss for u in resumed.updates] == [u.loss for u in full.updates]
    assert [u.learning_rate for u in resumed.updates] == [u.learning_rate for u in full.updates]
    assert torch.equal(resumed_weights, weights)


def test_resume_across_auto_and_fixed_windows_is_refused(tmp_path):
    from hf_accum.checkpointing.checkpoint import ResumeMismatchError

    _auto_run(tmp_path / "auto", num_train_epochs=0.25)
    with pytest.raises(ResumeMismatchError, match="other windows"):
        _auto_run(tmp_path / "fixed", resume=str(tmp_path / "auto" / "checkpoint-2"), auto=False)
    _auto_run(tmp_path / "fixed_first", auto=False, max_steps=2)
    with pytest.raises(ResumeMismatchError, match="other windows"):  # before any state is loaded
        _auto_run(tmp_path / "auto_again", resume=str(tmp_path / "fixed_first" / "checkpoint-2"))


def test_the_run_s_last_update_is_evaluated_though_the_update_count_was_not_known():
    held_out = DataLoader(random_rows(8, seed=3, prompt_masking=True), batch_size=4, collate_fn=PaddingCollator(PAD))
    result, _ = _auto_run(None, eval_dataloader=held_out, eval_strategy="steps", eval_steps=1000)
    evaluated = [u.step for u in result.updates if u.eval_loss is not None]
    assert evaluated == [len(result.updates)] and len(result.updates) < 32  # 32: the upper bound (all at K=2)


@pytest.mark.slow
def test_sigkill_mid_ramp_then_the_same_command_reproduces_the_run(tmp_path):
    """A real process killed (SIGKILL) after the first change; the same command resumes from its last checkpoint."""
    from hf_accum.testing import cases
    from hf_accum.testing.cases import rampup_auto_resume_worker

    worker = os.path.join(os.path.dirname(cases.__file__), "rampup_auto_resume_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(out, *extra):
        return subprocess.run([sys.executable, worker, str(out), *extra], env=env, capture_output=True, text=True,
                              timeout=600)

    def run_here(out, *extra):
        """A run nothing kills (the reference, the resume): here, on one torch thread as the worker processes
        (bit-equal weights); a process of its own would show nothing more, and cost a start-up."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            rampup_auto_resume_worker.main(str(out), list(extra))
        finally:
            torch.set_num_threads(threads)

    run_here(tmp_path / "ref")
    killed = run(tmp_path / "story", "--kill-after-first-change")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_here(tmp_path / "story", "--resume")  # the same command, resumed from the killed run's last checkpoint
    expected = torch.load(tmp_path / "ref" / "final.pt")
    got = torch.load(tmp_path / "story" / "final.pt")
    assert got["sequences"] == expected["sequences"] and len(set(got["sequences"])) > 1
    assert got["learning_rates"] == expected["learning_rates"]
    assert got["losses"] == expected["losses"]
    assert torch.equal(got["weights"], expected["weights"])


@pytest.mark.parametrize("changes, message", [
    ({"max_steps": 10}, "max_steps=10 with rampup_batch_size='auto'"),
    ({"warmup_steps": 3}, "warmup_steps=3 with rampup_batch_size='auto'"),
    ({"rampup_auto": {"lr_rule": "linear"}}, "lr_rule='linear'; allowed: constant, sqrt, seesaw"),
    ({"tokens_per_update": 100}, "one of them"),
])
def test_loop_config_refuses_what_the_auto_ramp_cannot_run(changes, message):
    with pytest.raises(LoopConfigError, match=re.escape(message)):
        LoopConfig(**{"rampup_batch_size": "auto", **changes})


def test_rampup_auto_without_auto_is_refused_and_auto_turns_noise_scale_on():
    with pytest.raises(LoopConfigError, match="rampup_batch_size is not 'auto'"):
        LoopConfig(rampup_auto={"lr_rule": "sqrt"})
    assert LoopConfig(rampup_batch_size="auto").noise_scale is True


def test_accum_trainer_refuses_and_names_the_loop_engine():
    from hf_accum import AccumTrainer
    from hf_accum.planning.planned_windows import WindowsNeedLoopError

    with pytest.raises(WindowsNeedLoopError, match=r"rampup_batch_size='auto' needs the loop engine"):
        AccumTrainer(rampup_batch_size="auto")
