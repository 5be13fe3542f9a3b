"""The kinds of model ``hf-accum check`` trains, and what it feeds each: causal LMs, encoder-decoders
(``AutoModelForSeq2SeqLM``: T5, BART, ...) and image-text-to-text models (``AutoModelForImageTextToText``: LLaVA,
Qwen2-VL, Gemma 3, ...).

This module owns, per kind:

* **which class builds it** (:func:`model_kind`): an encoder-decoder config goes to the seq2seq class, a config
  with a vision tower to the image-text-to-text class (so that its images are trained too), everything else
  to the causal LM class;
* **the bounded-cost cut** (:func:`cut_model_layers`): the first ``layers`` layers of every stack the model has
  -- the decoder of a causal LM, encoder and decoder of a seq2seq model, the language model *and* the vision
  tower of a VLM -- with every per-layer list cut alike;
* **synthetic data of the model's own shapes** (:func:`check_data`): source/target rows for a seq2seq model;
  for a VLM one random image per row, sized from ``config.vision_config`` (``image_size`` square images for
  CLIP/SigLIP towers; Qwen2-VL's flattened patches with their ``image_grid_thw``), preceded by as many image
  tokens as the model turns the image into, with ``mm_token_type_ids`` / ``token_type_ids`` where its forward
  takes them, as its processor gives them;
* **the big-batch reference** of the kinds whose batches the causal reference cannot join (non-token tensors
  such as ``pixel_values``; targets padded apart from sources): the model's *own* ``labels=`` loss on the
  update's micro-batches joined into one batch (:class:`ImageTextAuditor`, and
  :class:`hf_accum.testing.seq2seq.Seq2SeqAuditor`), independent of hf_accum's loss code.
"""

from __future__ import annotations

import glob
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from hf_accum.batching import PaddingCollator
from hf_accum.testing.data import random_rows
from hf_accum.testing.scenarios import Scenario
from hf_accum.testing.seq2seq import Seq2SeqAuditor, Seq2SeqCollator
from hf_accum.verify import BigBatchAuditor

CAUSAL, SEQ2SEQ, IMAGE_TEXT = "causal LM", "seq2seq", "image-text-to-text"


class CannotCut(Exception):
    """The config names no layer count to cut (the message says so); the check runs the whole model instead."""


def model_kind(config: Any) -> tuple[str, Any] | None:
    """(kind, the transformers Auto class that builds it) for ``config``, or None when no kind fits."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

    if getattr(config, "is_encoder_decoder", False) and type(config) in AutoModelForSeq2SeqLM._model_mapping:
        return SEQ2SEQ, AutoModelForSeq2SeqLM
    vision = getattr(config, "vision_config", None) is not None
    if vision and type(config) in AutoModelForImageTextToText._model_mapping:
        return IMAGE_TEXT, AutoModelForImageTextToText
    if type(config) in AutoModelForCausalLM._model_mapping:
        return CAUSAL, AutoModelForCausalLM
    return None


def text_config(config: Any) -> Any:
    """The config holding the vocabulary and the language model's layers (the config itself for text models)."""
    return config.get_text_config(decoder=True)


# -- the cut --------------------------------------------------------------------------------------

_DECODER_COUNTS = ("num_hidden_layers",)
_SEQ2SEQ_COUNTS = {"encoder": ("num_layers", "encoder_layers"), "decoder": ("num_decoder_layers", "decoder_layers")}
_VISION_COUNTS = ("num_hidden_layers", "depth")


def cut_model_layers(config: Any, kind: str, layers: int, name: str) -> str:
    """Keep the first ``layers`` layers of every stack of ``config`` (in place). Returns what was kept: '2 of 30
    layers' (causal LM), 'encoder 2 of 12, decoder 2 of 12 layers', 'text 2 of 32, vision 2 of 24 layers'."""
    if kind == CAUSAL:
        return cut_layers(config, layers, name)
    if kind == SEQ2SEQ:
        parts = [f"{stack} {_cut_count(config, keys, layers, name, stack)}" for stack, keys in _SEQ2SEQ_COUNTS.items()]
        return ", ".join(parts) + " layers"
    text = cut_layers(text_config(config), layers, name).removesuffix(" layers")
    vision = _cut_count(config.vision_config, _VISION_COUNTS, layers, name, "vision tower")
    return f"text {text}, vision {vision} layers"


