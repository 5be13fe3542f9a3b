"""The Accelerate training loop with exact gradient accumulation (:func:`train`).

Layout: ``run.py`` (``train()``, a table of contents), ``config.py`` (:class:`LoopConfig`, validated),
``plan.py`` (micro-batches, planned updates, batch arithmetic), ``steppers.py`` (one epoch as updates: DDP /
single process, or DeepSpeed), ``supervisor.py`` (checkpoints, halt, resume), ``evaluation.py`` (the exact
held-out loss). Every update closes through the one :class:`hf_accum.boundary.UpdateBoundary`; the records are
:mod:`hf_accum.records`.

The normalization (see :mod:`hf_accum.accumulation` for the math) works like fairseq's: every micro-batch
backpropagates its *summed* token loss; at the window boundary the target counts are all-reduced and the
gradients are scaled once by ``K * W / N`` (``K`` undoes the fixed ``1 / K`` that ``Accelerator.backward``
applies, which would give a short last window the wrong weight ``r / K``); then clip, step, and step the LR
scheduler only if the optimizer step was applied. Under DeepSpeed the window is counted before backward and the
loss carries the factor. The scheduler horizon is planned in updates before training
(:mod:`hf_accum.planning.schedule`).
"""

from hf_accum.loop.config import LoopConfig, LoopConfigError
from hf_accum.loop.evaluation import evaluate_loss
from hf_accum.loop.run import train
from hf_accum.records import TrainResult, UpdateLog

__all__ = ["LoopConfig", "LoopConfigError", "TrainResult", "UpdateLog", "evaluate_loss", "train"]
