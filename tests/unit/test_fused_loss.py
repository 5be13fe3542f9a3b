"""The fused linear cross-entropy (hf_accum.fused.loss).

* The function equals torch's cross-entropy on the materialized logits, in value and gradient (float64
  to 1e-12; fp32, bf16 and bf16 autocast as close to a float64 reference as the logits path is).
* Both front-ends use it for causal LMs with the heads real fine-tunes have (LoRA on the output layer,
  modules_to_save, tied embeddings) and stay exact in float64 (< 1e-10, naive controls fail); the other
  scenarios of the exactness suites (padding, prompt masking, short windows, smoothing, checkpointing,
  LoRA, packing, DDP) run on it too -- checked here to really take the fused path.
* No (tokens x vocab) tensor exists while training (an allocation hook sees one on the logits path).
* It falls back, logged, where it cannot be proved equal (LoRA dropout on the head, custom losses);
  soft-capped and scaled heads are fused once the probe has proved them (tests/unit/test_fused_logit_transforms.py).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from hf_accum import AccumTrainer
from hf_accum.batching import PackingCollator, PaddingCollator
from hf_accum.fused.head import NotFusable, resolve_head
from hf_accum.fused.loss import LinearHead, linear_cross_entropy_sum
from hf_accum.loop import LoopConfig, train
from hf_accum.losses.micro_batch import MicroBatchLoss
from hf_accum.losses.token_loss import rows_per_chunk, token_loss_sum
from hf_accum.testing import (
    PAD,
    VOCAB,
    Scenario,
    fresh_accelerator,
    random_rows,
    run_exact,
    run_naive,
    run_trainer,
    tiny_causal_lm,
    training_args,
)
from hf_accum.testing.models import TEST_SHAPE

EXACT = 1e-10
NAIVE_IS_WRONG = 1e-3
FUSED_ON = "fused linear cross-entropy on"
FUSED_OFF = "fused linear cross-entropy off"


# -- the function against torch.nn.functional.cross_entropy --------------------------------------


def _head_and_inputs(head_kind: str, dtype=torch.float64, rows=37, hidden=8, vocab=29, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    weight = randn(vocab, hidden, scale=0.5)
    head = LinearHead(weight)
    if head_kind == "bias":
        head = LinearHead(weight, randn(vocab))
    elif head_kind == "lora":  # the base weight frozen, as under PEFT
        head = LinearHead(weight.detach(), None, randn(3, hidden), randn(vocab, 3), lora_scale=0.7)
    h = randn(rows, hidden)
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[::4] = -100  # prompt / padding / the last position of a row
    return h, head, targets


def _trainable(h, head):
    return [t for t in (h, head.weight, head.bias, head.lora_a, head.lora_b) if t is not None and t.requires_grad]


def _value_and_grads(loss_fn, h, head, upstream=3.0):
    loss = loss_fn()
    return loss.detach(), torch.autograd.grad(loss * upstream, _trainable(h, head))


def _max_relative(ours, reference):
    return max(float((a.double() - b.double()).abs().max() / b.double().abs().max()) for a, b in zip(ours, reference))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("head_kind", ["plain", "bias", "lora"])
def test_equals_torch_cross_entropy_in_float64(head_kind, smoothing):
    h, head, targets = _head_and_inputs(head_kind)
    reference, reference_grads = _value_and_grads(
        lambda: F.cross_entropy(head.logits(h), targets, reduction="sum", label_smoothing=smoothing), h, head
    )
    for chunk_rows in (5, 1000):  # 6 chunks, and all targets in one
        loss, grads = _value_and_grads(
            lambda rows=chunk_rows: linear_cross_entropy_sum(h, head, targets, smoothing, chunk_bytes=rows * 29 * 8),
            h, head,
        )
        assert loss.dtype == torch.float64
        torch.testing.assert_close(loss, reference, rtol=1e-13, atol=0)
        assert _max_relative(grads, reference_grads) < 1e-12


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("head_kind", ["plain", "lora"])
def test_per_row_weights_equal_the_weighted_logits_loss_in_float64(head_kind, smoothing, softcap):
    """``weights`` (per-sequence normalization's 1 / n_s) scale each target row's loss and gradient."""
    from hf_accum.fused.loss import LogitTransform

    h, head, targets = _head_and_inputs(head_kind)
    head = dataclasses.replace(head, transform=LogitTransform(softcap=softcap))
    weights = torch.rand(targets.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def logits_loss():
        per_row = F.cross_entropy(head.model_logits(h), targets, reduction="none", label_smoothing=smoothing)
        return (per_row * weights).sum()

    reference, reference_grads = _value_and_grads(logits_loss, h, head)
    for chunk_rows in (5, 1000):
        loss, grads = _value_and_grads(
            lambda rows=chunk_rows: linear_cross_entropy_sum(h, head, targets, smoothing, rows * 29 * 8 * 2,
                                                             weights=weights), h, head)
        torch.testing.assert_close(loss, reference, rtol=1e-13, atol=0)
        assert _max_relative(grads, reference_grads) < 1e-12
    # the weights matter: unweighted differs
    unweighted = linear_cross_entropy_sum(h, head, targets, smoothing).detach()
    assert abs(float(unweighted) / float(reference) - 1) > 1e-2
    with pytest.raises(ValueError, match="36 weights for 37 targets"):
        linear_cross_entropy_sum(h, head, targets, weights=weights[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_chunks_are_vocab_major_and_their_softmax_is_exact(dtype):
    """On a CPU a head in the loss dtype computes each chunk as ``W h^T`` ([vocab, rows], the GEMM orientation MKL
    runs at full speed) and hands on its transpose; the softmax then runs down the columns. Checked: the layout
    is taken (a short last chunk too), and that softmax is within a few rounding errors of a float64 one."""
    from hf_accum.fused.gradients import ChunkBuffers, softmax_, vocab_major

    h, head, _ = _head_and_inputs("bias", dtype=dtype, rows=7, hidden=8, vocab=3000)
    buffers = ChunkBuffers(5, head.weight, dtype)
    assert buffers.vocab_major
    for rows in (5, 2):  # a full chunk and a short last one
        chunk = buffers.logits_of(h[:rows].detach(), head.weight.detach(), head.bias.detach())
        assert chunk.shape == (rows, 3000) and chunk.stride() == (1, rows)  # the transpose of a contiguous block
        expected = head.logits(h[:rows]).detach().double()
        # Two GEMM orientations round differently (by CPU: MKL on a Xeon, other kernels on an EPYC), so the bound is
        # the dot product's rounding bound, hidden * eps * (|W| |h|^T + |b|), element by element, not a relative
        # tolerance (a logit near 0 has no relative accuracy to keep). A wrong layout misses it by O(1).
        scale = (h[:rows].detach().double().abs() @ head.weight.detach().double().abs().T
                 + head.bias.detach().double().abs())
        bound = h.shape[1] * torch.finfo(dtype).eps * scale
        assert bool(((chunk.double() - expected).abs() <= bound).all()), float(((chunk.double() - expected).abs() / bound).max())
        scaled = chunk.mul_(40.0)  # logits spread far apart: the maxima matter
        reference = torch.softmax(scaled.double(), 1)
        probabilities = softmax_(scaled)
        assert probabilities.data_ptr() == chunk.data_ptr()  # in place
        error = float((probabilities.double() - reference).abs().max())
        assert error < (1e-6 if dtype == torch.float32 else 1e-14), error
    # a bf16 head (its own product buffer, then upcast) stays row-major, and so does a head off the CPU
    assert not ChunkBuffers(5, head.weight.detach().bfloat16(), torch.float32).vocab_major
    assert not vocab_major(torch.empty(3000, 8, dtype=dtype, device="meta"))


def test_the_default_chunk_of_a_cpu_head_in_the_loss_dtype_holds_at_least_384_rows():
    """Under the default budget (192 MiB of logits) a 4-byte head on a CPU gets at least 384 rows per chunk (at
    vocab 262144 the budget alone gives 128: 32 passes over the weight at N = 4096); a budget the caller gives is
    kept, and a bf16 head and the general path are sized by the budget as before."""
    from hf_accum.fused.loss import IDENTITY, rows_per_chunk

    def rows(vocab, dtype=torch.float32, fast=True, chunk_bytes=None):
        return rows_per_chunk(vocab, torch.empty(0, dtype=dtype), IDENTITY, fast, chunk_bytes)

    assert rows(262144) == 384 and rows(262144, torch.float64) == 384  # the budget alone: 128 and 64
    assert rows(128256) == 384 and rows(32000) == 1536  # the budget already gives at least 384
    assert rows(262144, chunk_bytes=128 * 262144 * 4) == 128  # asked for: kept
    assert rows(262144, fast=False) == 128  # the general path (LoRA head, logit transform, autocast)
    assert rows(262144, torch.bfloat16) == 512  # 192 rows x LOW_PRECISION_CHUNK_FACTOR, to a multiple of 128
    # and the loss takes it: at vocab 70000 in float64 the budget gives 359 rows, the loss 384 (400 targets: 2 chunks)
    import hf_accum.fused.loss as fused_loss

    h, head, targets = _head_and_inputs("plain", rows=400, hidden=4, vocab=70000)
    assert rows(70000, torch.float64) == 384 and 192 * 2**20 // (70000 * 8) == 359
    taken = []
    apply = fused_loss._LinearCrossEntropySum.apply
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_loss._LinearCrossEntropySum, "apply", lambda *args: taken.append(args[6].chunk_rows) or apply(*args))
        loss = linear_cross_entropy_sum(h, head, targets)
    assert taken == [384]
    reference = F.cross_entropy(head.logits(h), targets, reduction="sum")
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=0)


def test_top1_hits_of_a_vocab_major_chunk_count_as_argmax_does():
    """Ties (the first maximum counts), a target that ties a later class, and a NaN logit (torch's argmax takes NaN
    as the maximum): the vocab-major count equals ``argmax`` on the row-major logits."""
    from hf_accum.fused.gradients import top1_hits

    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logits[:3, 5] = logits[:3, 9] = logits[:3].amax(1) + 1.0  # rows 0-2: classes 5 and 9 tie for the maximum
    targets = torch.tensor([5, 9, 5, 0, 0, 0])
    targets[3:] = logits[3:].argmax(1)  # rows 3-5: plain hits
    for with_nan in (False, True):
        if with_nan:
            logits[3, 30] = float("nan")  # argmax says 30: row 3 is no longer a hit
            logits[4, targets[4]] = float("nan")  # argmax says the target: row 4 still is one
        expected = int(logits.argmax(1).eq(targets).sum())
        vocab_major = logits.t().contiguous().t()  # the same values, strides (1, rows)
        assert vocab_major.stride(1) != 1
        assert int(top1_hits(vocab_major, targets)) == expected == (4 if with_nan else 5)


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_low_precision_is_as_close_to_float64_as_the_logits_path(dtype, autocast):
    """Against a float64 reference on the same (rounded) inputs, the fused loss and its gradients are no
    further off than the logits path (logits in the model's dtype, loss summed in fp32) -- within 2x."""
    h, head, targets = _head_and_inputs("bias", dtype=dtype, rows=64, hidden=32, vocab=300)
    h64, head64 = h.detach().double().requires_grad_(), LinearHead(head.weight.detach().double().requires_grad_(),
                                                                    head.bias.detach().double().requires_grad_())
    reference, reference_grads = _value_and_grads(
        lambda: F.cross_entropy(head64.logits(h64), targets, reduction="sum", label_smoothing=0.1), h64, head64
    )
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        fused, fused_grads = _value_and_grads(
            lambda: linear_cross_entropy_sum(h, head, targets, 0.1, chunk_bytes=16 * 300 * 4), h, head
        )
        logits_path, logits_grads = _value_and_grads(
            lambda: token_loss_sum(head.logits(h), targets, "token", 0.1)[0], h, head
        )
    assert fused.dtype == torch.float32
    fused_error = abs(float(fused) / float(reference) - 1)
    logits_error = abs(float(logits_path) / float(reference) - 1)
    assert fused_error <= 2 * logits_error + 1e-6, (fused_error, logits_error)
    assert _max_relative(fused_grads, reference_grads) <= 2 * _max_relative(logits_grads, reference_grads) + 1e-6


def test_rows_without_targets_give_zero_loss_and_zero_gradients():
    h, head, targets = _head_and_inputs("bias")
    loss, grads = _value_and_grads(lambda: linear_cross_entropy_sum(h, head, torch.full_like(targets, -100)), h, head)
    assert float(loss) == 0.0
    assert all(g is not None and not g.any() for g in grads)  # real zeros: DDP waits for every gradient


def test_a_second_backward_is_refused():
    h, head, targets = _head_and_inputs("plain")
    loss = linear_cross_entropy_sum(h, head, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


# -- what the output layer computes ---------------------------------------------------------------


def _peft(model, **lora):
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **{"target_modules": ["q_proj", "v_proj"], **lora})
    return get_peft_model(model, config).to(torch.float64)


def _lora_on_head():
    return _peft(tiny_causal_lm(), target_modules=["q_proj", "v_proj", "lm_head"])


def _modules_to_save():  # the recipe's default: embeddings and head trained in full
    return _peft(tiny_causal_lm(), modules_to_save=["lm_head", "embed_tokens"])


def _tied():
    model = tiny_causal_lm(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _checkpointed():
    model = tiny_causal_lm()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@pytest.mark.parametrize("factory", [tiny_causal_lm, _lora_on_head, _modules_to_save, _tied])
def test_resolved_head_computes_the_model_logits(factory):
    model = factory()
    head_module = model.get_output_embeddings()
    hidden = torch.randn(3, 5, TEST_SHAPE["hidden_size"], dtype=torch.float64)
    torch.testing.assert_close(resolve_head(head_module).logits(hidden), head_module(hidden), rtol=1e-14, atol=1e-14)


def test_modules_to_save_head_is_the_trainable_copy():
    model = _modules_to_save()
    wrapper = model.get_output_embeddings()
    head = resolve_head(wrapper)
    assert head.weight is wrapper.modules_to_save["default"].weight and head.weight.requires_grad
    assert head.weight is not wrapper.original_module.weight


def test_lora_dropout_on_the_head_is_not_fused():
    model = _peft(tiny_causal_lm(), target_modules=["lm_head"], lora_dropout=0.1)
    with pytest.raises(NotFusable, match="dropout"):
        resolve_head(model.get_output_embeddings())
    model.eval()  # dropout is off in eval mode
    assert resolve_head(model.get_output_embeddings()).lora_a is not None


# -- both front-ends take the fused path and stay exact --------------------------------------------


def _batch(examples, collator=PaddingCollator(PAD)):
    batch = collator(examples)
    return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]


@pytest.mark.parametrize(
    "factory,collator",
    [(tiny_causal_lm, PaddingCollator(PAD)), (_checkpointed, PaddingCollator(PAD)),
     (lambda: _peft(tiny_causal_lm()), PaddingCollator(PAD)), (tiny_causal_lm, PackingCollator()),
     (_lora_on_head, PaddingCollator(PAD)), (_modules_to_save, PaddingCollator(PAD)), (_tied, PaddingCollator(PAD))],
    ids=["plain", "checkpointing", "lora", "packed", "lora_on_head", "modules_to_save", "tied"],
)
def test_models_of_the_exactness_suites_take_the_fused_path(factory, collator, caplog):
    """The float64 exactness suites (padding, masking, windows, smoothing, checkpointing, LoRA, packing,
    DDP) run with the front-ends' defaults; these are their models: each is fused, with the same loss."""
    model = factory().train()
    inputs, labels = _batch(random_rows(4, seed=3, prompt_masking=True), collator)
    step = MicroBatchLoss(label_smoothing=0.1)
    with caplog.at_level(logging.INFO, logger="hf_accum.fused.loss"):
        _, fused, n_targets = step(model, inputs, labels)
    assert step.fused.active and FUSED_ON in caplog.text
    logits = model(**inputs).logits
    reference, reference_n = token_loss_sum(logits, labels, "causal_lm", 0.1)
    assert int(n_targets) == int(reference_n)
    torch.testing.assert_close(fused, reference, rtol=1e-13, atol=0)


HEAD_SCENARIOS = {
    "lora_on_head": _lora_on_head,
    "modules_to_save": _modules_to_save,
    "tied_embeddings": _tied,
}


def _head_scenario(name):
    return Scenario(name, HEAD_SCENARIOS[name], random_rows(22, seed=41, prompt_masking=True), PaddingCollator(PAD),
                    label_smoothing=0.1)


@pytest.mark.parametrize("name", sorted(HEAD_SCENARIOS))
def test_loop_is_exact_with_fused_heads_and_naive_is_not(name, caplog):
    with caplog.at_level(logging.INFO, logger="hf_accum.fused.loss"):
        result, auditor = run_exact(_head_scenario(name))
    assert FUSED_ON in caplog.text
    assert len(auditor.records) == len(result.updates) == 3  # windows of 4, 4 and a short 3 micro-batches
    assert auditor.max_relative_error < EXACT, [r.relative_error for r in auditor.records]
    assert run_naive(_head_scenario(name)).max_relative_error > NAIVE_IS_WRONG


@pytest.mark.parametrize("name", sorted(HEAD_SCENARIOS))
def test_accum_trainer_is_exact_with_fused_heads(name, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_accum.fused.loss"):
        run = run_trainer(_head_scenario(name), str(tmp_path), AccumTrainer)
    assert FUSED_ON in caplog.text
    assert len(run.errors) == 3 and run.max_error < EXACT, run.errors


# -- no (tokens x vocab) tensor --------------------------------------------------------------------


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) any op produces, forward and backward."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


LARGE_VOCAB = 128256


def _collator(layout: str):
    """``padded`` rows, or ``flattened``: each micro-batch one padding-free row with position ids and the
    flash-attention sequence boundaries, as TRL's ``padding_free``/``packing`` hand it to the model."""
    if layout == "padded":
        return PaddingCollator(PAD)
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)


def _train_large_vocab(front_end: str, row_length: int, output_dir: str, fused_loss: bool = True,
                       layout: str = "padded") -> None:
    """One update (2 micro-batches of 2 rows) at a Llama-3 vocabulary, fp32, without the auditor (its
    big-batch reference materializes logits on purpose)."""
    model = tiny_causal_lm(dtype=torch.float32, vocab_size=LARGE_VOCAB)
    rows = [{"input_ids": list(range(3 + i, 3 + i + row_length))} for i in range(4)]
    if front_end == "loop":
        accelerator = fresh_accelerator(2)
        loader = DataLoader(rows, batch_size=2, collate_fn=_collator(layout))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        train(model, optimizer, loader, accelerator, LoopConfig(disable_tqdm=True, fused_loss=fused_loss))
    else:
        scenario = Scenario("large_vocab", None, rows, _collator(layout), micro_batch=2, accumulation=2)
        AccumTrainer(model=model, args=training_args(scenario, output_dir), train_dataset=rows,
                     data_collator=scenario.collator, fused_loss=fused_loss).train()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["padded", "flattened"])
