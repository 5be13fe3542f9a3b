"""Soft-capped and scaled heads on the fused path (Gemma 2/3 ``final_logit_softcapping``, Cohere
``logit_scale``, Granite ``logits_scaling``).

* The chunked loss with a :class:`~hf_accum.fused.loss.LogitTransform` equals torch's cross-entropy on
  the transformed materialized logits, in value and gradient (float64, 1e-12), with and without label
  smoothing, over several chunks.
* The probe fuses a transform only after seeing the model return exactly it: each family is fused (the
  log line says so), and a model whose logits differ from what its configuration declares keeps the
  logits path with the warning (negative control).
* Both front-ends stay exact on the fused path for every family: tests/unit/test_model_families.py (the families
  table, label smoothing 0.1, float64, < 1e-10 against the big batch); the naive loop is not (negative control here).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_accum.batching import PaddingCollator
from hf_accum.fused.loss import (
    IDENTITY,
    LinearHead,
    LogitTransform,
    linear_cross_entropy_sum,
)
from hf_accum.losses.micro_batch import MicroBatchLoss
from hf_accum.losses.token_loss import token_loss_sum
from hf_accum.testing import (
    PAD,
    VOCAB,
    Scenario,
    random_rows,
    run_naive,
)
from hf_accum.testing.models import TEST_SHAPE

NAIVE_IS_WRONG = 1e-3
FUSED_ON = "fused linear cross-entropy on"
FUSED_OFF = "fused linear cross-entropy off"

TRANSFORMS = {
    "softcap": LogitTransform(softcap=2.0),  # small: most logits are in tanh's curved part
    "multiply": LogitTransform(multiply=0.0625),
    "divide": LogitTransform(divide=3.0),
    "scaled_softcap": LogitTransform(multiply=4.0, softcap=1.5),
}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the chunk math against torch on materialized logits --------------------------------------------


def _inputs(seed=0, rows=37, hidden=8, vocab=29):
    generator = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, hidden, generator=generator, dtype=torch.float64)).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    bias = torch.randn(vocab, generator=generator, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[::4] = -100
    return h, weight, bias, targets


def _reference_transform(name: str, z: torch.Tensor) -> torch.Tensor:
    """The models' own formulas, written out (not through LogitTransform)."""
    if name == "softcap":
        return torch.tanh(z / 2.0) * 2.0
    if name == "multiply":
        return z * 0.0625
    if name == "divide":
        return z / 3.0
    return torch.tanh(z * 4.0 / 1.5) * 1.5


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transformed_loss_equals_torch_in_float64(name, smoothing):
    h, weight, bias, targets = _inputs()
    params = (h, weight, bias)
    reference = F.cross_entropy(_reference_transform(name, F.linear(h, weight, bias)), targets, reduction="sum",
                                label_smoothing=smoothing)
    reference_grads = torch.autograd.grad(reference * 3.0, params)
    head = LinearHead(weight, bias, transform=TRANSFORMS[name])
    for chunk_rows in (5, 1000):
        loss = linear_cross_entropy_sum(h, head, targets, smoothing, chunk_bytes=chunk_rows * 29 * 8 * 2)
        grads = torch.autograd.grad(loss * 3.0, params)
        torch.testing.assert_close(loss, reference, rtol=1e-13, atol=0)
        for ours, theirs in zip(grads, reference_grads):
            assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-12


def test_the_transform_changes_the_loss():
    """Negative control for the test above: without the transform the values differ (far above 1e-12)."""
    h, weight, bias, targets = _inputs()
    capped = linear_cross_entropy_sum(h, LinearHead(weight, bias, transform=TRANSFORMS["softcap"]), targets)
    plain = linear_cross_entropy_sum(h, LinearHead(weight, bias), targets)
    assert abs(float(capped) / float(plain) - 1) > 1e-2


def test_transform_reproduces_the_model_ops_bit_for_bit():
    z = torch.randn(5, 7, dtype=torch.float64) * 40
    for name, transform in TRANSFORMS.items():
        assert torch.equal(transform(z), _reference_transform(name, z)), name
    assert torch.equal(IDENTITY(z), z)


# -- the families: probed, fused, exact in both front-ends ---------------------------------------------
#
# Float64 models without their float32 islands (norms, Cohere's rotary and Gemma2's eager softmax upcast
# to fp32): an island rounds gradients to fp32 in backward, a ~1e-7 floor under any float64 comparison,
# fused or not. Inside :class:`Float64Throughout` a cast of a float64 tensor to float32 keeps float64.