def cut_layers(config: Any, layers: int, name: str = "the model") -> str:
    """Keep the first ``layers`` decoder layers of ``config`` (in place): ``num_hidden_layers`` and every
    per-layer list (``layer_types`` and the like: a list as long as the layer count). More layers than the
    model has: the whole model. Returns what was kept, e.g. '2 of 30 layers'."""
    total = getattr(config, "num_hidden_layers", None)
    if not isinstance(total, int) or total < 1:
        raise CannotCut(f"{name}: its config names no num_hidden_layers to cut; run the whole model with --full")
    kept = min(layers, total)
    if kept < total:
        for key, value in list(config.to_dict().items()):
            if isinstance(value, list) and len(value) == total and hasattr(config, key):
                setattr(config, key, value[:kept])
        config.num_hidden_layers = kept
    return f"{kept} of {total} layers"


def load_sliced_weights(model: torch.nn.Module, model_dir: str, mismatched: Any, kept: int, total: int,
                        name: str) -> None:
    """Give the weights whose size depends on the layer count (Gemma 4's per-layer input embedding and projection:
    ``num_hidden_layers x hidden_size_per_layer_input`` wide, layer-major) the checkpoint's values for the kept
    layers: the leading ``kept / total`` of the one dimension that differs, read lazily from the safetensors.
    ``mismatched``: transformers' ``(key, checkpoint shape, model shape)`` of each weight it could not load."""
    from safetensors import safe_open

    wanted = {key: (tuple(ckpt), tuple(cut)) for key, ckpt, cut in mismatched}
    parameters = dict(model.named_parameters())
    for key, (ckpt, cut) in wanted.items():
        differing = [d for d, (a, b) in enumerate(zip(ckpt, cut)) if a != b]
        if len(ckpt) != len(cut) or len(differing) != 1 or cut[differing[0]] * total != ckpt[differing[0]] * kept \
                or key not in parameters:
            raise CannotCut(f"{name}: {key} is {list(ckpt)} in the checkpoint but {list(cut)} cut to {kept} of "
                            f"{total} layers, not a per-layer slice; run the whole model with --full")
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as handle:
            for key in set(wanted) & set(handle.keys()):
                cut = wanted.pop(key)[1]
                # Outside float64_arithmetic: safetensors builds the stored float32 tensor from its bytes.
                with torch._C.DisableTorchFunction():
                    stored = handle.get_slice(key)[tuple(slice(0, size) for size in cut)]
                with torch.no_grad():
                    parameters[key].copy_(stored)
    if wanted:
        raise CannotCut(f"{name}: {', '.join(sorted(wanted))} not found by name in the safetensors of {model_dir}; "
                        "run the whole model with --full")


def _cut_count(config: Any, keys: Sequence[str], layers: int, name: str, stack: str) -> str:
    """Cut the first of ``keys`` that ``config`` stores (its own field, not an alias) to ``layers``."""
    stored = config.to_dict()
    for key in keys:
        total = stored.get(key)
        if isinstance(total, int) and total >= 1:
            kept = min(layers, total)
            setattr(config, key, kept)
            return f"{kept} of {total}"
    raise CannotCut(f"{name}: its {stack} names none of {', '.join(keys)} to cut; run the whole model with --full")


# -- synthetic data -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckData:
    """What one check trains on: rows, their collator, and the scenario class whose auditor joins them."""

    examples: list[dict[str, Any]]
    collator: Callable[[Sequence[dict[str, Any]]], dict[str, torch.Tensor]]
    scenario_class: type[Scenario]
    tokens_per_row: float
    """Mean tokens per row (image tokens, source and target included): for the cost estimate."""
    loss_kind: str | None = "causal_lm"
    """The target layout hf_accum trains with; None: inferred from the model, as a user's run does (seq2seq)."""


def check_data(kind: str, config: Any, model_class: Any, n_examples: int, seed: int, row_length: int,
               vocab_size: int, pad_token_id: int) -> CheckData:
    """Rows of uneven length drawn from the whole vocabulary (the model's special and multimodal token ids left
    out where they would change what a row means), for a model of ``kind``."""
    if kind == SEQ2SEQ:
        return _seq2seq_data(config, n_examples, seed, row_length, vocab_size, pad_token_id)
    rows = random_rows(n_examples, seed=seed, min_len=3, max_len=row_length, prompt_masking=True,
                       vocab_size=vocab_size, pad_token_id=pad_token_id, lowest_id=0)
    if kind == CAUSAL:
        return CheckData(rows, PaddingCollator(pad_token_id), Scenario, (row_length + 3) / 2)
    return _image_text_data(config, model_class, rows, seed, vocab_size, pad_token_id, row_length)


