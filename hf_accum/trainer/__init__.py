"""The Trainer front-end: :class:`AccumTrainer` (``core.py``, a thin map of ``transformers.Trainer`` hooks)
and its collaborators -- ``window.py`` (counting, scaling, closing a window through the one update boundary),
``updates.py`` (the update records), ``checkpoints.py`` (atomic checkpoints, resume checks, the halt),
``batch_plan.py`` (effective batch, LR horizon), ``callbacks.py`` (the boundary's decisions carried out in
Trainer's flow), ``evaluation.py`` (the exact held-out loss). :class:`hf_accum.AccumSFTTrainer` (TRL) builds on it.
"""

from hf_accum.trainer.core import AccumTrainer

__all__ = ["AccumTrainer"]