@pytest.mark.parametrize("front_end", ["loop", "trainer"])
def test_no_tokens_by_vocab_tensor_is_allocated_while_training(front_end, layout, tmp_path):
    """Neither the training forwards nor the first micro-batch's probes (the model's own loss, the head)
    hold the micro-batch's logits: the probes cut a padding-free row too (its sequence boundaries with it)."""
    row_length = 640  # 1280 positions per micro-batch: 164M logits (656 MB in fp32) on the logits path
    with LargestTensor() as watch:
        _train_large_vocab(front_end, row_length, str(tmp_path), layout=layout)
    chunk = rows_per_chunk(LARGE_VOCAB, torch.float32) * LARGE_VOCAB
    assert LARGE_VOCAB * TEST_SHAPE["hidden_size"] <= watch.largest <= chunk < 2 * row_length * LARGE_VOCAB / 2


def test_leading_slice_cuts_a_padding_free_row_with_its_sequence_boundaries():
    from hf_accum.losses.model_loss import leading_slice

    # three sequences of 5, 4 and 6 positions flattened into one row of 15
    inputs = {"input_ids": torch.arange(15).view(1, 15), "position_ids": torch.tensor([list(range(5)) + list(range(4))
              + list(range(6))]), "cu_seq_lens_q": torch.tensor([0, 5, 9, 15]), "cu_seq_lens_k": torch.tensor([0, 5, 9, 15]),
              "max_length_q": 6, "max_length_k": 6, "use_cache": False}
    cut = leading_slice(inputs, 0, 7)
    assert cut["input_ids"].tolist() == [list(range(7))]
    assert cut["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert cut["cu_seq_lens_q"].tolist() == cut["cu_seq_lens_k"].tolist() == [0, 5, 7]
    assert cut["max_length_q"] == cut["max_length_k"] == 5 and cut["use_cache"] is False
    # a cut on a boundary, and one past the row's end, keep whole sequences only
    assert leading_slice(inputs, 0, 9)["cu_seq_lens_q"].tolist() == [0, 5, 9]
    assert leading_slice(inputs, 0, 40)["cu_seq_lens_q"].tolist() == [0, 5, 9, 15]
    # padded rows: the row, then its positions
    padded = {"input_ids": torch.arange(12).view(3, 4), "attention_mask": torch.ones(3, 4, dtype=torch.long)}
    assert leading_slice(padded, 1, 2)["input_ids"].tolist() == [[4, 5]]
    # an input of a layout it does not know: not cut (the caller keeps the whole micro-batch)
    assert leading_slice({**padded, "extra": torch.zeros(5)}, 0, 2) is None
    assert leading_slice({**inputs, "input_ids": torch.arange(30).view(2, 15)}, 0, 7) is None
    assert leading_slice({**inputs, "cu_seq_lens_q": [0, 5, 9, 15]}, 0, 7) is None  # boundaries it cannot cut
    # a maximum without its boundaries is an ordinary value
    assert leading_slice({"input_ids": torch.arange(15).view(1, 15), "max_length_k": 6}, 0, 7)["max_length_k"] == 6


@pytest.mark.parametrize("front_end", ["loop", "trainer"])
def test_the_allocation_hook_sees_the_logits_of_the_logits_path(front_end, tmp_path):
    """Negative control: with fused_loss=False the same run (shorter rows) holds (tokens x vocab) logits."""
    row_length = 32
    with LargestTensor() as watch:
        _train_large_vocab(front_end, row_length, str(tmp_path), fused_loss=False)
    assert watch.largest >= 2 * row_length * LARGE_VOCAB


# -- where it cannot be proved equal: the logits path, logged once ----------------------------------


def _gemma2(softcapping):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, pad_token_id=PAD, head_dim=8, final_logit_softcapping=softcapping,
                          **TEST_SHAPE)
    return Gemma2ForCausalLM(config).double()


