"""Test support shared by the test suite, ``hf-accum check`` and the benchmarks (like Accelerate's
``test_utils``): tiny models built from config, uneven random data, audited training runs, and a
torchrun launcher. Nothing here is used by training itself.

* :mod:`~hf_accum.testing.models` -- tiny Llamas (float64, dtype-keeping RMSNorm; optionally with a LoRA
  adapter), a causal LM whose ``forward`` takes no ``**kwargs``;
* :mod:`~hf_accum.testing.families` -- every model family the docs list, one row each (a tiny builder, its data,
  its expected loss path), for tests/unit/test_model_families.py;
* :mod:`~hf_accum.testing.data` -- random rows of uneven length (prompt masking, classification
  labels, long/short rows per rank);
* :mod:`~hf_accum.testing.scenarios` -- a scenario (model, data, batch arithmetic) run through the
  hf_accum loop, the naive ``loss / K`` loop or a ``Trainer``, each under
  :class:`hf_accum.verify.BigBatchAuditor`; the big-batch LR reference;
* :mod:`~hf_accum.testing.launch` -- start a worker on 2 real CPU processes with torchrun (or on
  2 "nodes" of this host);
* :mod:`~hf_accum.testing.deltas` -- the weight-delta audit for engines that keep gradients out of
  reach (DeepSpeed ZeRO): each SGD update against the independently computed big-batch update.
"""

from hf_accum.testing.data import ClassificationCollator, independent_mean_loss, random_rows
from hf_accum.testing.models import (
    PAD,
    VOCAB,
    NoKwargsForCausalLM,
    keep_norm_dtype,
    tiny_causal_lm,
    tiny_config,
    tiny_lora_causal_lm,
    tiny_sequence_classifier,
)
from hf_accum.testing.scenarios import (
    AuditedTrainerRun,
    Scenario,
    big_batch_learning_rates,
    fresh_accelerator,
    loop_config,
    naive_loop,
    reset_accelerate_state,
    run_exact,
    run_naive,
    run_trainer,
    training_args,
)

__all__ = [
    "PAD",
    "VOCAB",
    "AuditedTrainerRun",
    "ClassificationCollator",
    "NoKwargsForCausalLM",
    "Scenario",
    "big_batch_learning_rates",
    "independent_mean_loss",
    "fresh_accelerator",
    "keep_norm_dtype",
    "loop_config",
    "naive_loop",
    "reset_accelerate_state",
    "random_rows",
    "run_exact",
    "run_naive",
    "run_trainer",
    "tiny_causal_lm",
    "tiny_config",
    "tiny_lora_causal_lm",
    "tiny_sequence_classifier",
    "training_args",
]