class Float64Throughout(TorchFunctionMode):
    """Turns ``x.float()``, ``x.to(torch.float32)`` and ``softmax(..., dtype=torch.float32)`` of float64
    tensors into float64 (the models' formulas unchanged, their precision float64 throughout)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.dtype == torch.float64:
            if func is torch.Tensor.float:
                return first
            if func is torch.Tensor.to:
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
                if kwargs.get("dtype") is torch.float32:
                    kwargs["dtype"] = torch.float64
            if func in (F.softmax, torch.softmax, torch.Tensor.softmax) and kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def _gemma2(softcapping=30.0):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, pad_token_id=PAD, head_dim=8, final_logit_softcapping=softcapping,
                          **TEST_SHAPE)
    return Gemma2ForCausalLM(config).double()


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, pad_token_id=PAD, head_dim=8, final_logit_softcapping=3.0,
                              sliding_window=8, **TEST_SHAPE)
    return Gemma3ForCausalLM(config).double()


def _cohere():
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    model = CohereForCausalLM(CohereConfig(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=2, bos_token_id=1,
                                          logit_scale=0.0625, **TEST_SHAPE))
    return model.double()


def _granite():
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    model = GraniteForCausalLM(GraniteConfig(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=2, bos_token_id=1,
                                             logits_scaling=4.0, **TEST_SHAPE))
    return model.double()


FAMILIES = {"gemma2": _gemma2, "gemma3": _gemma3, "cohere": _cohere, "granite": _granite}
EXPECTED = {
    "gemma2": LogitTransform(softcap=30.0),
    "gemma3": LogitTransform(softcap=3.0),
    "cohere": LogitTransform(multiply=0.0625),
    "granite": LogitTransform(divide=4.0),
}


def _batch(seed=5):
    batch = PaddingCollator(PAD)(random_rows(4, seed=seed, prompt_masking=True))
    return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_is_probed_and_fused_with_the_same_loss(family, caplog):
    model = FAMILIES[family]().train()
    inputs, labels = _batch()
    step = MicroBatchLoss(label_smoothing=0.1)
    with caplog.at_level(logging.INFO, logger="hf_accum.fused.loss"):
        for _ in range(2):
            _, fused, n_targets = step(model, inputs, labels)
    assert step.fused.active and step.fused.transform == EXPECTED[family]
    assert caplog.text.count(FUSED_ON) == 1 and FUSED_OFF not in caplog.text
    reference, reference_n = token_loss_sum(model(**inputs).logits, labels, "causal_lm", 0.1)
    assert int(n_targets) == int(reference_n)
    torch.testing.assert_close(fused, reference, rtol=1e-13, atol=0)


class _DifferentCap(torch.nn.Module):
    """A Gemma2 whose returned logits are capped at 20 while its configuration says 30."""

    def __init__(self):
        super().__init__()
        self.inner = _gemma2(30.0)
        self.config = self.inner.config

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **inputs):
        outputs = self.inner(**inputs)
        return CausalLMOutputWithPast(logits=torch.tanh(outputs.logits / 20.0) * 20.0)


class _OffsetLogits(_DifferentCap):
    """A head followed by something no configuration declares (a constant added to the logits)."""

    def forward(self, **inputs):
        return CausalLMOutputWithPast(logits=self.inner(**inputs).logits + 0.5)


@pytest.mark.parametrize("factory", [_DifferentCap, _OffsetLogits], ids=["mis_declared_softcap", "unknown_change"])
def test_logits_not_proven_keep_the_logits_path_with_the_warning(factory, caplog):
    """Negative control of the probe: a declared transform is a hypothesis, checked bit for bit."""
    model = factory().train()
    inputs, labels = _batch()
    step = MicroBatchLoss(kind="causal_lm")
    with caplog.at_level(logging.INFO, logger="hf_accum.fused.loss"):
        for _ in range(2):
            _, loss, _ = step(model, inputs, labels)
    assert not step.fused.active and "changes the logits after its output layer" in step.fused.reason
    assert caplog.text.count(FUSED_OFF) == 1
    torch.testing.assert_close(loss, token_loss_sum(model(**inputs).logits, labels)[0], rtol=1e-13, atol=0)


def _scenario(family: str) -> Scenario:
    return Scenario(family, FAMILIES[family], random_rows(22, seed=41, prompt_masking=True), PaddingCollator(PAD),
                    label_smoothing=0.1)


def test_naive_loop_is_wrong_on_a_soft_capped_family():
    """Negative control: the same audit fails the classic loop."""
    with Float64Throughout():
        assert run_naive(_scenario("gemma2")).max_relative_error > NAIVE_IS_WRONG
