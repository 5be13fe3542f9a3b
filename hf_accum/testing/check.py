"""``hf-accum check``: audit a few accumulated updates of a model, hf_accum's loop vs the naive loop.

Trains the built-in tiny Llama (or a user's local model directory) in float64 on uneven,
prompt-masked random rows, under :class:`hf_accum.verify.BigBatchAuditor`, and reports per update
how far the applied gradient is from the big-batch gradient.

Dropout is switched off (every ``*dropout*``/``*pdrop`` config field, before the model is built): the
reference cannot repeat a training forward's random masks. Any architecture, without its float32
islands: the whole run (training and reference) is inside
:func:`hf_accum.testing.float64.float64_arithmetic`, which turns every float32 request a model makes
(norms, rotary embeddings, attention and router softmax) into float64 -- a general mechanism, not a list
of classes. Chosen over "a control with the same arithmetic" because it measures the accumulation math
itself at ~1e-15, where the islands would leave a ~1e-7 floor to compare against. MoE models run with
eager experts (the grouped-mm kernel refuses float64), and when they return a router loss the reference
includes it as every hf_accum front-end defines it (``coef`` x the token-weighted mean of the update's
micro-batch router losses; ``output_router_logits`` is turned on where ``router_aux_loss_coef`` is set).

Outcomes: :class:`CheckReport` (PASS / FAIL), :class:`hf_accum.errors.InputError` for a ``--model``
that is not a readable model directory, :class:`ModelCannotRun` for one the check cannot train (not
a causal LM transformers can build, a loss term hf_accum does not know, a kernel that refuses float64).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from hf_accum.batching import PaddingCollator
from hf_accum.errors import InputError
from hf_accum.testing.data import random_rows
from hf_accum.testing.float64 import float64_arithmetic
from hf_accum.testing.models import PAD, VOCAB, tiny_causal_lm
from hf_accum.testing.scenarios import Scenario, run_exact, run_naive


class ModelCannotRun(Exception):
    """The model directory was read, but the check cannot run this model; the message says which and why."""


@dataclass
class CheckReport:
    model: str
    exact_errors: list[float]
    naive_errors: list[float]
    targets: list[int]
    tolerance: float
    router_loss: bool = False
    """The reference includes the model's MoE router loss."""

    @property
    def passed(self) -> bool:
        return bool(self.exact_errors) and max(self.exact_errors) <= self.tolerance

    def table(self) -> str:
        lines = [f"{'update':>6} {'targets':>8} {'hf_accum error':>15} {'naive loss/K error':>19}"]
        for i, (t, e, n) in enumerate(zip(self.targets, self.exact_errors, self.naive_errors), start=1):
            lines.append(f"{i:>6} {t:>8} {e:>15.2e} {n:>19.2e}")
        return "\n".join(lines)

    def verdict(self) -> str:
        worst = max(self.exact_errors)
        state = "PASS" if self.passed else "FAIL"
        router = ", router loss included" if self.router_loss else ""
        return (
            f"{state}: max relative gradient error {worst:.2e} (tolerance {self.tolerance:.0e}) vs naive "
            f"{max(self.naive_errors):.2e}, float64 without float32 islands{router}, model {self.model}"
        )


@dataclass(frozen=True)
class _CheckedModel:
    factory: Callable[[], torch.nn.Module]
    vocab_size: int
    pad_token_id: int
    router_loss: bool
    name: str


def check_model(
    model: str, micro_batch: int, accumulation: int, n_examples: int, tolerance: float = 1e-8, seed: int = 0
) -> CheckReport:
    """Audit a few updates of ``model`` ('tiny' or a local directory) in float64."""
    checked = _checked_model(model)
    examples = random_rows(
        n_examples, seed=seed, min_len=3, max_len=48, prompt_masking=True, vocab_size=checked.vocab_size,
        pad_token_id=checked.pad_token_id, lowest_id=0,
    )
    scenario = Scenario(
        f"check:{model}", checked.factory, examples, PaddingCollator(checked.pad_token_id), micro_batch=micro_batch,
        accumulation=accumulation, pad_token_id=checked.pad_token_id,
        router_loss="per_micro_batch" if checked.router_loss else "none",
    )
    try:
        with float64_arithmetic():
            result, exact = run_exact(scenario)
            naive = run_naive(scenario)
    except Exception as error:  # whatever stops the model is reported as exit 4
        raise ModelCannotRun(f"{checked.name}: {type(error).__name__}: {_first_line(error)}") from error
    return CheckReport(
        model=model,
        exact_errors=[r.relative_error for r in exact.records],
        naive_errors=[r.relative_error for r in naive.records],
        targets=[u.targets for u in result.updates],
        tolerance=tolerance,
        router_loss=checked.router_loss,
    )


def _checked_model(model: str) -> _CheckedModel:
    if model == "tiny":
        return _CheckedModel(tiny_causal_lm, VOCAB, PAD, False, "the built-in tiny Llama")
    if not os.path.isdir(model):
        raise InputError(
            f"--model {model!r}: not 'tiny' and not a directory (nothing is downloaded; pass a local model)"
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as error:
        raise InputError(f"--model {model!r}: not a loadable local model directory ({_first_line(error)})") from None
    name = f"{model} ({type(config).__name__})"
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ModelCannotRun(
            f"{name}: not a causal LM transformers can build (AutoModelForCausalLM has no class for it)"
        )

    _without_dropout(config)

    def load() -> torch.nn.Module:
        try:
            # Eager experts: MoE models' grouped-mm kernel refuses float64 (ignored by dense models).
            loaded = AutoModelForCausalLM.from_pretrained(
                model, config=config, dtype=torch.float64, local_files_only=True, experts_implementation="eager"
            )
        except ValueError as error:
            raise ModelCannotRun(f"{name}: not a causal LM transformers can build ({_first_line(error)})") from None
        for module in loaded.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        return loaded

    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    # MoE checkpoints ship with output_router_logits=False (inference); fine-tuning turns it on, so does the check.
    router_loss = hasattr(config, "output_router_logits") and coef != 0.0
    if router_loss:
        config.output_router_logits = True
    pad = config.pad_token_id if getattr(config, "pad_token_id", None) is not None else 0
    vocab_size = getattr(config, "vocab_size", None)
    if not vocab_size:
        raise ModelCannotRun(f"{name}: its config names no vocab_size (the check trains a text causal LM)")
    return _CheckedModel(load, int(vocab_size), int(pad), router_loss, name)


def _without_dropout(config) -> None:
    """Dropout off, by every config field that sets it (``*dropout*``, GPT-2's ``*_pdrop``), before the model
    is built: a training forward draws new masks that the big-batch reference cannot repeat. (Modules copy these
    values when built, e.g. ``attention_dropout``; ``nn.Dropout`` modules are zeroed after loading too.)"""
    for key, value in list(config.to_dict().items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and hasattr(config, key):
            setattr(config, key, 0.0)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