def _special_ids(config: Any) -> set[int]:
    """Every id a config names as a token (``*_token_id``, ``*_token_index``), top level and text config."""
    found: set[int] = set()
    for source in (config, text_config(config)):
        for key, value in source.to_dict().items():
            if key.endswith(("token_id", "token_index", "token_ids")):
                found.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return found


def _without(ids: list[int], excluded: set[int], vocab_size: int) -> list[int]:
    """``ids`` with every excluded id replaced by the smallest id that is not excluded."""
    stand_in = next(i for i in range(vocab_size) if i not in excluded)
    return [stand_in if i in excluded else i for i in ids]


@dataclass
class Seq2SeqCheckScenario(Scenario):
    """Audited by the encoder-decoder's own ``labels=`` loss on the joined batch, on the live weights."""

    def auditor(self) -> BigBatchAuditor:
        return Seq2SeqAuditor(pad_token_id=self.pad_token_id, share_weights=True)


def _seq2seq_data(config: Any, n: int, seed: int, row_length: int, vocab_size: int, pad: int) -> CheckData:
    excluded = _special_ids(config) | {pad}
    sources = random_rows(n, seed=seed, min_len=2, max_len=row_length, vocab_size=vocab_size, pad_token_id=pad,
                          lowest_id=0)
    targets = random_rows(n, seed=seed + 1, min_len=2, max_len=row_length, vocab_size=vocab_size,
                          pad_token_id=pad, lowest_id=0)
    rows = [{"input_ids": _without(s["input_ids"], excluded, vocab_size),
             "labels": _without(t["input_ids"], excluded, vocab_size)} for s, t in zip(sources, targets)]

    mean_tokens = sum(len(r["input_ids"]) + len(r["labels"]) for r in rows) / max(1, len(rows))
    return CheckData(rows, Seq2SeqCollator(pad), Seq2SeqCheckScenario, mean_tokens, loss_kind=None)


@dataclass(frozen=True)
class SyntheticImage:
    """One image as the model's processor would give it: ``pixel_values`` of one image, its ``image_grid_thw``
    (Qwen2-VL-like towers; None otherwise) and how many image tokens stand for it in ``input_ids``."""

    shape: tuple[int, ...]
    tokens: int
    grid_thw: tuple[int, int, int] | None = None


