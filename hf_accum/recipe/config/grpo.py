"""The recipe's ``grpo:`` section (``objective: grpo``): its keys, types and documentation. Generation, loss and
reward keys carry TRL's ``GRPOConfig`` names; ``reward_funcs`` names built-in rewards or the user's functions
(:mod:`hf_accum.recipe.rewards`); ``warm_start_steps`` is the recipe's own.

What the values mean is checked by :func:`hf_accum.recipe.grpo_section.check_grpo_section` (run by
:mod:`hf_accum.recipe.checks`); this file imports no component and no torch, like the rest of the config kit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class GRPOSection:
    """GRPO's settings (``objective: grpo``): the trainer engine passes the TRL-named keys to ``GRPOConfig`` and
    trains with :class:`hf_accum.AccumGRPOTrainer` (TRL's own generation; every update exact)."""

    reward_funcs: list[str] = field(default_factory=lambda: ["exact_match"])
    """Rewards, summed with ``reward_weights``: built-in ``exact_match`` (1 when the completion equals the reference
    answer, whitespace-normalised), ``word_accuracy`` (the fraction of the reference's words the completion holds in
    place, over the longer word count), ``format`` (1 when the completion matches ``format_pattern``), or a function of
    yours by import path ``package.module:function``, called as TRL calls reward functions:
    ``fn(prompts=..., completions=..., completion_ids=..., **kwargs) -> list[float]`` (kwargs: ``answer``, ``task``
    and TRL's own)."""
    reward_weights: list[float] | None = None
    """One weight per reward function (TRL's ``reward_weights``); null: all 1."""
    format_pattern: str = r"\S[^\n]*"
    """The built-in ``format`` reward's regular expression (Python ``re.fullmatch`` on the stripped completion)."""
    warm_start_steps: int = 0
    """SFT updates on the same data (the reference answers) before GRPO, so that a model that never answers right
    gets non-zero rewards; the held-out metric is scored after them too (the GRPO stage's before). 0: none."""
    warm_start_learning_rate: float | None = None
    """The warm start's peak learning rate (SFT takes a larger one than GRPO); null: ``training.learning_rate``."""
    warm_start_batch_size: int | None = None
    """Sequences per warm-start update (a multiple of ``training.per_device_train_batch_size`` x processes: the
    accumulation steps follow); null: ``global_batch_size`` (the GRPO update's completions)."""
    train_modules_to_save: bool = True
    """false: the modules trained in full (``lora.modules_to_save``, e.g. the embeddings and the LM head) keep their
    values during GRPO (those of the warm start, or of ``model.adapter``) and only the LoRA matrices train."""
    num_generations: int = 8
    """Completions sampled per prompt (a group); the update's completions must be a multiple of it."""
    max_completion_length: int = 16
    """Most tokens generated per completion (generation is the slow part on a CPU)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """Sampling settings of the generation (TRL's names; top_k 0: off)."""
    loss_type: str = "dapo"
    """grpo | dapo | dr_grpo | bnpo | luspo | cispo | sapo | vespo (TRL's); each exact over every update."""
    beta: float = 0.0
    """KL coefficient to the reference (the base model: the adapter disabled); 0: no reference model."""
    epsilon: float = 0.2
    """Lower clipping bound of the importance ratio (TRL's ``epsilon``)."""
    epsilon_high: float | None = None
    """Upper clipping bound (DAPO's clip-higher); null: ``epsilon``."""
    delta: float | None = None
    """Two-sided clipping's upper bound on the ratio of negative-advantage tokens; null: off."""
    scale_rewards: str = "group"
    """group | batch | none: the advantages' standard-deviation scaling."""
    importance_sampling_level: str = "token"
    """token | sequence (GSPO)."""
    num_iterations: int = 1
    """Optimization passes per generated batch (TRL's mu)."""
    steps_per_generation: int | None = None
    """Micro-batches per generation batch; null: ``gradient_accumulation_steps``."""
    mask_truncated_completions: bool = False
    """Completions cut by ``max_completion_length`` add no loss."""
    entropy_coef: float = 0.0
    """Entropy bonus (the update's mean per-token entropy); 0: off."""
    use_bias_correction_kl: bool = True
    """TRL's importance-sampling correction of the KL term (with ``beta`` > 0)."""
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    """``loss_type: sapo``: the soft gate's temperatures for positive / negative advantages."""
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    """``loss_type: vespo``: the gamma weighting's shape and rate for positive / negative advantages."""

    # The keys passed to TRL's GRPOConfig unchanged (the others are the recipe's own).
    RECIPE_KEYS: ClassVar[tuple[str, ...]] = ("reward_funcs", "format_pattern", "warm_start_steps",
                                             "warm_start_learning_rate", "warm_start_batch_size",
                                             "train_modules_to_save")
