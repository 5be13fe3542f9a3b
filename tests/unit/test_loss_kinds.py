"""Loss kinds: one registry (hf_accum.losses.token_loss.LOSS_KIND_SPECS, mirrored by the auditor's
hf_accum.verify.REFERENCE_LAYOUTS), and the probe that places a model whose class names no layout by
comparing its own loss with ours -- so a causal LM inside a custom nn.Module works without loss_kind=."""

from __future__ import annotations

import logging

import pytest
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.losses.model_loss import probe_loss_kind
from hf_accum.losses.token_loss import LOSS_KIND_SPECS, LOSS_KINDS, infer_loss_kind
from hf_accum.testing import PAD, NoKwargsForCausalLM, Scenario, random_rows, run_trainer, tiny_causal_lm
from hf_accum.verify import REFERENCE_LAYOUTS

EXACT = 1e-10


def test_every_loss_kind_has_a_reference_layout():
    assert set(LOSS_KIND_SPECS) == set(REFERENCE_LAYOUTS) == set(LOSS_KINDS)
    assert [kind for kind, spec in LOSS_KIND_SPECS.items() if spec.fused] == ["causal_lm"]


class TinyChat(NoKwargsForCausalLM):
    """A causal LM in a custom module whose class name says nothing (no **kwargs in forward either)."""


class TinyTagger(nn.Module):
    """Per-position classification in a custom module: its own loss aligns labels with the logits."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_causal_lm()
        self.config = self.inner.config

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class SummingLM(TinyChat):
    """Its own loss is a sum, not a mean: it matches no layout."""

    def forward(self, input_ids, attention_mask=None, labels=None, use_cache=None):
        out = super().forward(input_ids, attention_mask, labels)
        return CausalLMOutputWithPast(loss=out.loss * 7.0, logits=out.logits)


def _first_batch(seed=0):
    batch = PaddingCollator(PAD)(random_rows(4, seed=seed, prompt_masking=True))
    return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]


@pytest.mark.parametrize("model_cls,kind", [(TinyChat, "causal_lm"), (TinyTagger, "token")])
def test_probe_picks_the_layout_of_the_models_own_loss(model_cls, kind, caplog):
    model = model_cls(tiny_causal_lm()) if model_cls is TinyChat else model_cls()
    with pytest.raises(ValueError, match="cannot tell the loss layout"):
        infer_loss_kind(model)
    inputs, labels = _first_batch()
    with caplog.at_level(logging.INFO, logger="hf_accum.losses.token_loss"):
        assert probe_loss_kind(model.train(), inputs, labels) == kind
    assert f"loss layout of {model_cls.__name__}: {kind!r}" in caplog.text
    assert model.training  # the probe's eval mode is undone


def test_probe_raises_the_clear_error_when_no_layout_matches():
    inputs, labels = _first_batch()
    with pytest.raises(ValueError, match="cannot tell the loss layout of 'SummingLM'.*matches none.*pass loss_kind="):
        probe_loss_kind(SummingLM(tiny_causal_lm()), inputs, labels)


def test_accum_trainer_places_a_custom_causal_lm_without_loss_kind(tmp_path, caplog):
    """Drop-in: no loss_kind=, a class name that says nothing, a forward without **kwargs -- exact."""
    scenario = Scenario("custom_module", lambda: TinyChat(tiny_causal_lm()), random_rows(16, seed=9),
                        PaddingCollator(PAD))
    with caplog.at_level(logging.INFO, logger="hf_accum.losses.token_loss"):
        run = run_trainer(scenario, str(tmp_path), AccumTrainer)
    assert run.trainer.loss_kind == "causal_lm"
    assert "loss layout of TinyChat: 'causal_lm'" in caplog.text
    assert len(run.errors) == 2 and run.max_error < EXACT, run.errors


def test_accum_trainer_refuses_a_model_matching_no_layout(tmp_path):
    scenario = Scenario("summing", lambda: SummingLM(tiny_causal_lm()), random_rows(8, seed=9), PaddingCollator(PAD))
    with pytest.raises(ValueError, match="cannot tell the loss layout"):
        run_trainer(scenario, str(tmp_path), AccumTrainer)
