"""TRL's metrics (``entropy``, ``mean_token_accuracy``) as sums inside the fused loss's chunked pass.

* :class:`~hf_accum.fused.loss.TokenStats` from :func:`~hf_accum.fused.loss.linear_cross_entropy_sum`
  equal TRL's own computation on the full float64 logits (``trl.trainer.utils.entropy_from_logits``,
  ``argmax``) over the prediction targets, with soft-capped logits too, over any chunking; ties count
  the first maximum, as ``argmax`` does (a negative control shows the tie case is really exercised).
* They are sums: over micro-batches they equal the big batch's (exactly for the counts).
* The logits path's :func:`~hf_accum.losses.micro_batch.logits_token_stats` gives the same numbers.
* ``AccumSFTTrainer`` trains on the fused path (log line and state), with TRL's metrics logged, exact.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("trl")

from trl import SFTConfig
from trl.trainer.utils import entropy_from_logits

from hf_accum import AccumSFTTrainer
from hf_accum.fused.loss import (
    LinearHead,
    LogitTransform,
    TokenStats,
    linear_cross_entropy_sum,
)
from hf_accum.losses.micro_batch import MicroBatchLoss, logits_token_stats
from hf_accum.testing import Scenario, run_trainer
from hf_accum.testing.sft import sft_model_factory, sft_rows, sft_tokenizer

EXACT = 1e-10
FUSED_ON = "fused linear cross-entropy on"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _inputs(seed=0, rows=41, hidden=8, vocab=29):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64)
    weight[7] = weight[3]  # classes 3 and 7 always tie: argmax must say 3 (the first maximum)
    h[:10] = weight[3] * 4  # ... and these rows' maximum is that tie
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[:8], targets[8:10] = 3, 7  # hits, and misses only because of the tie rule
    targets[::6] = -100
    return h, LinearHead(weight), targets


def _trl_reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[int, float, int]:
    """TRL's metric sums on the full logits: entropy and argmax hits over the targets."""
    is_target = targets.ne(-100)
    entropy = entropy_from_logits(logits)[is_target].sum()
    hits = logits.argmax(-1)[is_target].eq(targets[is_target]).sum()
    return int(is_target.sum()), float(entropy), int(hits)


def _fused_stats(h, head, targets, chunk_rows=1000) -> TokenStats:
    stats = TokenStats.zeros(torch.float64, "cpu")
    row_bytes = head.weight.shape[0] * 8 * head.transform.buffers
    linear_cross_entropy_sum(h, head, targets, chunk_bytes=chunk_rows * row_bytes, stats=stats)
    return stats


def _as_tuple(stats: TokenStats) -> tuple[int, float, int]:
    return int(stats.targets), float(stats.entropy_sum), int(stats.top1_hits)


def _assert_same(ours: tuple, reference: tuple, rel=1e-12) -> None:
    assert ours[0] == reference[0] and ours[2] == reference[2], (ours, reference)
    assert ours[1] == pytest.approx(reference[1], rel=rel), (ours, reference)


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(softcap=2.0), LogitTransform(divide=3.0)],
                         ids=["plain", "softcap", "scaled"])
@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
def test_fused_stats_equal_trl_on_full_logits(transform, chunk_rows):
    h, head, targets = _inputs()
    head = LinearHead(head.weight, transform=transform)
    reference = _trl_reference(head.model_logits(h), targets)
    _assert_same(_as_tuple(_fused_stats(h, head, targets, chunk_rows)), reference)


def test_ties_are_exercised_and_counted_as_argmax_does():
    """Negative control: counting the *last* maximum instead would change the hits on these rows."""
    h, head, targets = _inputs()
    logits = head.logits(h)
    first = logits.argmax(-1)
    last = logits.shape[-1] - 1 - logits.flip(-1).argmax(-1)
    is_target = targets.ne(-100)
    assert (first != last)[is_target].any()
    hits_if_last = int(last[is_target].eq(targets[is_target]).sum())
    assert int(_fused_stats(h, head, targets).top1_hits) != hits_if_last


def test_stats_are_sums_over_micro_batches():
    h, head, targets = _inputs()
    whole = _fused_stats(h, head, targets, chunk_rows=3)
    parts = TokenStats.zeros(torch.float64, "cpu")
    for rows in torch.tensor_split(torch.arange(h.shape[0]), [9, 10, 30]):
        parts.add_(_fused_stats(h[rows], head, targets[rows], chunk_rows=4))
    assert int(parts.targets) == int(whole.targets) and int(parts.top1_hits) == int(whole.top1_hits)
    assert float(parts.entropy_sum) == pytest.approx(float(whole.entropy_sum), rel=1e-13)


