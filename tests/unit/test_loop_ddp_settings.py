"""The loop's DDP ``find_unused_parameters`` decision (:mod:`hf_accum.loop.ddp`), in process: Trainer's rule
(on, unless the model uses activation checkpointing), a model that is not DDP left alone, and the config field's
refusal of a bad value. The 2-process runs are in tests/distributed/test_loop_ddp.py."""

from __future__ import annotations

import pytest

from hf_accum.loop import LoopConfig
from hf_accum.loop.config import LoopConfigError
from hf_accum.loop.ddp import set_find_unused_parameters, trainer_default
from hf_accum.testing import tiny_causal_lm


def test_trainer_default_is_on_unless_activation_checkpointing():
    model = tiny_causal_lm()
    assert trainer_default(model) is True
    model.gradient_checkpointing_enable()
    assert trainer_default(model) is False


def test_a_model_that_is_not_ddp_is_left_alone(caplog):
    model = tiny_causal_lm()
    set_find_unused_parameters(model, None, is_main_process=True)
    assert not hasattr(model, "find_unused_parameters") and "find_unused" not in caplog.text


def test_a_bad_value_is_refused_naming_the_field():
    with pytest.raises(LoopConfigError, match=r"LoopConfig.ddp_find_unused_parameters='yes'; allowed: None"):
        LoopConfig(ddp_find_unused_parameters="yes")  # type: ignore[arg-type]