def _cohere():
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    return CohereForCausalLM(CohereConfig(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=2, bos_token_id=1,
                                          logit_scale=0.0625, **TEST_SHAPE)).double()


def _two_micro_batches(step, model, caplog):
    inputs, labels = _batch(random_rows(4, seed=5, prompt_masking=True))
    with caplog.at_level(logging.INFO, logger="hf_accum.fused.loss"):
        for _ in range(2):
            _, loss, n_targets = step(model, inputs, labels)
    reference, reference_n = token_loss_sum(model(**inputs).logits, labels, "causal_lm")
    assert int(n_targets) == int(reference_n)
    torch.testing.assert_close(loss, reference, rtol=1e-13, atol=0)


@pytest.mark.parametrize("factory", [lambda: _gemma2(30.0), _cohere], ids=["gemma2_softcapping", "cohere_logit_scale"])
def test_soft_capped_and_scaled_logits_are_fused_once_proven(factory, caplog):
    """The probe recognises what these models do after their head (tests/unit/test_fused_logit_transforms.py
    has the families' exactness and the probe's negative controls)."""
    step = MicroBatchLoss()
    _two_micro_batches(step, factory().train(), caplog)
    assert step.fused.active and caplog.text.count(FUSED_ON) == 1


def test_gemma2_without_softcapping_is_fused(caplog):
    """Positive control for the probe: the same architecture with a plain head is fused."""
    step = MicroBatchLoss()
    _two_micro_batches(step, _gemma2(None).train(), caplog)
    assert step.fused.active


