"""Encoder-decoders trained on their own objective, and any model whose ``forward(labels=...)`` differs from the
forward that trains refused (issue 36).

Both front-ends call the model without ``labels``; an encoder-decoder whose batch has labels but no
``decoder_input_ids`` must get the decoder inputs it builds from its labels itself
(:func:`hf_accum.losses.model_loss.training_inputs`). Float64 without float32 islands (T5's layer norm computes its
variance in float32: :func:`hf_accum.testing.float64.float64_arithmetic`), K = 3 micro-batches of uneven target
counts, every update against :class:`hf_accum.testing.seq2seq.Seq2SeqAuditor`, whose reference is the model's own
``forward(labels=...)`` loss on the update's joined batch. Negative controls: the forward without decoder inputs
trains another objective (error ~1), and the first-micro-batch probe refuses it and a custom model that builds
different inputs when given labels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.bart import modeling_bart

import hf_accum.losses.micro_batch as micro_batch_module
import hf_accum.losses.model_loss as model_loss_module
from hf_accum import AccumTrainer
from hf_accum.batching import PaddingCollator
from hf_accum.errors import InputError
from hf_accum.loop.evaluation import evaluate_loss
from hf_accum.losses.micro_batch import MicroBatchLoss
from hf_accum.losses.model_loss import DifferentTrainingForward, decoder_inputs_from_labels, training_inputs
from hf_accum.testing import PAD, Scenario, fresh_accelerator, random_rows, run_exact, run_trainer, tiny_causal_lm
from hf_accum.testing.float64 import float64_arithmetic
from hf_accum.testing.seq2seq import (
    SEQ2SEQ_FAMILIES,
    Seq2SeqCollator,
    join_seq2seq_batches,
    seq2seq_pad_token_id,
    seq2seq_rows,
    seq2seq_scenario,
    tiny_seq2seq,
)

EXACT = 1e-10
ROWS = {"unequal_lengths": seq2seq_rows(12, seed=3), "equal_lengths": seq2seq_rows(12, seed=3, equal_lengths=True)}

# The module-level shift the fallback of decoder_inputs_from_labels finds for a model class defined here.
shift_tokens_right = modeling_bart.shift_tokens_right


def _audited_errors(family: str, lengths: str, decoder_inputs: bool, front_end: str, tmp_path) -> list[float]:
    scenario = seq2seq_scenario(family, ROWS[lengths], decoder_inputs)
    with float64_arithmetic():
        if front_end == "loop":
            return [r.relative_error for r in run_exact(scenario)[1].records]
        return run_trainer(scenario, str(tmp_path), AccumTrainer).errors


def test_micro_batches_hold_uneven_target_counts():
    for lengths, rows in ROWS.items():
        counts = [sum(len(row["labels"]) for row in rows[i : i + 2]) for i in range(0, len(rows), 2)]
        assert len(set(counts)) >= 4, (lengths, counts)
    equal = Seq2SeqCollator(1)(ROWS["equal_lengths"][:2])
    assert equal["input_ids"].shape == equal["labels"].shape  # the case where a BART without labels still runs


@pytest.mark.parametrize("front_end", ["loop", "trainer"])
@pytest.mark.parametrize("decoder_inputs", [False, True], ids=["labels_only", "decoder_input_ids"])
@pytest.mark.parametrize("lengths", ROWS)
@pytest.mark.parametrize("family", SEQ2SEQ_FAMILIES)
def test_encoder_decoders_train_on_their_own_objective(family, lengths, decoder_inputs, front_end, tmp_path):
    errors = _audited_errors(family, lengths, decoder_inputs, front_end, tmp_path)
    assert len(errors) == 2 and max(errors) < EXACT, errors


def _own_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch, use_cache=False).loss


def _relative_error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(grads, reference))
    return (diff / sum(float(r.pow(2).sum()) for r in reference)) ** 0.5


@pytest.mark.parametrize("family", ["bart", "mbart"])
def test_negative_control_without_decoder_inputs_another_objective_is_trained(family):
    """What both front-ends did before: the forward without labels and without decoder inputs. A BART-like model
    then builds its decoder inputs from the *encoder's* ids (equal lengths: it runs, no error): the gradient is
    another objective's (relative error ~1); with the decoder inputs built from the labels it is exact."""
    model = tiny_seq2seq(family)
    batch = Seq2SeqCollator(seq2seq_pad_token_id(family))(ROWS["equal_lengths"][:6])
    labels = batch["labels"]
    params = [p for p in model.parameters() if p.requires_grad]
    reference = torch.autograd.grad(_own_loss(model, batch), params, allow_unused=True)
    reference = [torch.zeros_like(p) if g is None else g for p, g in zip(params, reference)]

    def error(inputs: dict[str, torch.Tensor]) -> float:
        logits = model(**inputs).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return _relative_error([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)], reference)

    no_labels = {key: value for key, value in batch.items() if key != "labels"}
    assert error(no_labels) > 0.5
    assert error(training_inputs(model, no_labels, labels)) < EXACT


