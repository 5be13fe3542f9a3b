"""The Trainer front-end: :class:`AccumTrainer` (``core.py``, a thin map of ``transformers.Trainer`` hooks)
and its collaborators -- ``window.py`` (counting, scaling, closing a window through the one update boundary),
``updates.py`` (the update records), ``checkpoints.py`` (atomic checkpoints, resume checks, the halt),
``batch_plan.py`` (effective batch, LR horizon), ``callbacks.py`` (the boundary's decisions carried out in
Trainer's flow), ``evaluation.py`` (the exact held-out loss). The TRL drop-ins build on it: ``sft.py``
(AccumSFTTrainer), ``dpo.py`` (AccumDPOTrainer), ``grpo.py`` (AccumGRPOTrainer), ``reward.py`` (AccumRewardTrainer).
They import TRL, so this package imports only ``core.py`` up front.
"""

from hf_accum.trainer.core import AccumTrainer

__all__ = ["AccumTrainer"]
