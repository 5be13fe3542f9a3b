"""The recipe's own sections, their keys, types and documentation (attribute docstrings): ``model``, ``data``,
``accumulation``, ``dpo``, and the typed ``training`` section (``TrainingArguments`` fields).

What the values *mean* is checked by the module that owns the meaning, which imports its section from here (never
the reverse: this kit imports no component, and no torch): :mod:`hf_accum.recipe.modeling`,
:mod:`hf_accum.recipe.data`, :mod:`hf_accum.recipe.accumulation_section`, :mod:`hf_accum.recipe.preference_section`;
:mod:`hf_accum.recipe.checks` runs those checks."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hf_accum.settings import AccumulationSettings


@dataclass
class ModelSection:
    name_or_path: str = "hf_accum:tiny-llama"
    """Hub id or local path of a causal LM; ``hf_accum:tiny-llama`` is the embedded default."""
    dtype: str = "float32"
    """Weights dtype: float32 | bfloat16 | float16 | auto."""
    adapter_dtype: str = "float32"
    """LoRA adapters' dtype: float32 (the default: float32 adapters, what AdamW steps and what is saved, so small
    updates do not round away; on a bfloat16 model they compute in bf16, their weights cast instead of the
    activations, as mixed precision does) | float32-compute (PEFT's upcast: every adapted layer's activations cast
    to float32 and back, forward and backward; slower) | weights (the weights' dtype: bf16 adapters; updates below
    ~1/256 of a weight round away) | auto (weights for bfloat16 weights on CPU, float32 elsewhere)."""
    attn_implementation: str | None = None
    """e.g. sdpa, eager, flash_attention_2 (None: transformers' default)."""
    tokenizer: str | None = None
    """Hub id or local path of the tokenizer, when ``name_or_path`` has none (None: the model's own)."""
    chat_template: str | None = None
    """Jinja chat template when the tokenizer has none (or to replace it)."""
    trust_remote_code: bool = False
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """LlamaConfig fields for the embedded tiny model (e.g. num_hidden_layers: 4)."""
    gguf_file: str | None = None
    """The ``.gguf`` file inside the ``name_or_path`` directory (dequantized on load; a ``.gguf`` path or a packaged
    ``pypi:`` model as ``name_or_path`` needs none)."""
    adapter: str | None = None
    """Start from a previous run's LoRA adapter (trained further) instead of a fresh one: that run's output directory
    or an adapter directory. It must be of this ``name_or_path`` (the embedded model: the same training.seed and
    config_overrides); the lora section takes its settings from the adapter (docs/recipe.md "From SFT to RL")."""
    IDENTITY: ClassVar[str] = "name_or_path"
    TIED: ClassVar[tuple[str, ...]] = ("tokenizer", "config_overrides", "gguf_file", "adapter")
    """Keys of one model: a higher layer's new ``IDENTITY`` value drops the lower layers' (named in a note)."""


@dataclass
class DataSection:
    """The data of a run (:func:`hf_accum.recipe.data.load_tokenizer_and_data` reads it). These defaults are
    the ones for the user's own data; the embedded dataset's settings come with it."""

    dataset: str = "hf_accum:synthetic-tasks"
    """A .jsonl/.json/.parquet/.csv file, a ``datasets`` name, or ``hf_accum:synthetic-tasks``."""
    dataset_config: str | None = None
    """``datasets`` config name of a hub dataset (e.g. ``main`` for gsm8k)."""
    format: str = "auto"
    """auto (detected from the columns) | chat | prompt_completion | alpaca | text."""
    train_split: str = "train"
    """Split or slice to train on (``train``, ``train[:90%]``); a local file is one split, ``train``."""
    eval_split: str | None = None
    """Held-out split or slice (``test``, ``train[90%:]``) or a second local file. None: hold out
    ``eval_fraction`` of the training rows. Never overlaps the rows trained on."""
    eval_fraction: float = 0.05
    """Share of the training rows held out when ``eval_split`` is None (at most ``max_eval_examples``
    rows, drawn with ``seed``); 0: no held-out rows."""
    messages_column: str | None = None
    """Column names, None for the format's usual ones: chat ``messages``; prompt_completion ``prompt``
    + ``completion``/``answer``; alpaca ``instruction`` + ``output`` (+ ``input``); text ``text``."""
    prompt_column: str | None = None
    answer_column: str | None = None
    input_column: str | None = None
    """Context joined into the user message after the prompt (alpaca's ``input``)."""
    text_column: str | None = None
    system_prompt: str | None = None
    """System message added to conversations that have none."""
    max_length: int = 512
    """Tokens per example after the chat template; longer ones are truncated (and counted)."""
    packing: bool = False
    """Padding-free packing (both engines, ``hf_accum.batching.PackingCollator``): each micro-batch's sequences in
    one row, ``position_ids`` restarting per sequence; same targets, no pad tokens (docs/recipe.md)."""
    max_eval_examples: int = 200
    """Held-out rows scored by exact match (the first ones; caps the ``eval_fraction`` carve-out). Greedy generation
    of each: on a CPU a real model takes seconds per row, before training and after."""
    eval_before: bool = True
    """Score the held-out metric before training too (once per output directory: a resumed run reads back its first
    start's); false skips it (the score after training is still given)."""
    eval_max_new_tokens: int = 32
    num_train_examples: int = 6000
    """Embedded dataset only: generated training examples."""
    num_eval_examples: int = 200
    """Embedded dataset only: generated held-out examples."""
    seed: int = 0
    """Seed of the embedded dataset's generation and of the ``eval_fraction`` draw."""
    IDENTITY: ClassVar[str] = "dataset"
    TIED: ClassVar[tuple[str, ...]] = ("dataset_config", "format", "train_split", "eval_split", "messages_column",
                                       "prompt_column", "answer_column", "input_column", "text_column",
                                       "num_train_examples", "num_eval_examples")
    """Keys of one dataset (splits, columns, generated sizes): a new ``dataset`` drops the lower layers'."""


AccumulationSection = AccumulationSettings
"""``accumulation``: the accumulation settings themselves (:class:`hf_accum.settings.AccumulationSettings`: its
fields are the keys, declared once for the loop, AccumTrainer and the recipe; each value checked when the section is
built). What they need of the rest of the run is checked by
:func:`hf_accum.recipe.accumulation_section.check_accumulation_section`."""


@dataclass
class DPOSection:
    """DPO's settings (``objective: dpo``), TRL's ``DPOConfig`` names: the trainer engine passes them to
    ``DPOConfig``, the loop engine to ``hf_accum.losses.preference.DPOPairLoss`` (checked by
    :func:`hf_accum.recipe.preference_section.check_dpo_section`)."""

    beta: float = 0.1
    """How far the policy may move from the reference (the base model: the adapter disabled); TRL's ``beta``."""
    loss_type: str = "sigmoid"
    """The per-pair loss: sigmoid (DPO) | ipo | hinge | robust; TRL's ``loss_type``."""
    label_smoothing: float = 0.0
    """The probability that a pair's preference is flipped (cDPO / robust DPO), in [0, 0.5)."""
    sft_weight: float = 0.0
    """Weight of an SFT term on the chosen answers (a token mean over the update's chosen tokens) added to the
    pair loss; 0: none. TRL: ``loss_type=[<loss_type>, "sft"]``, ``loss_weights=[1, sft_weight]``."""


class TrainingSection(dict[str, Any]):
    """``training``: the ``TrainingArguments`` fields this run sets (``in``, iteration and the saved copy see
    only those), every field readable as an attribute: the value set, else ``TrainingArguments``' default."""

    # The fields the recipe kit reads, for type checkers; every other field reads the same way.
    output_dir: str
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_train_epochs: float
    max_steps: int
    max_grad_norm: float
    bf16: bool
    fp16: bool
    use_cpu: bool
    seed: int

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        if name.startswith("__"):  # copy's and pickle's probes (__deepcopy__, ...): no TrainingArguments import
            raise AttributeError(name)
        if name not in training_defaults():
            raise AttributeError(f"TrainingArguments has no field {name!r}")
        return training_defaults()[name]


@functools.cache
def training_defaults() -> dict[str, Any]:
    from transformers import TrainingArguments

    return {f.name: f.default_factory() if callable(f.default_factory) else f.default
            for f in dataclasses.fields(TrainingArguments)}