@pytest.fixture
def old_forward(monkeypatch):
    """Both front-ends' forward as it was: no decoder inputs built from the labels."""
    def unchanged(model, inputs, labels, kind=None):
        return inputs

    monkeypatch.setattr(micro_batch_module, "training_inputs", unchanged)
    monkeypatch.setattr(model_loss_module, "training_inputs", unchanged)


@pytest.mark.parametrize(("family", "lengths", "cause"), [
    ("bart", "equal_lengths", r"its own loss [0-9.]+ \(forward\(labels=\.\.\.\)\) vs the training forward's [0-9.]+"),
    ("bart", "unequal_lengths", r"its logits \(1, \d+, 53\) there do not line up with labels \(1, \d+\)"),
    ("t5", "unequal_lengths", r"that forward fails \(You must specify exactly one of input_ids"),
])
@pytest.mark.parametrize("front_end", ["loop", "trainer"])
def test_the_probe_refuses_the_old_forward_naming_the_cause(old_forward, family, lengths, cause, front_end, tmp_path):
    with pytest.raises(DifferentTrainingForward, match=r"ForConditionalGeneration builds different inputs when "
                                                       r"called with labels= .*: " + cause):
        _audited_errors(family, lengths, False, front_end, tmp_path)


def test_negative_control_the_old_forward_without_the_probe_trains_silently_wrong(old_forward, monkeypatch):
    """The probe's new check is what stops it: without it, the old forward trains BART on another objective."""
    monkeypatch.setattr(model_loss_module, "_check_training_forward", lambda *args: None)
    errors = _audited_errors("bart", "equal_lengths", False, "loop", None)
    assert min(errors) > 0.5, errors


class PromptBlindForCausalLM(nn.Module):
    """A causal LM that, called with ``labels=``, pads out the prompt (the positions whose label is -100) before
    its forward: its own loss is not the loss of the forward without labels, the one that trains."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_causal_lm()
        self.config = self.inner.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        if labels is not None:
            input_ids = input_ids.masked_fill(labels.eq(-100), PAD)
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.mark.parametrize("front_end", ["loop", "trainer"])
def test_a_model_whose_labels_forward_differs_is_refused_naming_the_cause(front_end, tmp_path):
    scenario = Scenario("prompt_blind", PromptBlindForCausalLM, random_rows(12, seed=5, prompt_masking=True),
                        PaddingCollator(PAD), micro_batch=2, accumulation=3)
    message = (r"PromptBlindForCausalLM builds different inputs when called with labels= than in the forward that "
               r"trains \(without labels\): its own loss [0-9.]+ \(forward\(labels=\.\.\.\)\) vs the training "
               r"forward's [0-9.]+ on the first micro-batch")
    with pytest.raises(DifferentTrainingForward, match=message):
        if front_end == "loop":
            run_exact(scenario)
        else:
            run_trainer(scenario, str(tmp_path), AccumTrainer)


def test_the_same_model_without_prompt_masking_trains():
    """Control: where its two forwards agree (no -100 before a target), the probe lets it train, exactly."""
    scenario = Scenario("prompt_blind", PromptBlindForCausalLM, random_rows(12, seed=5), PaddingCollator(PAD),
                        micro_batch=2, accumulation=3)
    errors = [r.relative_error for r in run_exact(scenario)[1].records]
    assert len(errors) == 2 and max(errors) < EXACT, errors


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_evaluation_builds_the_decoder_inputs_too(family):
    """The loop's held-out loss and AccumTrainer's eval_loss of a labels-only batch: the model's own loss."""
    model = tiny_seq2seq(family)
    rows = ROWS["unequal_lengths"]
    collator = Seq2SeqCollator(seq2seq_pad_token_id(family))
    with float64_arithmetic(), torch.no_grad():
        joined = join_seq2seq_batches([collator(rows[i : i + 3]) for i in range(0, len(rows), 3)],
                                      seq2seq_pad_token_id(family))
        own = float(_own_loss(model, joined))
        loss = evaluate_loss(model, DataLoader(rows, batch_size=3, collate_fn=collator), fresh_accelerator(1),
                             MicroBatchLoss())
    assert loss == pytest.approx(own, rel=1e-12)