def test_lora_dropout_on_the_output_layer_keeps_the_logits_path(caplog):
    model = _peft(tiny_causal_lm(), target_modules=["lm_head"], lora_dropout=0.1).train()
    step = MicroBatchLoss()
    inputs, labels = _batch(random_rows(4, seed=5))
    with caplog.at_level(logging.INFO, logger="hf_accum.fused.loss"):
        step(model, inputs, labels)
    assert not step.fused.active and "dropout" in caplog.text


def test_custom_loop_loss_receives_logits_and_is_logged(caplog):
    """A custom loss_sum_fn(outputs, labels, inputs) gets real logits: that run takes the logits path."""
    seen = []

    def loss_sum_fn(outputs, labels, inputs):
        seen.append((tuple(outputs.logits.shape), tuple(inputs["input_ids"].shape)))
        return token_loss_sum(outputs.logits, labels)

    accelerator = fresh_accelerator(2)
    model = tiny_causal_lm()
    loader = DataLoader(random_rows(4, seed=6), batch_size=2, collate_fn=PaddingCollator(PAD))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with caplog.at_level(logging.INFO):
        train(model, optimizer, loader, accelerator, LoopConfig(disable_tqdm=True), loss_sum_fn=loss_sum_fn)
    assert "custom loss_sum_fn" in caplog.text and FUSED_ON not in caplog.text
    assert len(seen) == 2 and all(logits[:2] == ids and logits[2] == VOCAB for logits, ids in seen)


