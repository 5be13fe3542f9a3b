"""``hf-accum check``: audit a few accumulated updates of a model, hf_accum's loop vs the naive loop.

Trains the built-in tiny Llama (or a user's local model directory) in float64 on uneven,
prompt-masked random rows, under :class:`hf_accum.verify.BigBatchAuditor`, and reports per update
how far the applied gradient is from the big-batch gradient. Causal LMs, encoder-decoders and image-text-to-text
models alike: :mod:`hf_accum.testing.check_kinds` says which class builds a checkpoint, how it is cut and what
synthetic rows (images included) it trains on.

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

**Bounded cost** (the default): a real model is checked on its first ``layers`` decoder layers (2): the same
config with ``num_hidden_layers`` (and every per-layer list, e.g. ``layer_types``) cut, the checkpoint's own
weights for those layers, embeddings and head (safetensors are read lazily, so the rest is never loaded), the
real vocabulary (random rows draw from all of it) and the real tokenizer's pad token. What accumulation can get
wrong is in the loss normalisation across micro-batches and the vocabulary-sized logits, not in the depth, so
the cut checks the same arithmetic at a cost independent of depth; ``layers=None`` (``--full``) runs the whole
model. In full fine-tuning the bounded check also freezes the embedding and output head: they still compute every
logit over the real vocabulary (the gradients it audits flow through them), but their own gradients, which at a
262144 vocabulary are 1.3 GB each in float64 and make up most of the memory, are not audited (``--full`` audits
them). Rows are shortened for large vocabularies so that one update's logits stay within 256 MiB. The
reference recomputes on the live weights themselves (no copy). :func:`estimate_cost` states the time and memory
before anything is loaded. Measured on one CPU thread (docs/real-models.md): SmolLM2-135M 1.19 GiB peak RSS and
15 s of CPU; Gemma 3 270M (vocabulary 262144) 2.76 GiB and 33 s.

**The user's settings** (:class:`hf_accum.testing.check_settings.FineTuneSettings`): LoRA adapters and the
quantized base values, as the user trains them; the check audits exactly the parameters they leave trainable.

Outcomes: :class:`CheckReport` (PASS / FAIL), :class:`hf_accum.errors.InputError` for a ``--model``
that is not a readable model directory, :class:`ModelCannotRun` for one the check cannot train (no causal LM,
seq2seq or image-text-to-text class transformers can build, a loss term hf_accum does not know, a kernel that
refuses float64).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from hf_accum.batching import PaddingCollator
from hf_accum.errors import InputError
from hf_accum.testing.check_kinds import (
    CAUSAL,
    CannotCut,
    CheckData,
    check_data,
    cut_model_layers,
    load_sliced_weights,
    model_kind,
    text_config,
)
from hf_accum.testing.check_settings import FineTuneSettings
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
    config: Any = None
    """The (cut) config the check builds, None for the built-in tiny model."""
    layers: str = "all layers"
    """What was kept, e.g. '2 of 30 layers'."""
    settings: FineTuneSettings = FineTuneSettings()
    freeze_vocabulary: bool = False
    """Bounded full fine-tuning: the embedding and output head take part, frozen (see the module docstring)."""
    kind: str = CAUSAL
    """causal LM, seq2seq or image-text-to-text (:mod:`hf_accum.testing.check_kinds`)."""
    model_class: Any = None
    """The transformers Auto class that builds it (None for the built-in tiny model)."""


DEFAULT_LAYERS = 2
MAX_ROW_LENGTH = 32
_LOGITS_BUDGET = 256 * 2**20
"""Bytes of one update's float64 logits the reference may hold (its big batch forwards at once): rows are shortened
for large vocabularies (Gemma 3's 262144: 16 tokens), never below 8."""


def check_model(
    model: str, micro_batch: int, accumulation: int, n_examples: int, tolerance: float = 1e-8, seed: int = 0,
    layers: int | None = DEFAULT_LAYERS, announce: Callable[[str], None] | None = None,
    settings: FineTuneSettings | None = None,
) -> CheckReport:
    """Audit a few updates of ``model`` ('tiny', a local directory or a GGUF model) in float64, on its first
    ``layers`` layers (None: all), trained as ``settings`` say (LoRA, quantization; default: full fine-tuning).
    ``announce`` receives the estimated cost before the model loads."""
    if layers is not None and layers < 1:
        raise InputError(f"--layers {layers}: must be >= 1 (or use --full for the whole model)")
    checked = _checked_model(model, layers, settings or FineTuneSettings())
    row_length = row_length_for(checked.vocab_size, micro_batch * accumulation)
    data = _check_data(checked, n_examples, seed, row_length)
    if announce is not None:
        announce(estimate_cost(checked, micro_batch, accumulation, n_examples, row_length,
                               data.tokens_per_row).describe(checked))
    scenario = data.scenario_class(
        f"check:{model}", checked.factory, data.examples, data.collator, micro_batch=micro_batch,
        accumulation=accumulation, pad_token_id=checked.pad_token_id,
        loss_kind=data.loss_kind,  # type: ignore[arg-type]  # None: inferred from the model, as a user's run does
        router_loss="per_micro_batch" if checked.router_loss else "none",
        optimizer="sgd",  # no optimizer state (2 x the parameters at real sizes); the gradients are what is audited
        share_weights=True,  # the reference recomputes on the live weights themselves: no second copy
    )
    try:
        with float64_arithmetic():
            pace = _FirstUpdatePace(accumulation, micro_batch, n_examples, announce)
            result, exact = run_exact(scenario, on_model=pace.watch)
            exact_errors, targets = [r.relative_error for r in exact.records], [u.targets for u in result.updates]
            del result, exact  # the first run's model and reference: freed before the second is built
            gc.collect()
            naive_errors = [r.relative_error for r in run_naive(scenario).records]
    except ModelCannotRun:
        raise
    except Exception as error:  # whatever stops the model is reported as exit 4
        raise ModelCannotRun(f"{checked.name}: {type(error).__name__}: {_first_line(error)}") from error
    return CheckReport(
        model=f"{model} ({checked.layers}, {checked.settings.describe()}{_frozen_note(checked)})",
        exact_errors=exact_errors, naive_errors=naive_errors, targets=targets, tolerance=tolerance,
        router_loss=checked.router_loss,
    )


class _FirstUpdatePace:
    """The estimate refined by measuring: when the first update of the exact run is done (its audit included),
    extrapolate the pace of its micro-batches after the first (the first carries one-time costs: the loop's probes,
    first calls) to both runs' rows -- the machine's load, which the upfront estimate cannot know, included.

    In micro-batch units ``c``: a micro-batch's forward and backward is ``c``, an update's audit (the big batch over
    the same rows) about ``K c``; the exact and the naive run each cost about ``2 c`` per micro-batch, ``4 c n / b``
    in all; between the second forward and the (K+1)-th lie ``(2K - 1) c``. Counts training forwards on the model,
    as the auditor does."""

    def __init__(self, accumulation: int, micro_batch: int, n_examples: int,
                 announce: Callable[[str], None] | None) -> None:
        self.accumulation, self.announce = accumulation, announce
        self.micro_batches = -(-n_examples // micro_batch)
        self.forwards, self.second = 0, 0.0

    def watch(self, model: torch.nn.Module) -> None:
        if self.announce is not None and self.accumulation >= 2:
            self._handle = model.register_forward_pre_hook(self._on_forward)

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        import time

        if not module.training:
            return
        self.forwards += 1
        if self.forwards == 2:
            self.second = time.perf_counter()
        elif self.forwards == self.accumulation + 1:  # the first update and its audit are done
            self._handle.remove()
            unit = (time.perf_counter() - self.second) / (2 * self.accumulation - 1)
            remaining = unit * max(0, 4 * self.micro_batches - 2 * self.accumulation)
            assert self.announce is not None  # watch() hooks only with one
            self.announce(f"first update done: {unit:.1f} s per micro-batch; at this pace the check ends in about "
                          f"{remaining:.0f} s more")


def _check_data(checked: _CheckedModel, n_examples: int, seed: int, row_length: int) -> CheckData:
    """The synthetic rows of the model's kind (the built-in tiny Llama: plain prompt-masked rows)."""
    if checked.config is None:
        rows = random_rows(n_examples, seed=seed, min_len=3, max_len=row_length, prompt_masking=True,
                           vocab_size=checked.vocab_size, pad_token_id=checked.pad_token_id, lowest_id=0)
        return CheckData(rows, PaddingCollator(checked.pad_token_id), Scenario, (row_length + 3) / 2)
    try:
        return check_data(checked.kind, checked.config, checked.model_class, n_examples, seed, row_length,
                          checked.vocab_size, checked.pad_token_id)
    except ValueError as error:  # a vision tower the check cannot size an image for
        raise ModelCannotRun(str(error)) from None


def row_length_for(vocab_size: int, rows_per_update: int) -> int:
    """The longest synthetic row: :data:`MAX_ROW_LENGTH`, shortened so that one update's float64 logits stay
    within :data:`_LOGITS_BUDGET` (at least 8 tokens: rows of uneven length remain)."""
    return max(8, min(MAX_ROW_LENGTH, _LOGITS_BUDGET // (rows_per_update * vocab_size * 8)))


def _frozen_note(checked: _CheckedModel) -> str:
    return ", embedding and head frozen" if checked.freeze_vocabulary else ""


def _checked_model(model: str, layers: int | None = None,
                   settings: FineTuneSettings = FineTuneSettings()) -> _CheckedModel:
    if model == "tiny":  # already 2 layers: --layers does not apply

        def tiny() -> torch.nn.Module:
            return _as_trained(tiny_causal_lm(), settings, freeze_vocabulary=False)

        return _CheckedModel(tiny, VOCAB, PAD, False, "the built-in tiny Llama", settings=settings)
    model, config = _local_config(model)
    name = f"{model} ({type(config).__name__})"
    found = model_kind(config)
    if found is None:
        raise ModelCannotRun(
            f"{name}: not a model the check can train (no class for it in AutoModelForCausalLM, "
            "AutoModelForSeq2SeqLM or AutoModelForImageTextToText)"
        )
    kind, model_class = found
    _without_dropout(config)
    total_layers = getattr(text_config(config), "num_hidden_layers", None)
    try:
        kept = cut_model_layers(config, kind, layers, name) if layers is not None else "all layers"
    except CannotCut as error:
        raise ModelCannotRun(str(error)) from None
    # Bounded and full fine-tuning: the vocabulary-sized matrices (a 262144 x 640 embedding is 1.3 GB in
    # float64, and its gradient twice more) run in every forward but are not audited; --full audits them.
    freeze_vocabulary = layers is not None and settings.full_fine_tuning
    load = _loader((model, config, name), found, int(total_layers or 0), settings, freeze_vocabulary)
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    # MoE checkpoints ship with output_router_logits=False (inference); fine-tuning turns it on, so does the check.
    # (Causal LMs only: the seq2seq and VLM references are the model's own loss, router term included.)
    router_loss = kind == CAUSAL and hasattr(config, "output_router_logits") and coef != 0.0
    if router_loss:
        config.output_router_logits = True
    vocab_size = getattr(text_config(config), "vocab_size", None)
    if not vocab_size:
        raise ModelCannotRun(f"{name}: its config names no vocab_size (the check trains a language model)")
    pad = _pad_token_id(model, config, int(vocab_size))
    return _CheckedModel(load, int(vocab_size), int(pad), router_loss, name, config, kept, settings, freeze_vocabulary,
                         kind, model_class)


def _local_config(model: str) -> tuple[str, Any]:
    """``(directory, config)`` of a ``--model`` that is not 'tiny': a local directory (a GGUF converted to one)."""
    model = _gguf_as_directory(model)
    if not os.path.isdir(model):
        raise InputError(
            f"--model {model!r}: not 'tiny' and not a directory (nothing is downloaded; pass a local model)"
        )
    from transformers import AutoConfig

    try:
        return model, AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as error:
        raise InputError(f"--model {model!r}: not a loadable local model directory ({_first_line(error)})") from None


def _loader(source: tuple[str, Any, str], found: tuple[str, Any], total_layers: int, settings: FineTuneSettings,
            freeze_vocabulary: bool) -> Callable[[], torch.nn.Module]:
    """What loads the checked model in float64 as it trains: ``source`` is its ``(directory, config, name)``,
    ``found`` its ``(kind, model class)`` and ``total_layers`` the layer count of its weights file."""
    model, config, name = source
    kind, model_class = found

    def load() -> torch.nn.Module:
        try:
            # Eager experts: MoE models' grouped-mm kernel refuses float64 (ignored by dense models).
            with _quiet_unused_weights():  # the cut layers' weights, left in the file on purpose
                # ignore_mismatched_sizes: a weight sized by the layer count (Gemma 4's per-layer embedding) is
                # given its kept layers' slice below, never left at its random initialisation.
                loaded, info = model_class.from_pretrained(
                    model, config=config, dtype=torch.float64, local_files_only=True, experts_implementation="eager",
                    ignore_mismatched_sizes=True, output_loading_info=True,
                )
            if info.get("mismatched_keys"):
                load_sliced_weights(loaded, model, info["mismatched_keys"], text_config(config).num_hidden_layers,
                                    total_layers, name)
        except ValueError as error:
            raise ModelCannotRun(f"{name}: not a {kind} transformers can build ({_first_line(error)})") from None
        except CannotCut as error:
            raise ModelCannotRun(str(error)) from None
        return _as_trained(loaded, settings, freeze_vocabulary)

    return load


def _as_trained(model: torch.nn.Module, settings: FineTuneSettings, freeze_vocabulary: bool) -> torch.nn.Module:
    """The loaded float64 model as the check trains it: vocabulary matrices frozen (bounded full fine-tuning),
    the user's quantization and LoRA applied, every dropout module off."""
    if freeze_vocabulary:
        for matrix in vocabulary_matrices(model):
            matrix.requires_grad_(False)
    model = settings.apply(model)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def vocabulary_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The input embedding's and the output head's weights (one when tied)."""
    found: dict[int, torch.nn.Parameter] = {}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):  # type: ignore[operator]
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            found[id(weight)] = weight
    return list(found.values())


def _gguf_as_directory(model: str) -> str:
    """A GGUF model (``.gguf`` file, ``pypi:`` package) -> its converted plain directory (cached, by sha256)."""
    from hf_accum.gguf import converted_dir, gguf_source, names_gguf

    if not names_gguf(model):
        return model
    source = gguf_source(model)
    assert source is not None  # names_gguf(model) above
    return converted_dir(source)


def _pad_token_id(model: str, config: Any, vocab_size: int) -> int:
    """The real tokenizer's pad token (else its eos), when the directory has a tokenizer; else the config's."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    text = text_config(config)
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                      getattr(config, "pad_token_id", None), getattr(text, "pad_token_id", None)):
        if isinstance(candidate, int) and 0 <= candidate < vocab_size:
            return candidate
    return 0


@contextlib.contextmanager
def _quiet_unused_weights() -> Iterator[None]:
    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class CheckCost:
    parameters: int
    trainable: int
    peak_bytes: int
    seconds: float

    def describe(self, checked: _CheckedModel) -> str:
        return (f"checking {checked.name}, {checked.layers}, {checked.settings.describe()}{_frozen_note(checked)}: "
                f"{self.parameters / 1e6:.3g}M parameters in float64, {self.trainable / 1e6:.3g}M audited; "
                f"estimated peak ~{self.peak_bytes / 2**30:.1f} GiB, ~{self.seconds:.0f} s of CPU"
                f"{'' if checked.layers == 'all layers' else ' (every layer and parameter: --full)'}")


# Memory calibrated on SmolLM2-135M (measured 1.19 GiB) and Gemma 3 270M (2.76 GiB) cut to 2 layers. Time calibrated
# (2026-11-28, CPU time from the estimate line to the end, the GGUF conversion before it not counted) on SmolLM2-135M
# cut to 2 layers (25 s measured) and a 2-layer model of Qwen2.5-0.5B's shape (vocabulary 151936, 67 s measured):
# the effective rate is a fixed share of this machine's measured one-core float64 GEMM rate (45.8 GFLOP/s there).
_BASELINE_BYTES = 600 * 2**20  # Python, torch, transformers, accelerate, peft
_GEMM_SHARE = 0.28  # effective / peak GEMM rate: small float64 GEMMs, softmax, the frozen head's cheaper backward
_FLOPS_PER_SECOND = 1.3e10  # the same share of the calibration machine's rate: where no rate can be measured
_FIXED_SECONDS = 10.0  # reading the checkpoint, building the model twice, the first-micro-batch probes


def estimate_cost(checked: _CheckedModel, micro_batch: int, accumulation: int, n_examples: int,
                  row_length: int = MAX_ROW_LENGTH, tokens_per_row: float | None = None) -> CheckCost:
    """Rough time and memory of a check, from the parameter counts (on the meta device) and one update's logits.

    Memory: every parameter once in float64 (the reference shares them), plus three float64 copies of the
    audited ones (the accumulated gradient, the reference's, a transient while comparing), the largest matrix as
    read from a float32 checkpoint, and two logits-sized tensors of the reference's big batch. Time: two runs
    (exact, naive), each a forward and backward per token for training and again for the reference: 4 x 6 flops
    per parameter per token, at an effective rate measured here."""
    parameters, trainable, largest = _parameter_counts(checked)
    per_row = (row_length + 3) / 2 if tokens_per_row is None else tokens_per_row  # mean of uneven rows
    update_tokens = micro_batch * accumulation * max(row_length, per_row)
    peak = (8 * parameters + 3 * 8 * trainable + 4 * largest + 2 * update_tokens * checked.vocab_size * 8
            + _BASELINE_BYTES)
    tokens = n_examples * per_row
    seconds = _FIXED_SECONDS + 4 * 6 * parameters * tokens / _effective_flops()
    return CheckCost(parameters, trainable, int(peak), seconds)


def _effective_flops() -> float:
    """The check's effective float64 FLOP/s on this machine: :data:`_GEMM_SHARE` of one core's measured float64
    GEMM rate (:func:`hf_accum.measure.peak_flops.core_gemm_rate`, cached per machine), so the estimate follows the CPU
    it runs on; :data:`_FLOPS_PER_SECOND` where the suite pins the peak (``HF_ACCUM_PEAK_FLOPS``: no probe) or the
    rate cannot be had (an estimate never stops a check)."""
    if os.environ.get("HF_ACCUM_PEAK_FLOPS"):
        return _FLOPS_PER_SECOND
    try:
        from hf_accum.measure.peak_flops import core_gemm_rate

        return _GEMM_SHARE * core_gemm_rate(torch.float64).flops
    except Exception:  # noqa: BLE001 -- a side number: the constant instead
        return _FLOPS_PER_SECOND


def _parameter_counts(checked: _CheckedModel) -> tuple[int, int, int]:
    """(all parameters, the audited ones, the largest matrix) of the model as checked, counted without weights."""
    if checked.config is None:
        model = checked.factory()
    else:
        with torch.device("meta"):
            model = checked.model_class.from_config(checked.config)
            if checked.freeze_vocabulary:
                for matrix in vocabulary_matrices(model):
                    matrix.requires_grad_(False)
            # Quantization changes values, not counts: only LoRA is applied here.
            model = FineTuneSettings(lora=checked.settings.lora).apply(model)
    counts = [(p.numel(), p.requires_grad) for p in model.parameters()]
    return sum(n for n, _ in counts), sum(n for n, grad in counts if grad), max(n for n, _ in counts)


def _without_dropout(config: Any) -> None:
    """Dropout off, by every config field that sets it (``*dropout*``, GPT-2's ``*_pdrop``), before the model
    is built: a training forward draws new masks that the big-batch reference cannot repeat. (Modules copy these
    values when built, e.g. ``attention_dropout``; ``nn.Dropout`` modules are zeroed after loading too.)"""
    for key, value in list(config.to_dict().items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and hasattr(config, key):
            setattr(config, key, 0.0)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
