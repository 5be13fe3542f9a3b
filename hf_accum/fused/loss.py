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
2. :mod:`hf_accum.fused.head` -- which output layers can be fused (``resolve_head``: what the head computes,
   as tensors, :class:`LinearHead`, and what the model does to its logits, :class:`LogitTransform`),
   proven on the first micro-batch by a probe, and :class:`~hf_accum.fused.head.FusedCausalLMLoss`, which
   runs a model so that its head *returns the loss* (inside the model's forward: DDP's reducer and
   ``find_unused_parameters`` need the head reached from that forward).
3. :mod:`hf_accum.losses.micro_batch` -- :class:`~hf_accum.losses.micro_batch.MicroBatchLoss`, what both front-ends
call per
   micro-batch: the fused path for causal LMs while training, the logits path otherwise, the model's own
   extra loss terms, and optionally :class:`TokenStats` (TRL's metrics) from the same chunks.

Sums are taken in :func:`hf_accum.losses.token_loss.compute_dtype` (at least fp32; fp64 stays fp64), except a bf16
output layer's weight gradient over its first chunks, summed in bf16 (see
:class:`~hf_accum.fused.gradients.GradientSums`); the targets are the causal ones of
:func:`hf_accum.losses.token_loss.aligned_targets`, so the count is that of
:func:`hf_accum.losses.token_loss.count_targets`; label smoothing is torch's definition, as in the logits path.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from hf_accum.fused.gradients import (
    ENTROPY_BLOCK_BYTES,
    ChunkBuffers,
    GradientSums,
    softmax_,
    top1_hits,
    vocab_major,
    xlogx_sum,
)
from hf_accum.losses.token_loss import (
    DEFAULT_CHUNK_BYTES,
    IGNORE_INDEX,
    check_label_smoothing,
    compute_dtype,
)

logger = logging.getLogger(__name__)

# A 2-byte head's chunks on the fast path: three times the rows (``3 * chunk_bytes`` of fp32 logits plus half that
# in the head's dtype: 1152 rows at vocab 128256, 4 chunks at N = 4096). Fewer chunks mean fewer passes over the
# weight-sized gradient sum, the one cost of chunking a bf16 head that grows with N
# (GradientSums._widen_weight_sum); with no fp32 copy of that sum up to 4 chunks, the peak stays below a run
# of smaller chunks that widens it.
LOW_PRECISION_CHUNK_FACTOR = 3

# Rows per chunk are a multiple of this when a chunk holds more: measured at N = 4096, H = 2048, V = 128256, fp32,
# 2 threads (MKL), the chunked GEMMs cost 1.115x / 1.116x the unchunked floor at 384 / 512 rows but 1.146x /
# 1.175x at 341 / 410 rows (docs/measurements.md, section 15).
GEMM_ROW_TILE = 128