def test_overriding_loss_sum_and_count_is_logged_and_unfused(tmp_path, caplog):
    class SameLossOverridden(AccumTrainer):
        def loss_sum_and_count(self, outputs, labels, inputs):
            return super().loss_sum_and_count(outputs, labels, inputs)

    scenario = Scenario("override", tiny_causal_lm, random_rows(4), PaddingCollator(PAD))
    with caplog.at_level(logging.INFO, logger="hf_accum.trainer"):
        trainer = SameLossOverridden(model=tiny_causal_lm(), args=training_args(scenario, str(tmp_path)),
                              train_dataset=scenario.examples, data_collator=scenario.collator)
    assert trainer._micro_batch_loss.fused is None
    assert "overrides loss_sum_and_count" in caplog.text


# -- bf16: the weight gradient's memory --------------------------------------------------------------


class WeightSizedFp32(TorchDispatchMode):
    """The fp32 storages holding as many elements as the output layer's weight, forward and backward."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.storages = numel, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.numel() == self.numel:
                self.storages.add(tensor.untyped_storage().data_ptr())  # views and in-place ops: one storage
        return out


@pytest.mark.parametrize("chunks", [1, 4, 6])
def test_bf16_weight_gradient_needs_no_fp32_copy_within_four_chunks(chunks):
    """Up to 4 chunks the bf16 weight's gradient is summed in bf16, in place, where autograd hands it to .grad
    (no fp32 copy the weight's size); from the fifth on, in fp32 (the negative control: one copy)."""
    from hf_accum.fused.loss import LOW_PRECISION_CHUNK_FACTOR

    h, head, targets = _head_and_inputs("plain", dtype=torch.bfloat16, rows=24 * LOW_PRECISION_CHUNK_FACTOR,
                                        hidden=16, vocab=300)
    targets = targets.clamp_min(0)  # every row a target: 24 x the factor (each chunk a whole multiple of it)
    rows = int(targets.ne(-100).sum())
    per_chunk = -(-rows // chunks)
    assert per_chunk % LOW_PRECISION_CHUNK_FACTOR == 0 and -(-rows // per_chunk) == chunks  # exactly `chunks` chunks
    chunk_bytes = per_chunk // LOW_PRECISION_CHUNK_FACTOR * 300 * 4
    with WeightSizedFp32(head.weight.numel()) as watch:
        linear_cross_entropy_sum(h, head, targets, chunk_bytes=chunk_bytes).backward()
    assert head.weight.grad.dtype == torch.bfloat16
    assert len(watch.storages) == (0 if chunks <= 4 else 1)


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 200.0), (torch.float64, 1500.0)])
def test_a_target_probability_that_underflows_still_gives_the_exact_loss(dtype, scale):
    """The fast path takes the loss from the target's probability (``-log p_t``); where ``p_t`` underflows (a
    loss above ~87 in fp32, ~745 in fp64) it recomputes those rows' log-sum-exp -- without that, inf."""
    h, head, targets = _head_and_inputs("bias", dtype=dtype, rows=16, hidden=8, vocab=50)
    h = (h.detach() * scale).requires_grad_()
    head64 = LinearHead(head.weight.detach().double(), head.bias.detach().double())
    reference = F.cross_entropy(head64.logits(h.detach().double()), targets, reduction="sum")
    kept = targets.ne(-100)
    probabilities = torch.softmax(head.logits(h.detach()[kept]).detach(), 1).gather(1, targets[kept, None])
    assert (probabilities < torch.finfo(dtype).tiny).any()  # the case is really there
    fused = linear_cross_entropy_sum(h, head, targets)
    assert torch.isfinite(fused)
    assert abs(float(fused) / float(reference) - 1) < 1e-5


def test_a_micro_batch_without_targets_gives_zero_head_gradients_not_uninitialized_memory():
    """The weight's gradient sum is written (not added to) by the first chunk, so it starts uninitialized: with no
    target row no chunk runs, and backward must still hand back zeros."""
    for _ in range(3):  # fresh uninitialized buffers each time: garbage would show in one of them
        h = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
        weight = torch.full((20, 8), 7.0, dtype=torch.float64, requires_grad=True)
        loss = linear_cross_entropy_sum(h, LinearHead(weight), torch.full((6,), -100))
        loss.backward()
        assert float(loss) == 0.0
        assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(h.grad, torch.zeros_like(h))
