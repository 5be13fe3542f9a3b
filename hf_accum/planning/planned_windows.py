"""Which engine can change the window from update to update: the refusal shared by AccumTrainer and the recipe.

``rampup_batch_size`` and ``tokens_per_update`` plan a window per update before training
(:mod:`hf_accum.loop.windows`); only the loop engine (:func:`hf_accum.train`) can follow such a plan. This module
holds the refusal on its own, so that the Trainer side never imports the loop package to borrow it.
"""

from __future__ import annotations

from typing import Any

from hf_accum.errors import InputError


class WindowsNeedLoopError(InputError):
    """Ramp-up or a token budget asked of AccumTrainer: a changing window needs the loop engine."""


def refuse_planned_windows(where: str, rampup_batch_size: Any = None, tokens_per_update: Any = None) -> None:
    """AccumTrainer (and the recipe's trainer engine) cannot change the window: Trainer fixes it per epoch
    inside ``_inner_training_loop``, which AccumTrainer never overrides."""
    for key, value in (("rampup_batch_size", rampup_batch_size), ("tokens_per_update", tokens_per_update)):
        if value is not None:
            raise WindowsNeedLoopError(
                f"{where}{key}={value!r} needs the loop engine (engine=loop, hf_accum.train): Trainer fixes the "
                "window of every update itself; allowed with the trainer engine: null"
            )
