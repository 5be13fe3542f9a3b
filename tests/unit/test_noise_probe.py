"""The every-micro-batch measurement's hooks: each backward's own gradient norm while ``.grad`` accumulates
(float64, exact), a gradient delivered in parts refused, and the mode switch validated."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hf_accum.loop import LoopConfig, LoopConfigError
from hf_accum.measure.noise_probe import GradientInPartsError, MicroBatchGradNorms, micro_batch_grad_sq


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def _own_gradient(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(model(x).square().sum(), list(model.parameters())))


def test_hooks_give_each_backwards_own_gradient_while_grad_accumulates():
    model = _model()
    batches = [torch.randn(rows, 5, dtype=torch.float64) for rows in (2, 5, 3)]  # uneven micro-batches
    own_gradients = [_own_gradient(model, x) for x in batches]  # before the hooks: autograd.grad fires them too
    norms = MicroBatchGradNorms(model.parameters(), "cpu")
    total = [torch.zeros_like(p) for p in model.parameters()]
    for x, own in zip(batches, own_gradients):
        (model(x).square().sum() * 0.25).backward()  # a constant scale, as the front-ends apply
        expected = sum(float(g.square().sum()) for g in own) * 0.25 ** 2
        assert float(norms.take()) == pytest.approx(expected, rel=1e-12)
        total = [t + 0.25 * g for t, g in zip(total, own)]
    for p, t in zip(model.parameters(), total):  # the hooks left the accumulated gradient alone
        torch.testing.assert_close(p.grad, t, rtol=1e-12, atol=0)
    assert float(norms.take()) == 0.0  # nothing since the last take
    model(batches[0]).sum().backward()
    norms.reset()  # a retried window forgets what arrived
    assert float(norms.take()) == 0.0
    norms.remove()
    model(batches[0]).sum().backward()
    assert float(norms.take()) == 0.0  # removed: no hook ran


def test_micro_batch_grad_sq_divides_by_scale_and_targets_and_ignores_empty_micro_batches():
    measured = torch.tensor(36.0, dtype=torch.float64)
    assert float(micro_batch_grad_sq(measured, 0.5, 4, "cpu")) == pytest.approx(36.0 / (0.5 * 4) ** 2)
    assert float(micro_batch_grad_sq(measured, 0.5, 0, "cpu")) == 0.0


def test_a_gradient_in_parts_is_refused():
    """Reentrant checkpointing of a layer used twice: its hook fires once per segment with a partial gradient,
    whose squared norms do not add up to the whole's -- refused, naming the way out."""
    layer = torch.nn.Linear(4, 4).double()
    norms = MicroBatchGradNorms(layer.parameters(), "cpu")
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = checkpoint(layer, checkpoint(layer, x, use_reentrant=True), use_reentrant=True)
    y.sum().backward()
    with pytest.raises(GradientInPartsError, match="noise_scale_micro_batches='first'"):
        norms.take()
    layer(x).sum().backward()  # one piece again: measured
    assert float(norms.take()) > 0


def test_the_mode_must_be_every_or_first():
    assert LoopConfig(noise_scale=True).noise_scale_micro_batches == "every"
    with pytest.raises(LoopConfigError, match="LoopConfig.noise_scale_micro_batches='all'; allowed: every, first"):
        LoopConfig(noise_scale=True, noise_scale_micro_batches="all")
    from hf_accum.trainer import AccumTrainer

    with pytest.raises(ValueError, match=r"AccumTrainer\(noise_scale_micro_batches\)='last'; allowed: every, first"):
        AccumTrainer(noise_scale=True, noise_scale_micro_batches="last")
