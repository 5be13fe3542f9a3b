"""The recipe's held-out metric around training: :func:`evaluate`, the SFT objective's exact match of the greedy
answer, scored where the model's sharding allows, and :func:`score_before_training`, the metric before training,
scored once per output directory (a resumed run reads back what its first start scored).

Moved out of ``recipes/finetune_llama.py`` (which passes :func:`evaluate` to its objective table, as before): the
script keeps the order of a run; the rules of where a sharded model can be scored live here.
"""

from __future__ import annotations

import contextlib
from typing import Any

from hf_accum.distributed import fsdp_unsharded_root, is_fsdp_sharded, is_partitioned
from hf_accum.recipe.config import RecipeConfig
from hf_accum.recipe.data import exact_match
from hf_accum.recipe.outputs import EVAL_BEFORE_NAME, saved_eval_before, say
from hf_accum.recipe.progress import phase_bar


def evaluate(model: Any, tokenizer: Any, data: Any, config: RecipeConfig, args: Any, when: str = "") -> Any:
    """Held-out exact match of the greedy answer, returned on the main process (None elsewhere), with a progress
    bar of the rows (``when``: "before training" / "after training").

    A whole model is scored by the main process alone. A ZeRO-3-partitioned one gathers its
    parameters in every forward, so every rank generates the same answers in step (synced_gpus);
    before training, a model partitioned at load (trainer engine) has no DeepSpeed hooks yet to
    gather with, and is not scored."""
    # FSDP2 (DTensor parameters) gathers in every forward too: every rank generates, in step.
    partitioned = is_partitioned(model) or is_fsdp_sharded(model)
    hooked = is_fsdp_sharded(model) or hasattr(model, "ds_id")  # DeepSpeed numbers the modules it hooks
    if not data.eval_rows or (partitioned and not hooked) or (not partitioned and args.process_index != 0):
        return None
    with (fsdp_unsharded_root(model) if is_fsdp_sharded(model) else contextlib.nullcontext(),
          phase_bar(len(data.eval_rows), f"held-out exact match {when}".strip()) as advance):
        score = exact_match(
            model, tokenizer, data.eval_rows, config.data.eval_max_new_tokens,
            batch_size=args.per_device_eval_batch_size, on_rows=advance, synced_gpus=partitioned,
        )
    return score if args.process_index == 0 else None


def score_before_training(objective: Any, model: Any, tokenizer: Any, data: Any, config: RecipeConfig, args: Any,
                          resuming: bool) -> Any:
    """The held-out metric before training, printed: scored once per output directory (a resumed run reads back
    what its first start scored), or skipped (data.eval_before=false). ``objective``: the recipe's
    :class:`~hf_accum.recipe.preference.Objective` of the run."""
    name = f"held-out {objective.metric} before training"
    if not config.data.eval_before:
        say(f"{name}: skipped (data.eval_before=false)")
        return None
    found, before = saved_eval_before(config) if resuming else (False, None)
    if found:
        say(f"{name}: {objective.score(before)} (scored at this run's first start, kept in {EVAL_BEFORE_NAME})")
        return before
    before = objective.evaluate(model, tokenizer, data, config, args, "before training")
    why = " (ZeRO-3 partitioned the model as it loaded: scored after training)" if (
        before is None and data.eval_rows and is_partitioned(model)) else ""
    say(f"{name}: {objective.score(before)}{why}")
    return before