# On a CPU, a 4-byte head's chunk (vocab-major, ChunkBuffers) holds at least this many rows under the default budget:
# each chunk passes once more over the weight and over its gradient, and at V = 262144 the 192 MiB budget alone gives
# 128 fp32 rows (32 chunks at N = 4096): 1.32x the three bare GEMMs, against 1.15x / 1.10x with 256 / 384 rows
# (H = 2048, 2 threads; docs/measurements.md, section 15). At V = 128256 the budget already gives 384; above, the
# chunk grows with the vocabulary as the logits path's own memory does (384 MiB at 262144: peak ~0.24x of it).
MIN_CPU_CHUNK_ROWS = 384

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
        def zero(kind: torch.dtype) -> torch.Tensor:
            return torch.zeros((), dtype=kind, device=device)

        return cls(zero(torch.int64), zero(dtype), zero(torch.int64))

    def add_(self, other: TokenStats) -> None:
        self.targets += other.targets.to(self.targets.device)
        self.entropy_sum += other.entropy_sum.to(self.entropy_sum)
        self.top1_hits += other.top1_hits.to(self.top1_hits.device)


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    head: LinearHead,
    targets: torch.Tensor,
    label_smoothing: float = 0.0,
    chunk_bytes: int | None = None,
    stats: TokenStats | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of ``head.model_logits(hidden)`` against ``targets`` (``-100``: no target).

    ``hidden`` is ``[..., H]`` and ``targets`` holds one entry per position of ``hidden`` (already
    aligned: for a causal LM, :func:`hf_accum.losses.token_loss.aligned_targets`). Returns a 0-dim tensor in
    :func:`~hf_accum.losses.token_loss.compute_dtype`; its gradient is exact (no recomputation, no approximation).
    ``chunk_bytes`` bounds the chunk's logit buffers, in the loss dtype (a bf16 head on the fast path: three times,
    :data:`LOW_PRECISION_CHUNK_FACTOR`); ``None``: the default budget (:func:`rows_per_chunk`). ``stats``, when
    given, gets
    this call's :class:`TokenStats` added (computed from the same chunks: no extra logits). ``weights``, when
    given (one per position, like ``targets``), makes it ``sum_t w_t * loss_t``: each target row's loss and
    logit gradient are scaled by its weight (per-sequence normalization, :mod:`hf_accum.losses.sequence_norm`).
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
    fast = _takes_fast_path(flat_hidden, head.weight, head.lora_a, head.transform)
    chunk_rows = rows_per_chunk(head.weight.shape[0], head.weight, head.transform, fast, chunk_bytes)
    options = _ChunkOptions(head.lora_scale, label_smoothing, chunk_rows, head.transform, stats, flat_weights)
    return _LinearCrossEntropySum.apply(
        flat_hidden, flat_targets, head.weight, head.bias, head.lora_a, head.lora_b, options,
    )


