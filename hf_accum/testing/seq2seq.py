"""Encoder-decoders for exactness checks: tiny T5, UMT5, BART, mBART, Marian and Pegasus models built from config
(float64, no dropout), rows of a source and a target of uneven lengths, their padding collator, and a big-batch
auditor whose reference is the model's *own* ``forward(labels=...)`` loss.

The reference (:class:`Seq2SeqAuditor`) is independent of hf_accum's loss code: it joins an update's
micro-batches (all ranks) into one batch -- encoder inputs padded to the longest source, decoder inputs and
labels to the longest target -- and differentiates the loss the model computes itself from ``labels=`` (its
mean over every target; the model builds its decoder inputs from the labels where the batch has none). T5 and
UMT5 compute their layer norm's variance in float32 whatever the model's dtype: run the checks inside
:func:`hf_accum.testing.float64.float64_arithmetic`, as the other float64 checks of models with float32 islands do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hf_accum.testing.scenarios import Scenario
from hf_accum.verify import BigBatchAuditor

SEQ2SEQ_FAMILIES = ("t5", "umt5", "bart", "mbart", "marian", "pegasus")
SEQ2SEQ_VOCAB = 53
FIRST_WORD = 3
"""Row tokens are drawn from ``FIRST_WORD..VOCAB-1``: never a pad, start or end id of any family here (mBART's
shift finds a row's last token as its last non-pad one)."""

# Keys an encoder-decoder reads per *target* position (padded to the longest target when joined); every other
# per-position key is per source position.
_DECODER_KEYS = ("labels", "decoder_input_ids", "decoder_attention_mask")

_BART_LIKE: dict[str, Any] = dict(
    d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
    encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
    activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
)
_T5_LIKE: dict[str, Any] = dict(
    d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, dropout_rate=0.0,
    relative_attention_num_buckets=8, relative_attention_max_distance=16,
)


def _config(family: str) -> Any:
    """The family's config class at a tiny size, with its own pad / start / end ids."""
    import transformers

    common: dict[str, Any] = dict(vocab_size=SEQ2SEQ_VOCAB)
    config_class: Any
    if family in ("t5", "umt5"):
        config_class = transformers.T5Config if family == "t5" else transformers.UMT5Config
        return config_class(**common, **_T5_LIKE, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    ids: dict[str, dict[str, int]] = {
        "bart": dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2),
        "mbart": dict(pad_token_id=1, bos_token_id=0, eos_token_id=2),  # its shift starts from a row's last token
        "marian": dict(pad_token_id=1, eos_token_id=2, decoder_start_token_id=1),
        "pegasus": dict(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
    }
    if family not in ids:
        raise ValueError(f"family={family!r}; allowed: {SEQ2SEQ_FAMILIES}")
    config_class = {"bart": transformers.BartConfig, "mbart": transformers.MBartConfig,
                    "marian": transformers.MarianConfig, "pegasus": transformers.PegasusConfig}[family]
    return config_class(**common, **_BART_LIKE, **ids[family])


def tiny_seq2seq(family: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    """A tiny ``AutoModelForSeq2SeqLM`` of ``family`` (one of :data:`SEQ2SEQ_FAMILIES`), random init, ``dtype``."""
    from transformers import AutoModelForSeq2SeqLM

    config = _config(family)
    torch.manual_seed(seed)
    model: nn.Module = AutoModelForSeq2SeqLM.from_config(config)
    return model.to(dtype)


def _decoder_shift(family: str) -> Callable[..., torch.Tensor]:
    """The family's ``prepare_decoder_input_ids_from_labels`` (it reads only the config's ids)."""
    model: Any = tiny_seq2seq(family)
    return model.prepare_decoder_input_ids_from_labels


def seq2seq_pad_token_id(family: str) -> int:
    return int(_config(family).pad_token_id)


def seq2seq_rows(count: int, seed: int = 0, equal_lengths: bool = False, min_len: int = 2,
                 max_len: int = 11) -> list[dict[str, list[int]]]:
    """``count`` rows ``{"input_ids", "labels"}`` of random words: source and target lengths drawn apart (or
    the same per row with ``equal_lengths``, so a micro-batch's encoder and decoder shapes match, the case where a
    BART called without labels builds its decoder inputs from the encoder's ids and still runs)."""
    generator = random.Random(seed)

    def words(length: int) -> list[int]:
        return [generator.randrange(FIRST_WORD, SEQ2SEQ_VOCAB) for _ in range(length)]

    rows = []
    for _ in range(count):
        source = generator.randint(min_len, max_len)
        target = source if equal_lengths else generator.randint(min_len, max_len)
        rows.append({"input_ids": words(source), "labels": words(target)})
    return rows


@dataclass
class Seq2SeqCollator:
    """Right-pads sources (``input_ids`` with the pad id, ``attention_mask``) and targets (``labels`` with -100).
    ``decoder_inputs`` (e.g. a model's ``prepare_decoder_input_ids_from_labels``) adds ``decoder_input_ids``
    built from the padded labels, as ``DataCollatorForSeq2Seq(model=...)`` does; None: labels only, as
    ``DataCollatorForSeq2Seq`` without a model gives."""

    pad_token_id: int
    decoder_inputs: Callable[..., torch.Tensor] | None = None

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sources = [torch.tensor(row["input_ids"]) for row in rows]
        targets = [torch.tensor(row["labels"]) for row in rows]
        batch = {
            "input_ids": _stack(sources, self.pad_token_id),
            "attention_mask": _stack([torch.ones_like(s) for s in sources], 0),
            "labels": _stack(targets, -100),
        }
        if self.decoder_inputs is not None:
            batch["decoder_input_ids"] = self.decoder_inputs(labels=batch["labels"])
        return batch


def _stack(rows: list[torch.Tensor], fill: int) -> torch.Tensor:
    length = max(int(row.numel()) for row in rows)
    return torch.stack([F.pad(row, (0, length - int(row.numel())), value=fill) for row in rows])


def join_seq2seq_batches(micro_batches: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """One batch of all rows: encoder inputs right-padded to the longest source, decoder inputs and labels to the
    longest target (pads: -100 for labels, 0 for masks, the pad id otherwise)."""
    joined = {}
    for key in micro_batches[0]:
        tensors = [batch[key] for batch in micro_batches]
        length = max(t.shape[1] for t in tensors)
        fill = -100 if key == "labels" else 0 if key.endswith("attention_mask") else pad_token_id
        joined[key] = torch.cat([F.pad(t, (0, length - t.shape[1]), value=fill) for t in tensors])
    return joined


class Seq2SeqAuditor(BigBatchAuditor):
    """:class:`~hf_accum.verify.BigBatchAuditor` whose reference is the encoder-decoder's own loss: at each
    update, ``model(**joined_batch, labels=...).loss`` (the model's mean over all targets of the update's
    micro-batches, all ranks) and its gradient."""

    def reference_gradient(self, micro_batches: list[dict]) -> tuple[dict[str, torch.Tensor], int, float]:
        reference = self._reference
        reference.load_state_dict(self._live.state_dict())
        device = next(reference.parameters()).device
        big = {k: v.to(device) for k, v in join_seq2seq_batches(micro_batches, self.pad_token_id).items()}
        targets = int(big["labels"].ne(-100).sum())
        trainable = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
        if targets == 0:
            return {n: torch.zeros_like(p) for n, p in trainable}, 0, float("nan")
        loss = reference(**big, use_cache=False).loss  # labels in the batch: the model's own loss
        values = torch.autograd.grad(loss, [p for _, p in trainable], allow_unused=True)
        grads = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(trainable, values)}
        return grads, targets, float(loss.detach())


@dataclass
class Seq2SeqScenario(Scenario):
    """A :class:`~hf_accum.testing.scenarios.Scenario` audited by :class:`Seq2SeqAuditor`."""

    def auditor(self) -> BigBatchAuditor:
        return Seq2SeqAuditor(pad_token_id=self.pad_token_id)


def seq2seq_scenario(family: str, rows: list[dict[str, list[int]]], decoder_inputs: bool,
                     micro_batch: int = 2, accumulation: int = 3) -> Seq2SeqScenario:
    """``family`` trained on ``rows`` (K = ``accumulation``), the batch holding labels only or also
    ``decoder_input_ids`` (built by the model's ``prepare_decoder_input_ids_from_labels``)."""
    pad = seq2seq_pad_token_id(family)
    shift = _decoder_shift(family) if decoder_inputs else None
    return Seq2SeqScenario(
        f"seq2seq:{family}", lambda: tiny_seq2seq(family), rows, Seq2SeqCollator(pad, shift),
        micro_batch=micro_batch, accumulation=accumulation, loss_kind=None, pad_token_id=pad,  # type: ignore[arg-type]
    )