def test_trainer_eval_loss_of_a_labels_only_batch(tmp_path):
    scenario = seq2seq_scenario("t5", ROWS["unequal_lengths"], decoder_inputs=False)
    with float64_arithmetic():
        run = run_trainer(scenario, str(tmp_path), AccumTrainer, per_device_eval_batch_size=5)
        eval_loss = run.trainer.evaluate(eval_dataset=ROWS["equal_lengths"])["eval_loss"]
        model = run.trainer.accelerator.unwrap_model(run.trainer.model).eval()
        batches = [scenario.collator(ROWS["equal_lengths"][i : i + 5]) for i in range(0, 12, 5)]
        with torch.no_grad():
            own = float(_own_loss(model, join_seq2seq_batches(batches, scenario.pad_token_id)))
    assert eval_loss == pytest.approx(own, rel=1e-12)


def test_training_inputs_leaves_other_batches_alone():
    labels = torch.tensor([[5, 6, -100]])
    inputs = {"input_ids": torch.tensor([[7, 8, 9]])}
    assert training_inputs(tiny_causal_lm(), inputs, labels) is inputs  # not an encoder-decoder
    given = {**inputs, "decoder_input_ids": torch.tensor([[2, 5, 6]])}
    assert training_inputs(tiny_seq2seq("bart"), given, labels) is given  # the batch's own decoder inputs win


@pytest.mark.parametrize("family", ["t5", "bart"])
@pytest.mark.parametrize("problem", ["single_label_classification", "multi_label_classification"])
def test_encoder_decoder_classifiers_keep_their_own_decoder_inputs(family, problem):
    """A sequence-classification head of an encoder-decoder builds its decoder inputs from ``input_ids``, not
    from its labels (``[B]``, or ``[B, C]`` floats): nothing is added, and the loss is the model's own."""
    from transformers import AutoModelForSequenceClassification

    config = tiny_seq2seq(family).config
    config.num_labels, config.problem_type = 3, problem
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).to(torch.float64)
    batch = Seq2SeqCollator(seq2seq_pad_token_id(family))(ROWS["unequal_lengths"][:4])
    batch.pop("labels")
    eos = int(config.eos_token_id)  # BART's head reads the last end-of-sequence token of each row
    batch["input_ids"] = torch.cat([batch["input_ids"], torch.full((4, 1), eos)], 1)
    batch["attention_mask"] = torch.cat([batch["attention_mask"], torch.ones(4, 1, dtype=torch.long)], 1)
    labels = torch.tensor([0, 2, 1, 2]) if problem == "single_label_classification" else torch.rand(4, 3, dtype=torch.float64).round()
    assert training_inputs(model, batch, labels) is batch
    with float64_arithmetic():
        loss_sum, n_targets = MicroBatchLoss()(model.eval(), batch, labels)[1:]
        own = float(model(**batch, labels=labels).loss)
    assert float(loss_sum) / int(n_targets) == pytest.approx(own, rel=1e-12)


def test_training_inputs_sees_through_peft():
    from peft import LoraConfig, get_peft_model

    model = tiny_seq2seq("t5")
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q", "v"], task_type="SEQ_2_SEQ_LM"))
    labels = torch.tensor([[5, 6, -100], [7, 8, 9]])
    built = training_inputs(wrapped, {"input_ids": labels.clamp(min=3)}, labels)["decoder_input_ids"]
    assert torch.equal(built, torch.tensor([[0, 5, 6], [0, 7, 8]]))  # T5: decoder start 0, -100 -> pad 0


class _NoPrepareBart(modeling_bart.BartForConditionalGeneration):
    prepare_decoder_input_ids_from_labels = None  # type: ignore[assignment]


def test_decoder_inputs_fall_back_to_the_modeling_module_shift():
    model = tiny_seq2seq("bart")
    bare = _NoPrepareBart(model.config)
    labels = torch.tensor([[5, 6, -100], [7, 8, 9]])
    assert torch.equal(decoder_inputs_from_labels(bare, labels), model.prepare_decoder_input_ids_from_labels(labels))
    _NoPrepareBart.__module__ = "builtins"  # a module without a shift: the user is told what to pass
    try:
        with pytest.raises(InputError, match="_NoPrepareBart is an encoder-decoder .* put decoder_input_ids"):
            decoder_inputs_from_labels(bare, labels)
    finally:
        _NoPrepareBart.__module__ = __name__