def test_stats_leave_loss_and_gradients_unchanged():
    h, head, targets = _inputs()
    h.requires_grad_()
    weight = head.weight.detach().requires_grad_()
    head = LinearHead(weight)
    plain = linear_cross_entropy_sum(h, head, targets)
    with_stats = linear_cross_entropy_sum(h, head, targets, stats=TokenStats.zeros(torch.float64, "cpu"))
    assert torch.equal(plain, with_stats)
    for a, b in zip(torch.autograd.grad(plain, (h, weight)), torch.autograd.grad(with_stats, (h, weight))):
        assert torch.equal(a, b)


def test_logits_path_stats_equal_the_fused_ones():
    h, head, targets = _inputs()
    labels = F.pad(targets, (1, 0), value=-100)[None]  # causal layout: position i predicts labels[i + 1]
    logits = F.pad(head.logits(h), (0, 0, 0, 1))[None]  # one extra (last) position, which predicts nothing
    _assert_same(_as_tuple(logits_token_stats(logits, labels)), _as_tuple(_fused_stats(h, head, targets)))


def test_stats_over_several_entropy_blocks_equal_trl():
    """A vocabulary wide enough that the entropy's scratch block holds fewer rows than the chunk (64 rows at
    8192 float64 classes; 125 of the 150 rows are targets): two blocks, the last one partial."""
    h, head, targets = _inputs(rows=150, hidden=16, vocab=8192)
    reference = _trl_reference(head.model_logits(h), targets)
    _assert_same(_as_tuple(_fused_stats(h, head, targets)), reference)


class _VocabWideAllocations(TorchDispatchMode):
    """Counts ops that allocate a new tensor at least one vocabulary row wide (views, in-place and ``out=``
    ops reuse memory and are not counted)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        reuses = schema.is_mutable or any(r.alias_info is not None for r in schema.returns)
        if not reuses:
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.numel() >= self.vocab:
                    self.count += 1
        return out


def test_stats_allocate_the_same_temporaries_whatever_the_number_of_targets():
    """The entropy's exp was once a fresh tensor per block of rows: freed and re-allocated between small
    tensors, it fragmented the heap and the resident size grew by a block per block (+105 MiB on one 211-target
    micro-batch at vocab 128256). Its scratch block is now allocated once per chunk."""
    counts = []
    for rows in (40, 400):
        h, head, targets = _inputs(rows=rows, hidden=16, vocab=8192)
        with _VocabWideAllocations(8192) as watch:
            _fused_stats(h, head, targets)
        counts.append(watch.count)
    assert counts[0] == counts[1], counts


# -- AccumSFTTrainer ---------------------------------------------------------------------------------

TOKENIZER = sft_tokenizer()


def test_micro_batch_stats_of_an_sft_model_equal_trl_on_its_logits():
    """The same batch through MicroBatchLoss (fused, with stats) and through the model's own logits."""
    model = sft_model_factory(TOKENIZER)().train()
    rows = [TOKENIZER(" ".join(f"w{(7 * i + j) % 40}" for j in range(5 + 3 * i)))["input_ids"] for i in range(4)]
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [TOKENIZER.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = input_ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100  # a prompt
    step = MicroBatchLoss(token_stats=True)
    step(model, {"input_ids": input_ids, "attention_mask": mask}, labels)
    assert step.fused.active
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask).logits
    reference = _trl_reference(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    _assert_same(_as_tuple(step.last_token_stats), reference)


def _sft_scenario(name, **sft_args):
    rows = sft_rows(20, "prompt_completion", seed=1) if not sft_args.get("packing") else sft_rows(
        40, "prompt_completion", seed=4)
    return Scenario(name, sft_model_factory(TOKENIZER), rows, collator=None, micro_batch=2, accumulation=3,
                    pad_token_id=TOKENIZER.pad_token_id,
                    args={"bf16": False, "activation_checkpointing": False, **sft_args})


@pytest.mark.parametrize("sft_args", [{}, {"padding_free": True, "max_length": None},
                                      {"packing": True, "max_length": 32}], ids=["padded", "padding_free", "packing"])
def test_accum_sft_trainer_takes_the_fused_path_with_trl_metrics(sft_args, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_accum.fused.loss"):
        run = run_trainer(_sft_scenario("fused_sft", **sft_args), str(tmp_path), AccumSFTTrainer, args_cls=SFTConfig,
                          trainer_kwargs={"processing_class": TOKENIZER})
    assert run.trainer._micro_batch_loss.fused.active and FUSED_ON in caplog.text
    assert run.max_error < EXACT, run.errors
    logs = run.update_logs
    assert logs and all(0.0 <= log["mean_token_accuracy"] <= 1.0 and log["entropy"] > 0.0 for log in logs)