def rows_per_chunk(vocab: int, weight: torch.Tensor, transform: LogitTransform, fast_path: bool,
                   chunk_bytes: int | None) -> int:
    """Target rows per chunk for an output layer of ``vocab`` rows (``weight``: its dtype and device):
    ``chunk_bytes`` (``None``: 192 MiB, ``DEFAULT_CHUNK_BYTES``) of logits in the loss dtype; on the fast path a
    2-byte head gets :data:`LOW_PRECISION_CHUNK_FACTOR` times that, and, under the default budget, a 4-byte head on
    a CPU at least :data:`MIN_CPU_CHUNK_ROWS`. A multiple of :data:`GEMM_ROW_TILE` when a chunk holds more."""
    budget = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    rows = max(1, budget // (vocab * compute_dtype(weight.dtype).itemsize * transform.buffers))
    if fast_path and weight.dtype.itemsize < 4:
        rows *= LOW_PRECISION_CHUNK_FACTOR
    elif fast_path and chunk_bytes is None and vocab_major(weight):
        rows = max(rows, MIN_CPU_CHUNK_ROWS)
    if rows >= GEMM_ROW_TILE:
        rows -= rows % GEMM_ROW_TILE
    return rows


@dataclass(frozen=True)
class _ChunkOptions:
    """What :class:`_LinearCrossEntropySum` takes besides the tensors it differentiates (one argument of
    ``apply``): the LoRA scale, the label smoothing, the rows per chunk, the logit transform, the
    :class:`TokenStats` to add to (or ``None``) and the per-row weights (constants, or ``None``)."""

    lora_scale: float
    label_smoothing: float
    chunk_rows: int
    transform: LogitTransform
    stats: TokenStats | None
    row_weights: torch.Tensor | None


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
    def forward(ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None,
                options: _ChunkOptions) -> torch.Tensor:
        lora_scale, label_smoothing, chunk_rows = options.lora_scale, options.label_smoothing, options.chunk_rows
        transform, stats, row_weights = options.transform, options.stats, options.row_weights
        needs = ctx.needs_input_grad
        rows = targets.ne(IGNORE_INDEX).nonzero().squeeze(1)
        accumulators = GradientSums(hidden, weight, bias, lora_a, lora_b, needs)
        total = torch.zeros((), dtype=compute_dtype(weight.dtype), device=hidden.device)
        chunk_stats = TokenStats.zeros(total.dtype, hidden.device) if stats is not None else None
        buffers = None
        if _takes_fast_path(hidden, weight, lora_a, transform) and rows.shape[0]:
            buffers = ChunkBuffers(min(chunk_rows, rows.shape[0]), weight, total.dtype)
        for start in range(0, rows.shape[0], chunk_rows):
            chunk = rows[start : start + chunk_rows]
            h = hidden.index_select(0, chunk)
            chunk_targets = targets.index_select(0, chunk)
            chunk_weights = None if row_weights is None else row_weights.index_select(0, chunk).to(total.dtype)
            low_rank_input = None
            if buffers is not None:
                logits = buffers.logits_of(h, weight, bias)
                chunk_loss, grad_logits = _softmax_loss_and_gradient_(
                    logits, chunk_targets, label_smoothing, chunk_weights, chunk_stats,
                    functools.partial(_row_logits, h, weight, bias))
            else:
                logits, low_rank_input = _chunk_logits(h, weight, bias, lora_a, lora_b, lora_scale, total.dtype)
                chunk_loss, grad_logits = _loss_and_logit_gradient(
                    logits, chunk_targets, label_smoothing, transform, chunk_stats, chunk_weights
                )
            total += chunk_loss
            accumulators.add_chunk(chunk, h, grad_logits, low_rank_input, lora_scale, buffers)
            del logits, grad_logits  # the next chunk's buffers reuse this memory
        if stats is not None and chunk_stats is not None:
            chunk_stats.targets += rows.shape[0]
            stats.add_(chunk_stats)
        ctx.gradients = accumulators
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        sums, ctx.gradients = ctx.gradients, None
        if sums is None:
            raise RuntimeError(
                "the fused linear cross-entropy frees its gradients after one backward; retain_graph=True "
                "is not supported (use the logits path: fused_loss=False)"
            )
        return (sums.hidden_grad(grad_total), None, *sums.head_grads(grad_total), None)


def _takes_fast_path(hidden: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor | None,
                     transform: LogitTransform) -> bool:
    """The common case -- a plain head in the hidden states' dtype, no logit transform, no autocast --
    runs :func:`_softmax_loss_and_gradient_` in reused buffers (:class:`~hf_accum.fused.gradients.ChunkBuffers`);
    the rest the general chunk math (:func:`_loss_and_logit_gradient`)."""
    return (
        lora_a is None and transform == IDENTITY and hidden.dtype == weight.dtype
        and not torch.is_autocast_enabled(hidden.device.type)
    )


def _softmax_loss_and_gradient_(
    y: torch.Tensor, targets: torch.Tensor, label_smoothing: float, row_weights: torch.Tensor | None,
    stats: TokenStats | None, recompute: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast path's chunk math: summed (``row_weights``: weighted) loss and d(loss)/dy, in place in ``y``.

    The softmax is done in place by :func:`~hf_accum.fused.gradients.softmax_` (a row-major chunk: one
    ``torch.softmax(out=y)``, each row's max, exponentials and sum in cache, one read and one write of the chunk; a
    vocab-major one: three passes down the columns) instead of the general path's five (max, subtract, exp, sum,
    divide). The loss comes
    from the target's probability: ``lse - y_t = -log p_t``, so with smoothing ``loss = -log p_t + eps * y_t -
    eps / V * sum_c y_c`` (the same as :func:`_loss_and_logit_gradient`'s). ``-log p_t`` is exact to the dtype's
    precision while ``p_t`` is a normal number; a row whose ``p_t`` underflows (its loss above ~87 in fp32) gets
    its loss from ``lse`` of its logits recomputed by ``recompute(row_indices)`` (its gradient is right as is).
    ``stats``: the arg-max hits from the logits, the entropy ``-sum_c p_c log p_c`` from the probabilities.
    """
    vocab = y.shape[-1]
    picked = y.gather(1, targets[:, None]).squeeze(1)
    smooth_sum = y.sum(1) if label_smoothing else None
    hits = top1_hits(y, targets) if stats is not None else None  # from the logits, before the softmax overwrites them
    probabilities = softmax_(y)
    if stats is not None and hits is not None:
        stats.top1_hits += hits
        stats.entropy_sum -= xlogx_sum(probabilities).sum()
    target_p = probabilities.gather(1, targets[:, None]).squeeze(1)
    row_loss = -target_p.log()
    if smooth_sum is not None:
        row_loss = row_loss + label_smoothing * picked - label_smoothing / vocab * smooth_sum
    underflow = target_p < torch.finfo(y.dtype).tiny
    if bool(underflow.any()):
        rows = underflow.nonzero().squeeze(1)
        exact = recompute(rows).to(y.dtype)
        lse = torch.logsumexp(exact, 1)
        fixed = lse - (1.0 - label_smoothing) * picked[rows]
        if smooth_sum is not None:
            fixed = fixed - label_smoothing / vocab * smooth_sum[rows]
        row_loss[rows] = fixed
    loss = (row_loss if row_weights is None else row_loss * row_weights).sum()
    grad = probabilities
    grad[torch.arange(grad.shape[0], device=grad.device), targets] -= 1.0 - label_smoothing
    if label_smoothing:
        grad.sub_(label_smoothing / vocab)
    if row_weights is not None:
        grad.mul_(row_weights[:, None])
    return loss, grad


def _row_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """Some rows' logits again (the fast path's underflow fallback): the chunk's product, though not necessarily
    rounded as the chunk's GEMM rounded it (a vocab-major chunk computed ``W h^T``). Such a row's loss is above ~87
    (fp32), where a logit's last bit is far below the loss's own precision."""
    return F.linear(h.index_select(0, rows), weight, bias)


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor | None,
    lora_b: torch.Tensor | None, lora_scale: float, loss_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's output-layer logits in the loss dtype, computed with the same ops (and autocast) as
    the head; also ``h A^T`` when the head has a LoRA adapter (its gradients need it)."""
    logits = F.linear(h, weight, bias)
    if lora_a is None:
        return logits.to(loss_dtype), None
    assert lora_b is not None  # a LoRA head carries both factors (LinearHead)
    low_rank_input = F.linear(h.to(lora_a.dtype), lora_a)
    logits = logits.to(loss_dtype) + F.linear(low_rank_input, lora_b).to(loss_dtype) * lora_scale
    return logits, low_rank_input


def _loss_and_logit_gradient(
    z: torch.Tensor, targets: torch.Tensor, label_smoothing: float, transform: LogitTransform,
    stats: TokenStats | None, row_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
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
    """``sum_c exp(x_c) * x_c`` per row, a block of rows at a time (no temporary of ``x``'s size; the general
    path's chunks are row-major).

    One scratch block serves every block of rows (``out=``): a fresh ``exp`` per block left the heap
    fragmented -- each freed block's hole was split by the small tensors allocated after it, so the next
    block took new memory -- and the resident size grew by one block per row block (+0.5 MiB per target at
    vocab 128256: +105 MiB on a 211-target micro-batch, measured by RSS with the mmap threshold fixed)."""
    rows = max(1, min(x.shape[0], ENTROPY_BLOCK_BYTES // (x.shape[1] * x.element_size())))
    dots = x.new_empty(x.shape[0])
    scratch = x.new_empty(rows, x.shape[1])
    for start in range(0, x.shape[0], rows):
        block = x[start : start + rows]
        part = scratch[: block.shape[0]]
        torch.exp(block, out=part)
        part.mul_(block)
        torch.sum(part, dim=1, out=dots[start : start + block.shape[0]])
    return dots


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


def _liger_loss_sum(
    hidden: torch.Tensor, head: LinearHead, targets: torch.Tensor, label_smoothing: float
) -> torch.Tensor:
    fused = _liger_function()
    assert fused is not None  # _use_liger found it
    options = {}
    if "accum_dtype" in inspect.signature(fused).parameters:
        options["accum_dtype"] = torch.float32  # sum the weight gradient over chunks in fp32 (newer Liger)
    return fused(
        hidden.contiguous(), head.weight, targets, bias=head.bias, ignore_index=IGNORE_INDEX,
        label_smoothing=label_smoothing, reduction="sum", **options,
    )

