"""The one update boundary: its decisions, and proof that every front-end takes them from it."""

from __future__ import annotations

import ast
import pathlib
from dataclasses import replace

import pytest

import hf_accum
import hf_accum.boundary as boundary
from hf_accum.accumulation import WindowTotals
from hf_accum.batching import PaddingCollator
from hf_accum.boundary import FP16_OVERFLOW, NO_TARGETS, Halt, decide
from hf_accum.control import NonFiniteGuard, NonFiniteLossError, TrainingControl, TrainingStopped
from hf_accum.errors import InputError
from hf_accum.loop import LoopConfig, LoopConfigError
from hf_accum.testing import PAD, Scenario, random_rows, run_exact, run_trainer, tiny_causal_lm

LIBRARY = pathlib.Path(hf_accum.__file__).parent


def test_a_window_with_targets_applies_and_nothing_halts():
    decision = decide(WindowTotals(loss_sum=3.0, targets=6), NonFiniteGuard(2), TrainingControl())
    assert decision.applied and not decision.save and decision.halt is None
    assert decision.overflowed().skip_reason == FP16_OVERFLOW


def test_a_window_without_targets_is_skipped():
    decision = decide(WindowTotals(targets=0, sequences=2), NonFiniteGuard(2), TrainingControl())
    assert decision.skip_reason == NO_TARGETS and not decision.save


def test_the_nonfinite_limit_halts_with_a_checkpoint_before_a_stop_request():
    guard, control = NonFiniteGuard(2), TrainingControl()
    first = decide(WindowTotals(targets=4, nonfinite_losses=1), guard, control)
    assert first.skip_reason == "inf/nan loss in 1 micro-batch(es)" and first.halt is None
    control.request_stop("SIGTERM")
    second = decide(WindowTotals(targets=4, nonfinite_gradients=1, stop_requests=1), guard, control)
    assert second.halt is Halt.NONFINITE_LIMIT and second.save
    assert isinstance(second.halt_error(guard, 7, None), NonFiniteLossError)


def test_a_stop_on_another_rank_halts_every_rank_with_a_checkpoint():
    decision = decide(WindowTotals(targets=4, stop_requests=1), NonFiniteGuard(2), TrainingControl())
    assert decision.halt is Halt.STOP and decision.save and decision.applied
    error = decision.halt_error(NonFiniteGuard(2), 3, "out/checkpoint-3")
    assert isinstance(error, TrainingStopped) and "stop requested on another process" in str(error)


def test_a_checkpoint_request_saves_and_goes_on():
    decision = decide(WindowTotals(targets=4, checkpoint_requests=1), NonFiniteGuard(2), TrainingControl())
    assert decision.save and decision.halt is None and decision.applied


def test_loop_config_names_the_bad_field_and_what_is_allowed():
    with pytest.raises(LoopConfigError, match=r"LoopConfig.eval_strategy='sometimes'; allowed: 'no', 'steps'"):
        LoopConfig(eval_strategy="sometimes")
    with pytest.raises(InputError, match=r"LoopConfig.warmup_ratio=1.5 must be between 0 and 1"):
        LoopConfig(warmup_ratio=1.5)


def test_skip_reasons_are_built_in_the_boundary_only():
    """No other library module spells a skip reason (a copy of the skip logic would have to)."""
    reasons = {NO_TARGETS, FP16_OVERFLOW, boundary.OTHER_RANK_STOP}
    for path in LIBRARY.rglob("*.py"):
        if path.name == "boundary.py":
            continue
        strings = {node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)}
        assert not strings & reasons, f"{path} builds a skip reason itself"


SCENARIO = Scenario("boundary", tiny_causal_lm, random_rows(12, seed=5), PaddingCollator(PAD), accumulation=2)


@pytest.fixture
def skip_second_update(monkeypatch):
    """The boundary's decision function, patched to skip update 2 for a reason only it can give."""
    real, calls = boundary.decide, []

    def patched(totals, guard, control):
        decision = real(totals, guard, control)
        calls.append(decision)
        return replace(decision, skip_reason="patched") if len(calls) == 2 else decision

    monkeypatch.setattr(boundary, "decide", patched)
    return calls


def test_the_loop_takes_every_update_decision_from_the_boundary(skip_second_update):
    result, _ = run_exact(SCENARIO)
    assert len(skip_second_update) == len(result.updates) == 3
    assert [(u.applied, u.skip_reason) for u in result.updates] == [(True, ""), (False, "patched"), (True, "")]
    assert result.updates[1].grad_norm is None


def test_the_trainer_takes_every_update_decision_from_the_boundary(skip_second_update, tmp_path):
    run = run_trainer(SCENARIO, str(tmp_path), hf_accum.AccumTrainer)
    assert len(skip_second_update) == len(run.trainer.updates) == 3
    assert [(u.applied, u.skip_reason) for u in run.trainer.updates] == [(True, ""), (False, "patched"), (True, "")]
    assert run.grads_were_none == [False, True, False]  # the skipped window reached no weight


def test_the_sft_trainer_is_the_trainer_boundary():
    import inspect

    from hf_accum.trainer.core import AccumTrainer
    from hf_accum.trainer.sft import AccumSFTTrainer

    # It adds TRL's metrics on the side of both hooks, and leaves counting and closing windows to AccumTrainer:
    # each override calls AccumTrainer's through super(), and nothing in it touches the boundary itself.
    for name in ("training_step", "compute_loss"):
        override = getattr(AccumSFTTrainer, name)
        assert override is not getattr(AccumTrainer, name)
        source = inspect.getsource(override)
        assert f"super().{name}(" in source and "boundary" not in source, name
