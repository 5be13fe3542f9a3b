"""The recipe command the DeepSpeed and FSDP recipe tests (tests/distributed/test_{deepspeed,fsdp}_recipe.py) run on
2 processes, and their one-process reference (tests/distributed/conftest.py) runs in the pytest process: the same
arguments per engine, so each 2-process run is compared with the same command on one process.

The loop engine's command also scores the held-out loss during training, at updates 5 and 10: 7 held-out rows in
batches of 3 give rank 0 two batches and rank 1 one (the uneven-shard evaluation that test_deepspeed_recipe.py and
test_fsdp_recipe.py check under ZeRO-3 and FSDP2, in the same run as the adapter, instead of a launch of its
own). Only arguments here: the library never imports the recipe kit.
"""

from __future__ import annotations

# 10 updates with a checkpoint at 5 (hf_accum.recipe.testing.TEN_UPDATES).
TEN_UPDATES = ("training.max_steps=10", "training.save_steps=5", "data.num_train_examples=400")
HELD_OUT_ROWS = 7
HELD_OUT_DURING_TRAINING = ("training.eval_strategy=steps", "training.eval_steps=5",
                            f"data.num_eval_examples={HELD_OUT_ROWS}", "training.per_device_eval_batch_size=3")
# The recipe's small runs score 8 held-out rows (hf_accum.recipe.testing.SMALL).
SMALL_HELD_OUT_ROWS = 8


def engine_run(engine: str) -> list[str]:
    """The 10-update command of ``engine`` (``loop`` or ``trainer``), without the launcher's own settings."""
    held_out: tuple[str, ...] = HELD_OUT_DURING_TRAINING if engine == "loop" else ()
    return [f"engine={engine}", *TEN_UPDATES, *held_out]


def held_out_rows(engine: str) -> int:
    """The held-out rows ``engine_run(engine)`` scores after training."""
    return HELD_OUT_ROWS if engine == "loop" else SMALL_HELD_OUT_ROWS
