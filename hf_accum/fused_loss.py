"""Fused linear cross-entropy: a causal LM's summed token loss from its last hidden states and its
output layer, without ever holding the ``(tokens x vocab)`` logits.

This module owns the fused loss itself; the choice between it and the logits path lives beside it:

1. :func:`linear_cross_entropy_sum` -- the loss. Target positions are processed in chunks; for each
   chunk the logits are computed, the summed cross-entropy taken and, in the same pass, the
   gradients with respect to the hidden states and the head's weights (softmax minus the smoothed
   one-hot target, multiplied back through the head). The loss is a *sum*, so a chunk's gradient is
   final once computed: backward only multiplies the stored gradients by the incoming scalar. One
   chunk's logits exist at a time and no forward is recomputed -- the approach of Liger-Kernel's
   FusedLinearCrossEntropy and Apple's Cut Cross-Entropy. On CUDA with ``liger-kernel`` installed,
   Liger's kernel does the same job (``reduction="sum"``).
2. :mod:`hf_accum.fused_head` -- which output layers can be fused (``resolve_head``: what the head computes,
   as tensors, :class:`LinearHead`, and what the model does to its logits, :class:`LogitTransform`),
   proven on the first micro-batch by a probe, and :class:`~hf_accum.fused_head.FusedCausalLMLoss`, which
   runs a model so that its head *returns the loss* (inside the model's forward: DDP's reducer and
   ``find_unused_parameters`` need the head reached from that forward).
3. :mod:`hf_accum.micro_batch` -- :class:`~hf_accum.micro_batch.MicroBatchLoss`, what both front-ends call per
   micro-batch: the fused path for causal LMs while training, the logits path otherwise, the model's own
   extra loss terms, and optionally :class:`TokenStats` (TRL's metrics) from the same chunks.

Sums are taken in :func:`hf_accum.loss.compute_dtype` (at least fp32; fp64 stays fp64), except a bf16
output layer's weight gradient within one chunk, summed in bf16 (see :class:`_GradientSums`); the targets
are the causal ones of :func:`hf_accum.loss.aligned_targets`, so the count is that of
:func:`hf_accum.loss.count_targets`; label smoothing is torch's definition, as in the logits path.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from hf_accum.loss import (
    DEFAULT_CHUNK_BYTES,
    IGNORE_INDEX,
    check_label_smoothing,
    compute_dtype,
)

logger = logging.getLogger(__name__)

# Positions of the probe forward (one row): enough to see what the model does after its head.
PROBE_POSITIONS = 16


# ----------------------------------------------------------------------------------------------
# The loss
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to its output layer's logits before the loss, elementwise:
    ``y = softcap * tanh(z * multiply / divide / softcap)`` (each step only when set).

    Cohere multiplies (``logit_scale``), Granite divides (``logits_scaling``), Gemma 2/3 soft-cap
    (``final_logit_softcapping``). The ops are applied in the model's own order, so in float64 the
    transformed logits are bit-identical to the model's (the probe checks it).
    """

    multiply: float | None = None
    divide: float | None = None
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's logits from its output layer's (a new tensor; the probe's reference)."""
        return self.apply_(logits.clone())[0]

    def apply_(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(y, t)``: the transformed logits, computed in ``z``'s storage unless soft-capped; for a
        soft-cap also ``t = tanh(.)`` (in ``z``'s storage), which its derivative needs."""
        if self.multiply is not None:
            z.mul_(self.multiply)
        if self.divide is not None:
            z.div_(self.divide)
        if self.softcap is None:
            return z, None
        tanh = z.div_(self.softcap).tanh_()
        return tanh * self.softcap, tanh

    def chain_(self, grad: torch.Tensor, tanh: torch.Tensor | None) -> torch.Tensor:
        """d(loss)/dz from d(loss)/dy, in place in ``grad`` (``tanh`` is overwritten).

        The chain rule through each step: a constant factor for the scale, and for the soft-cap
        d/du [c tanh(u / c)] = 1 - tanh^2(u / c), written with the tanh kept from the forward.
        """
        if tanh is not None:
            grad.mul_(tanh.square_().neg_().add_(1.0))
        if self.multiply is not None:
            grad.mul_(self.multiply)
        if self.divide is not None:
            grad.div_(self.divide)
        return grad

    @property
    def buffers(self) -> int:
        """Chunk-sized logit buffers the chunk math needs (a soft-cap keeps tanh beside the logits)."""
        return 1 if self.softcap is None else 2


IDENTITY = LogitTransform()


@dataclass(frozen=True)
class LinearHead:
    """An output layer as tensors: ``logits = h W^T + b + lora_scale * (h A^T) B^T``, then what the
    model does to them before its loss (``transform``, identity for most models)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    lora_scale: float = 1.0
    transform: LogitTransform = IDENTITY

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer's logits (the probe's reference; training never calls it on all rows)."""
        base = F.linear(hidden, self.weight, self.bias)
        if self.lora_a is None or self.lora_b is None:
            return base
        low_rank = F.linear(F.linear(hidden.to(self.lora_a.dtype), self.lora_a), self.lora_b) * self.lora_scale
        return (base + low_rank).to(base.dtype)

    def model_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits the model's loss sees: :meth:`logits` through ``transform``."""
        return self.transform(self.logits(hidden))


@dataclass
class TokenStats:
    """Per-target statistics of the predicted distribution, as sums (exact across micro-batches and
    ranks when summed): the number of targets, the summed entropy of ``softmax(logits)`` (in the loss
    dtype) and how many targets are the first arg-max of their logits (TRL's ``entropy`` and
    ``mean_token_accuracy`` are ``entropy_sum / targets`` and ``top1_hits / targets``)."""

    targets: torch.Tensor
    entropy_sum: torch.Tensor
    top1_hits: torch.Tensor

    @classmethod
    def zeros(cls, dtype: torch.dtype, device: torch.device | str) -> TokenStats:
        def zero(kind):
            return torch.zeros((), dtype=kind, device=device)

        return cls(zero(torch.int64), zero(dtype), zero(torch.int64))

    def add_(self, other: TokenStats) -> None:
        self.targets += other.targets.to(self.targets.device)
        self.entropy_sum += other.entropy_sum.to(self.entropy_sum)
        self.top1_hits += other.top1_hits.to(self.top1_hits.device)


# Bytes of the one scratch block for the entropy's sum_c exp(x_c) x_c: small beside a chunk's logits
# (4 MiB: 8 rows at vocab 128256, 32 at 32000), large enough that the per-block calls cost nothing.
_ENTROPY_BLOCK_BYTES = 4 * 2**20


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    head: LinearHead,
    targets: torch.Tensor,
    label_smoothing: float = 0.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    stats: TokenStats | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of ``head.model_logits(hidden)`` against ``targets`` (``-100``: no target).

    ``hidden`` is ``[..., H]`` and ``targets`` holds one entry per position of ``hidden`` (already
    aligned: for a causal LM, :func:`hf_accum.loss.aligned_targets`). Returns a 0-dim tensor in
    :func:`~hf_accum.loss.compute_dtype`; its gradient is exact (no recomputation, no approximation).
    ``chunk_bytes`` bounds the chunk's logit buffers, in the loss dtype. ``stats``, when given, gets
    this call's :class:`TokenStats` added (computed from the same chunks: no extra logits). ``weights``, when
    given (one per position, like ``targets``), makes it ``sum_t w_t * loss_t``: each target row's loss and
    logit gradient are scaled by its weight (per-sequence normalization, :mod:`hf_accum.sequence_norm`).
    """
    check_label_smoothing(label_smoothing)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(hidden.device)
    if flat_hidden.shape[0] != flat_targets.shape[0]:
        raise ValueError(f"{flat_targets.shape[0]} targets for {flat_hidden.shape[0]} hidden positions")
    flat_weights = None
    if weights is not None:
        flat_weights = weights.reshape(-1).to(hidden.device)
        if flat_weights.shape != flat_targets.shape:
            raise ValueError(f"{flat_weights.shape[0]} weights for {flat_targets.shape[0]} targets")
    if stats is None and flat_weights is None and head.transform == IDENTITY and _use_liger(flat_hidden, head):
        return _liger_loss_sum(flat_hidden, head, flat_targets, label_smoothing)
    vocab = head.weight.shape[0]
    row_bytes = vocab * compute_dtype(head.weight.dtype).itemsize * head.transform.buffers
    chunk_rows = max(1, chunk_bytes // row_bytes)
    return _LinearCrossEntropySum.apply(
        flat_hidden, flat_targets, head.weight, head.bias, head.lora_a, head.lora_b, head.lora_scale,
        label_smoothing, chunk_rows, head.transform, stats, flat_weights,
    )


class _LinearCrossEntropySum(torch.autograd.Function):
    """Loss and all gradients in one chunked pass; backward scales the stored gradients.

    Per target row with head output ``z``, model logits ``y = T(z)`` (:class:`LogitTransform`),
    target ``t``, smoothing ``eps`` over ``V`` classes (torch's definition:
    ``(1 - eps) * nll + eps * mean_c(-log p_c)``)::

        loss = lse(y) - (1 - eps) * y_t - eps / V * sum_c y_c
        dloss/dy_c = softmax(y)_c - (1 - eps) * [c == t] - eps / V
        dloss/dz_c = dloss/dy_c * T'(z_c)

    and ``dz`` is multiplied back through the head: ``dh = dz W (+ scale * dz B A)``,
    ``dW += dz^T h``, ``db += sum dz``, ``dB += scale * dz^T (h A^T)``, ``dA += scale * (dz B)^T h``.
    Rows without a target are never computed (prompt and padding cost nothing here). With per-row weights
    ``w`` the loss is ``sum_r w_r loss_r`` and each row's ``dloss/dz`` is scaled by ``w_r`` before it goes
    through the head: the weights are constants of the micro-batch (no gradient of their own).
    """

    @staticmethod
    def forward(ctx, hidden, targets, weight, bias, lora_a, lora_b, lora_scale, label_smoothing, chunk_rows,
                transform, stats, row_weights):
        needs = ctx.needs_input_grad
        rows = targets.ne(IGNORE_INDEX).nonzero().squeeze(1)
        accumulators = _GradientSums(hidden, weight, bias, lora_a, lora_b, needs)
        total = torch.zeros((), dtype=compute_dtype(weight.dtype), device=hidden.device)
        chunk_stats = TokenStats.zeros(total.dtype, hidden.device) if stats is not None else None
        for start in range(0, rows.shape[0], chunk_rows):
            chunk = rows[start : start + chunk_rows]
            h = hidden.index_select(0, chunk)
            logits, low_rank_input = _chunk_logits(h, weight, bias, lora_a, lora_b, lora_scale, total.dtype)
            chunk_weights = None if row_weights is None else row_weights.index_select(0, chunk).to(total.dtype)
            chunk_loss, grad_logits = _loss_and_logit_gradient(
                logits, targets.index_select(0, chunk), label_smoothing, transform, chunk_stats, chunk_weights
            )
            total += chunk_loss
            accumulators.add_chunk(chunk, h, grad_logits, low_rank_input, lora_scale)
            del logits, grad_logits  # the next chunk's buffers reuse this memory
        if stats is not None and chunk_stats is not None:
            chunk_stats.targets += rows.shape[0]
            stats.add_(chunk_stats)
        ctx.gradients = accumulators
        return total

    @staticmethod
    def backward(ctx, grad_total):
        sums, ctx.gradients = ctx.gradients, None
        if sums is None:
            raise RuntimeError(
                "the fused linear cross-entropy frees its gradients after one backward; retain_graph=True "
                "is not supported (use the logits path: fused_loss=False)"
            )
        return (sums.hidden_grad(grad_total), None, *sums.head_grads(grad_total), None, None, None, None, None,
                None)


def _chunk_logits(h, weight, bias, lora_a, lora_b, lora_scale, loss_dtype):
    """One chunk's output-layer logits in the loss dtype, computed with the same ops (and autocast) as
    the head; also ``h A^T`` when the head has a LoRA adapter (its gradients need it)."""
    logits = F.linear(h, weight, bias)
    if lora_a is None:
        return logits.to(loss_dtype), None
    low_rank_input = F.linear(h.to(lora_a.dtype), lora_a)
    logits = logits.to(loss_dtype) + F.linear(low_rank_input, lora_b).to(loss_dtype) * lora_scale
    return logits, low_rank_input


def _loss_and_logit_gradient(
    z: torch.Tensor, targets: torch.Tensor, label_smoothing: float, transform: LogitTransform,
    stats: TokenStats | None, row_weights: torch.Tensor | None = None,
):
    """Summed (``row_weights``: weighted) loss of a chunk and d(loss)/dz, computed in place in the chunk's
    buffers (softmax in a few passes, no other temporary of the chunk's size; a soft-cap needs a second buffer,
    which the chunk size accounts for). ``stats``, when given, gets the chunk's entropy and arg-max hits added
    (unweighted: TRL's per-target means)."""
    vocab = z.shape[-1]
    y, tanh = transform.apply_(z)
    picked = y.gather(1, targets[:, None]).squeeze(1)
    smooth_sum = y.sum(1) if label_smoothing else None
    row_max, argmax = y.max(1, keepdim=True)  # argmax: the first maximum, as torch.argmax (TRL) counts ties
    shifted = y.sub_(row_max)
    dot = _exp_dot(shifted) if stats is not None else None
    exp_sum = shifted.exp_().sum(1, keepdim=True)
    log_sum_exp = (row_max + exp_sum.log()).squeeze(1)
    row_loss = log_sum_exp - (1.0 - label_smoothing) * picked
    if smooth_sum is not None:
        row_loss = row_loss - label_smoothing / vocab * smooth_sum
    loss = (row_loss if row_weights is None else row_loss * row_weights).sum()
    if stats is not None and dot is not None:
        # entropy = -sum_c p_c log p_c = log S - sum_c e_c x_c / S, with x = y - max, e = exp(x), S = sum e
        stats.entropy_sum += (exp_sum.log() - dot[:, None] / exp_sum).sum()
        stats.top1_hits += argmax.squeeze(1).eq(targets).sum()
    grad = shifted.div_(exp_sum)  # softmax
    grad[torch.arange(grad.shape[0], device=grad.device), targets] -= 1.0 - label_smoothing
    if label_smoothing:
        grad.sub_(label_smoothing / vocab)
    if row_weights is not None:
        grad.mul_(row_weights[:, None])  # d(w_r loss_r)/dy = w_r dloss_r/dy; T'(z) is applied after, per element
    return loss, transform.chain_(grad, tanh)


def _exp_dot(x: torch.Tensor) -> torch.Tensor:
    """``sum_c exp(x_c) * x_c`` per row, a block of rows at a time (no temporary of ``x``'s size).

    One scratch block serves every block of rows (``out=``): a fresh ``exp`` per block left the heap
    fragmented -- each freed block's hole was split by the small tensors allocated after it, so the next
    block took new memory -- and the resident size grew by one block per row block (+0.5 MiB per target at
    vocab 128256: +105 MiB on a 211-target micro-batch, measured by RSS with the mmap threshold fixed)."""
    rows = max(1, min(x.shape[0], _ENTROPY_BLOCK_BYTES // (x.shape[1] * x.element_size())))
    dots = x.new_empty(x.shape[0])
    scratch = x.new_empty(rows, x.shape[1])
    for start in range(0, x.shape[0], rows):
        block = x[start : start + rows]
        part = scratch[: block.shape[0]]
        torch.exp(block, out=part)
        part.mul_(block)
        torch.sum(part, dim=1, out=dots[start : start + block.shape[0]])
    return dots


# Rows of the weight gradient per matmul when its product cannot run in place (autocast, mixed
# dtypes): bounds the temporary to a slice instead of the weight's size.
_WEIGHT_SLICE_BYTES = 32 * 2**20


class _GradientSums:
    """The gradients of the summed loss, summed over chunks (the matmuls run in the head's own dtype,
    as autograd would run them); rounded to each input's dtype once, in backward.

    Where they are summed: the hidden states' gradient and the small head tensors (bias, LoRA) in at
    least fp32. The output layer's weight gradient -- the one tensor as large as the weight -- starts
    in the weight's own dtype, i.e. in the tensor autograd hands to ``.grad``: a micro-batch that fits
    one chunk (512 positions at a 128k vocabulary) gets autograd's result with no copy at all (an fp32
    copy of a bf16 weight's gradient would triple the memory the weight's gradient needs; where a
    front-end accumulates bf16 gradients in fp32 over a window it keeps that sum itself:
    :class:`hf_accum.accumulation.Fp32GradientAccumulator`). From a bf16 micro-batch's second chunk
    on, the chunks are summed in fp32 (summed in bf16, 4 chunks added ~11% and 16 chunks ~40% to the
    head's bf16 gradient error, measured): that costs one fp32 buffer the weight's size, only while
    the micro-batch is larger than a chunk -- when a full-logits loss would hold several times more.
    """

    def __init__(self, hidden, weight, bias, lora_a, lora_b, needs_input_grad):
        def zeros_if(needed: bool, like: torch.Tensor | None, dtype=None):
            if not needed or like is None:
                return None
            return torch.zeros_like(like, dtype=dtype or compute_dtype(like.dtype))

        self.dtypes = [t.dtype if t is not None else None for t in (hidden, weight, bias, lora_a, lora_b)]
        self.weight, self.lora_a, self.lora_b = weight, lora_a, lora_b
        self.hidden = zeros_if(needs_input_grad[0], hidden)
        self._chunks_added = 0
        self.head = [
            zeros_if(needs_input_grad[2], weight, weight.dtype),
            *[zeros_if(needs_input_grad[i], t) for i, t in zip((3, 4, 5), (bias, lora_a, lora_b))],
        ]

    def add_chunk(self, rows, h, grad_logits, low_rank_input, lora_scale) -> None:
        self._widen_weight_sum()
        grad_weight, grad_bias, grad_a, grad_b = self.head
        base = grad_logits.to(self.weight.dtype) if grad_logits.dtype != self.weight.dtype else grad_logits
        if self.hidden is not None:
            self.hidden.index_copy_(0, rows, torch.mm(base, self.weight).to(self.hidden.dtype))
        if grad_weight is not None:
            _add_product_(grad_weight, base.t(), h.to(self.weight.dtype))
        if grad_bias is not None:
            grad_bias.add_(grad_logits.sum(0))
        del base
        if self.lora_a is None:
            return
        low = grad_logits.to(self.lora_b.dtype)
        grad_low_rank_input = torch.mm(low, self.lora_b) * lora_scale  # d loss / d (h A^T)
        if self.hidden is not None:
            self.hidden.index_add_(0, rows, torch.mm(grad_low_rank_input, self.lora_a).to(self.hidden.dtype))
        if grad_b is not None:
            _add_product_(grad_b, low.t(), low_rank_input * lora_scale)
        if grad_a is not None:
            _add_product_(grad_a, grad_low_rank_input.t(), h.to(self.lora_a.dtype))

    def _widen_weight_sum(self) -> None:
        """Before a second chunk is added: a low-precision weight's gradient sum moves to fp32."""
        grad_weight = self.head[0]
        if self._chunks_added == 1 and grad_weight is not None and grad_weight.dtype.itemsize < 4:
            self.head[0] = grad_weight.to(compute_dtype(grad_weight.dtype))  # the bf16 partial is freed
        self._chunks_added += 1

    def hidden_grad(self, grad_total: torch.Tensor) -> torch.Tensor | None:
        return _scaled(self.hidden, grad_total, self.dtypes[0])

    def head_grads(self, grad_total: torch.Tensor) -> list[torch.Tensor | None]:
        return [_scaled(g, grad_total, dtype) for g, dtype in zip(self.head, self.dtypes[1:])]


def _add_product_(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` without a temporary the size of ``total``: in place when the dtypes allow it,
    else (a bf16 / autocast matmul summed into a wider total) a slice of ``total``'s rows at a time."""
    if total.dtype == a.dtype == b.dtype and not torch.is_autocast_enabled(total.device.type):
        total.addmm_(a, b)
        return
    rows = max(1, _WEIGHT_SLICE_BYTES // max(1, total.shape[1] * total.element_size()))
    for start in range(0, total.shape[0], rows):
        total[start : start + rows].add_(torch.mm(a[start : start + rows], b))


def _scaled(grad: torch.Tensor | None, grad_total: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``grad * d(output)/d(loss)``, in place in the sum, then rounded once to the input's dtype (a no-op
    for the weight gradient, summed in the weight's dtype)."""
    if grad is None:
        return None
    # A bf16 sum is multiplied by the fp32 scalar in fp32 arithmetic and rounded once (x * 1 stays x).
    return grad.mul_(grad_total.to(grad.dtype) if grad.dtype.itemsize >= 4 else grad_total).to(dtype)


# -- CUDA: Liger-Kernel -------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _liger_function() -> Callable | None:
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return liger_fused_linear_cross_entropy


def _use_liger(hidden: torch.Tensor, head: LinearHead) -> bool:
    """Liger's Triton kernel: CUDA, a plain (non-LoRA) head, and at most fp32 (fp64 must stay fp64)."""
    return (
        hidden.is_cuda and head.lora_a is None and hidden.dtype != torch.float64 and _liger_function() is not None
    )


def _liger_loss_sum(hidden, head: LinearHead, targets, label_smoothing: float) -> torch.Tensor:
    fused = _liger_function()
    assert fused is not None  # _use_liger found it
    options = {}
    if "accum_dtype" in inspect.signature(fused).parameters:
        options["accum_dtype"] = torch.float32  # sum the weight gradient over chunks in fp32 (newer Liger)
    return fused(
        hidden.contiguous(), head.weight, targets, bias=head.bias, ignore_index=IGNORE_INDEX,
        label_smoothing=label_smoothing, reduction="sum", **options,
    )


# Moved to their own modules (the head probe, the per-micro-batch loss); importable from here as before.
_MOVED = {
    "NotFusable": "fused_head", "resolve_head": "fused_head", "FusedCausalLMLoss": "fused_head",
    "probe_fusable_head": "fused_head", "declared_transform": "fused_head",
    "MicroBatchLoss": "micro_batch", "LossSumFn": "micro_batch", "logits_token_stats": "micro_batch",
}


def __getattr__(name: str):
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_accum.fused_loss' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"hf_accum.{module}"), name)
