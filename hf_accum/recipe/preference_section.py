"""The recipe's ``objective`` key and ``dpo:`` section (:class:`DPOSection`, its keys), checked before anything loads
(:func:`check_dpo_section`, the section's ``validator``): allowed values, and what ``objective: dpo`` cannot run
with (one line naming the key, exit 2). The DPO training itself is :mod:`hf_accum.recipe.preference`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_accum.errors import InputError
from hf_accum.losses.preference import PAIR_LOSS_TYPES
from hf_accum.recipe.data.formats import FORMATS, PREFERENCE_FORMATS

OBJECTIVES = ("sft", "dpo")
"""What the recipe trains: ``sft`` (the default) or ``dpo`` (preference pairs)."""


@dataclass
class DPOSection:
    """DPO's settings (``objective: dpo``), TRL's ``DPOConfig`` names: the trainer engine passes them to
    ``DPOConfig``, the loop engine to ``hf_accum.losses.preference.DPOPairLoss``."""

    beta: float = 0.1
    """How far the policy may move from the reference (the base model: the adapter disabled); TRL's ``beta``."""
    loss_type: str = "sigmoid"
    """The per-pair loss: sigmoid (DPO) | ipo | hinge | robust; TRL's ``loss_type``."""
    label_smoothing: float = 0.0
    """The probability that a pair's preference is flipped (cDPO / robust DPO), in [0, 0.5)."""
    sft_weight: float = 0.0
    """Weight of an SFT term on the chosen answers (a token mean over the update's chosen tokens) added to the
    pair loss; 0: none. TRL: ``loss_type=[<loss_type>, "sft"]``, ``loss_weights=[1, sft_weight]``."""


class PreferenceConfigError(InputError):
    """A value of ``objective`` / the ``dpo`` section, or a setting DPO cannot run with (exit 2)."""


# ----------------------------------------------------------------------------------------------
# The dpo section's check (its Section.validator)
# ----------------------------------------------------------------------------------------------


def check_dpo_section(dpo: DPOSection, config: Any) -> None:
    """``objective`` and the ``dpo`` section: allowed values, and what DPO cannot run with (one line, exit 2)."""
    if config.objective not in OBJECTIVES:
        raise PreferenceConfigError(f"objective={config.objective!r}; allowed: {', '.join(OBJECTIVES)}")
    if dpo.loss_type not in PAIR_LOSS_TYPES:
        whole = " (it depends on the whole batch: no accumulation reproduces it)" if "aot" in dpo.loss_type else ""
        raise PreferenceConfigError(f"dpo.loss_type={dpo.loss_type!r}{whole}; allowed: {', '.join(PAIR_LOSS_TYPES)} "
                                    "(an SFT term on the chosen answers: dpo.sft_weight)")
    if not dpo.beta > 0:
        raise PreferenceConfigError(f"dpo.beta={dpo.beta} must be > 0")
    if not 0 <= dpo.label_smoothing < 0.5:
        raise PreferenceConfigError(
            f"dpo.label_smoothing={dpo.label_smoothing} must be >= 0 and < 0.5 (a preference flip rate)")
    if dpo.sft_weight < 0:
        raise PreferenceConfigError(f"dpo.sft_weight={dpo.sft_weight} must be >= 0 (0: no SFT term)")
    if config.objective == "sft":
        _check_sft(dpo, config)
    else:
        _check_dpo_run(config)


def _check_sft(dpo: DPOSection, config: Any) -> None:
    if config.data.format in PREFERENCE_FORMATS:
        raise PreferenceConfigError(f"data.format={config.data.format} is preference data: it needs objective=dpo")
    if dpo != type(dpo)():  # any dpo key set
        config.notes.append("the dpo section is not used with objective=sft (set objective=dpo to train DPO)")


# What objective=dpo cannot run with yet: (is it set?, "key=value (why)").
def _dpo_refusals(config: Any) -> list[tuple[bool, str]]:
    t, acc = config.training, config.accumulation
    return [
        (config.data.format in FORMATS, f"data.format={config.data.format} (allowed with objective=dpo: auto, "
                                         f"{', '.join(PREFERENCE_FORMATS)})"),
        (config.data.packing, "data.packing=true (pairs are padded: chosen rows, then rejected rows)"),
        (acc.normalization != "token", f"accumulation.normalization={acc.normalization} (DPO's unit is the pair: "
                                       "leave it token)"),
        (acc.tokens_per_update is not None, "accumulation.tokens_per_update (token-budget windows count tokens, "
                                            "DPO's unit is the pair)"),
        (acc.rampup_batch_size is not None, "accumulation.rampup_batch_size (not built for pairs yet)"),
        (acc.noise_scale, "accumulation.noise_scale=true (not built for pairs yet)"),
        (bool(t.get("deepspeed")), "training.deepspeed (DPO in the recipe runs on one process or DDP; not tested "
                                   "under DeepSpeed yet)"),
        (bool(t.get("fsdp")), "training.fsdp (DPO in the recipe runs on one process or DDP; not tested under FSDP "
                              "yet)"),
    ]


def _check_dpo_run(config: Any) -> None:
    for refused, what in _dpo_refusals(config):
        if refused:
            raise PreferenceConfigError(f"objective=dpo cannot run with {what}")
