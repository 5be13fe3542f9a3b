"""The CUDA path of the fused loss: Liger-Kernel's fused linear cross-entropy (``reduction="sum"``)
behind :func:`hf_accum.fused.loss.linear_cross_entropy_sum`. Runs where CUDA and ``liger-kernel``
exist (``pip install -e ".[liger]"``); skipped, with the reason, elsewhere -- the development machine
has no GPU, so these tests were not run there."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import hf_accum.fused.loss as fused_loss
from hf_accum.fused.loss import LinearHead, linear_cross_entropy_sum


def _why_skipped() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device: the Liger-Kernel path of the fused loss is not exercised here"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install -e '.[liger]')"
    return None


pytestmark = pytest.mark.skipif(_why_skipped() is not None, reason=_why_skipped() or "")


def _inputs(dtype, rows=300, hidden=64, vocab=5000, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64) * 0.1
    b = torch.randn(vocab, generator=generator, dtype=torch.float64) if bias else None
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[::5] = -100
    cuda = [t.to("cuda", dtype).requires_grad_() if t is not None else None for t in (h, weight, b)]
    return cuda, targets.cuda()


def _grads(loss, tensors):
    return torch.autograd.grad(loss * 2.0, [t for t in tensors if t is not None])


@pytest.fixture
def liger_calls(monkeypatch):
    calls = []
    real = fused_loss._liger_function()

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_loss, "_liger_function", lambda: counting)
    return calls


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
def test_liger_sum_equals_torch_in_fp32(liger_calls, smoothing, bias):
    (h, weight, b), targets = _inputs(torch.float32, bias=bias)
    loss = linear_cross_entropy_sum(h, LinearHead(weight, b), targets, smoothing)
    assert len(liger_calls) == 1 and liger_calls[0]["reduction"] == "sum"
    reference = F.cross_entropy(F.linear(h.double(), weight.double(), None if b is None else b.double()),
                                targets, reduction="sum", label_smoothing=smoothing)
    torch.testing.assert_close(loss.double(), reference, rtol=1e-5, atol=0)
    ours = _grads(loss, (h, weight, b))
    theirs = _grads(reference, (h, weight, b))
    for a, r in zip(ours, theirs):
        assert float((a.double() - r).abs().max() / r.abs().max()) < 1e-4


def test_float64_and_lora_heads_keep_the_torch_path(liger_calls):
    (h, weight, b), targets = _inputs(torch.float64)
    loss = linear_cross_entropy_sum(h, LinearHead(weight, b), targets)
    assert not liger_calls and loss.dtype == torch.float64  # fp64 stays fp64
    reference = F.cross_entropy(F.linear(h, weight, b), targets, reduction="sum")
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=0)
    lora_a = torch.randn(4, h.shape[1], device="cuda", requires_grad=True)
    lora_b = torch.randn(weight.shape[0], 4, device="cuda", requires_grad=True)
    (h32, w32, b32), _ = _inputs(torch.float32)
    linear_cross_entropy_sum(h32, LinearHead(w32.detach(), b32, lora_a, lora_b, 0.5), targets)
    assert not liger_calls  # Liger has no LoRA head: the torch path runs on CUDA too
