"""The 2-process encoder-decoder jobs (job ``moe`` of tests/distributed/loop_ddp_worker.py runs them,
tests/distributed/test_moe_ddp.py checks each): ``(family, lengths, batch, front end)``. T5 and BART (the two
ways a model builds its decoder inputs: ``_shift_right`` and ``shift_tokens_right``) in every combination; the other
families with labels-only batches of unequal lengths (the collator ``DataCollatorForSeq2Seq`` without ``model=``
gives)."""

from __future__ import annotations

from itertools import product

from hf_accum.testing.seq2seq import SEQ2SEQ_FAMILIES

FRONT_ENDS = ("loop", "trainer")
SEQ2SEQ_DDP_JOBS: tuple[tuple[str, str, str, str], ...] = (
    *product(("t5", "bart"), ("unequal_lengths", "equal_lengths"), ("labels_only", "decoder_input_ids"), FRONT_ENDS),
    *product([f for f in SEQ2SEQ_FAMILIES if f not in ("t5", "bart")], ("unequal_lengths",), ("labels_only",),
             FRONT_ENDS),
)