def synthetic_image(config: Any, name: str) -> SyntheticImage:
    """The smallest image ``config``'s vision tower takes: square ``image_size`` images (CLIP, SigLIP) or, for
    towers that merge patches (Qwen2-VL), a grid of 2 x merge patches a side."""
    vision = config.vision_config
    channels = int(getattr(vision, "in_channels", None) or getattr(vision, "num_channels", None) or 3)
    merge = getattr(vision, "spatial_merge_size", None)
    if merge is not None and getattr(vision, "temporal_patch_size", None) is not None:
        side, temporal, pixels = 2 * int(merge), int(vision.temporal_patch_size), int(vision.patch_size)
        return SyntheticImage((side * side, channels * temporal * pixels * pixels), side * side // int(merge) ** 2,
                              (1, side, side))
    size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    if not isinstance(size, int) or not isinstance(patch, int):
        raise ValueError(f"{name}: its vision_config has no image_size/patch_size (nor Qwen2-VL's merged "
                         "patches): the check cannot size a synthetic image for it")
    tokens = getattr(config, "mm_tokens_per_image", None)
    if not isinstance(tokens, int):  # LLaVA-like: a token per patch, the CLS token kept only by "full"
        full = getattr(config, "vision_feature_select_strategy", "default") == "full"
        tokens = (size // patch) ** 2 + int(full)
    return SyntheticImage((channels, size, size), tokens)


def _image_token_id(config: Any, name: str) -> int:
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{name}: its config names no image_token_id: the check cannot place an image in a row")


def _image_text_data(config: Any, model_class: Any, rows: list[dict[str, Any]], seed: int, vocab_size: int,
                     pad: int, row_length: int) -> CheckData:
    name = type(config).__name__
    image, image_token = synthetic_image(config, name), _image_token_id(config, name)
    excluded = (_special_ids(config) | {image_token}) - {pad}
    generator = torch.Generator().manual_seed(seed + 1)
    examples = []
    for row in rows:
        example: dict[str, Any] = {
            "input_ids": [image_token] * image.tokens + _without(row["input_ids"], excluded, vocab_size),
            "prompt_length": image.tokens + int(row["prompt_length"]),
            "pixel_values": torch.randn(*image.shape, generator=generator, dtype=torch.float64),
        }
        if image.grid_thw is not None:
            example["image_grid_thw"] = torch.tensor(image.grid_thw)
        examples.append(example)
    accepted = _forward_parameters(config, model_class)
    type_keys = tuple(k for k in ("mm_token_type_ids", "token_type_ids") if k in accepted)
    collator = ImageTextCollator(pad, image_token=image_token, type_keys=type_keys)
    return CheckData(examples, collator, ImageTextScenario, image.tokens + (row_length + 3) / 2)


def _forward_parameters(config: Any, model_class: Any) -> set[str]:
    model_type = model_class._model_mapping[type(config)]
    return set(inspect.signature(model_type.forward).parameters)


class ImageTextCollator(PaddingCollator):
    """:class:`~hf_accum.batching.PaddingCollator` plus the rows' images: ``pixel_values`` concatenated along
    their first dimension (stacked images; Qwen2-VL's flattened patches of every image), ``image_grid_thw`` stacked,
    and ``type_keys`` (``mm_token_type_ids``, Gemma 3's ``token_type_ids``: 1 at image tokens) as processors give."""

    def __init__(self, pad_token_id: int, image_token: int, type_keys: tuple[str, ...] = ()) -> None:
        super().__init__(pad_token_id)
        self.image_token, self.type_keys = image_token, type_keys

    def __call__(self, examples: Any) -> dict[str, torch.Tensor]:
        batch = super().__call__(examples)
        stacked = "image_grid_thw" not in examples[0]  # square images: one [C, H, W] per row
        pixels = [example["pixel_values"] for example in examples]
        batch["pixel_values"] = torch.stack(pixels) if stacked else torch.cat(pixels)
        if not stacked:
            batch["image_grid_thw"] = torch.stack([example["image_grid_thw"] for example in examples])
        for key in self.type_keys:
            batch[key] = batch["input_ids"].eq(self.image_token).long()
        return batch


def join_image_text_batches(micro_batches: list[dict[str, torch.Tensor]], pad_token_id: int
                            ) -> dict[str, torch.Tensor]:
    """One batch of all rows: per-token tensors right-padded to the longest row (labels -100, ``input_ids`` the
    pad id, masks and type ids 0), per-image tensors (``pixel_values``, ``image_grid_thw``) concatenated."""
    length = max(batch["input_ids"].shape[1] for batch in micro_batches)
    joined = {}
    for key in micro_batches[0]:
        tensors = [batch[key] for batch in micro_batches]
        per_token = all(t.dim() == 2 and t.shape == b["input_ids"].shape for t, b in zip(tensors, micro_batches))
        if per_token:
            fill = -100 if key == "labels" else pad_token_id if key == "input_ids" else 0
            tensors = [F.pad(t, (0, length - t.shape[1]), value=fill) for t in tensors]
        joined[key] = torch.cat(tensors)
    return joined


class ImageTextAuditor(BigBatchAuditor):
    """:class:`~hf_accum.verify.BigBatchAuditor` whose reference is the VLM's own loss: at each update,
    ``model(**joined_batch).loss`` with the labels (its mean over every target of the update's micro-batches) and
    its gradient, on the live weights (``share_weights``)."""

    def reference_gradient(self, micro_batches: list[dict]) -> tuple[dict[str, torch.Tensor], int, float]:
        reference = self._reference
        device = next(reference.parameters()).device
        big = {k: v.to(device) for k, v in join_image_text_batches(micro_batches, self.pad_token_id).items()}
        targets = int(big["labels"][:, 1:].ne(-100).sum())  # next-token targets, as the model's own loss counts
        trainable = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
        if targets == 0:
            return {n: torch.zeros_like(p) for n, p in trainable}, 0, float("nan")
        loss = reference(**big, use_cache=False).loss
        values = torch.autograd.grad(loss, [p for _, p in trainable], allow_unused=True)
        grads = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(trainable, values)}
        return grads, targets, float(loss.detach())


@dataclass
class ImageTextScenario(Scenario):
    """A :class:`~hf_accum.testing.scenarios.Scenario` audited by :class:`ImageTextAuditor`."""

    def auditor(self) -> BigBatchAuditor:
        return ImageTextAuditor(pad_token_id=self.pad_token_id, share_weights=True)
