"""The 2-process ``AccumTrainer`` case (tests/distributed/trainer_ddp_worker.py runs it, tests/distributed/
test_trainer_ddp.py re-derives its expectations from it): ranks with ~10x different token counts."""

from __future__ import annotations

from hf_accum.batching import PaddingCollator
from hf_accum.testing import PAD, Scenario, random_rows, tiny_causal_lm

MICRO_BATCH, ACCUMULATION, EXAMPLES, EPOCHS = 2, 3, 28, 2
EVAL_BATCH, EVAL_ROWS = 3, random_rows(10, seed=14, prompt_masking=True)


def scenario() -> Scenario:
    # Accelerate deals micro-batch i to rank i % 2 (sequential sampler): rank 0 gets only 40-token
    # rows, rank 1 only 3-5-token rows -- per-rank counts differ ~10x. 14 micro-batches = 7 per
    # rank = windows of 3, 3, 1 micro-batches: a short last window in each of the 2 epochs.
    examples = random_rows(EXAMPLES, seed=11, long_rows=lambda i: (i // MICRO_BATCH) % 2 == 0)
    return Scenario(
        "ddp", tiny_causal_lm, examples, PaddingCollator(PAD), micro_batch=MICRO_BATCH,
        accumulation=ACCUMULATION, epochs=EPOCHS, scheduler="linear", warmup_steps=1,
    )
