"""Fused linear cross-entropy: a causal LM's summed token loss from its last hidden states and its
output layer, without ever holding the ``(tokens x vocab)`` logits.

This module owns the fused loss and the choice between it and the logits path:

1. :func:`linear_cross_entropy_sum` -- the loss. Target positions are processed in chunks; for each
   chunk the logits are computed, the summed cross-entropy taken and, in the same pass, the
   gradients with respect to the hidden states and the head's weights (softmax minus the smoothed
   one-hot target, multiplied back through the head). The loss is a *sum*, so a chunk's gradient is
   final once computed: backward only multiplies the stored gradients by the incoming scalar. One
   chunk's logits exist at a time and no forward is recomputed -- the approach of Liger-Kernel's
   FusedLinearCrossEntropy and Apple's Cut Cross-Entropy. On CUDA with ``liger-kernel`` installed,
   Liger's kernel does the same job (``reduction="sum"``).
2. :func:`resolve_head` -- what a model's output layer computes, as tensors (:class:`LinearHead`):
   ``logits = h W^T + b + scale * (h A^T) B^T``, and then what the model does to those logits
   (:class:`LogitTransform`: a constant scale, a ``c * tanh(z / c)`` soft-cap), folded into each
   chunk's forward and gradient. It knows ``nn.Linear``, PEFT's
   ``ModulesToSaveWrapper`` (the active trainable copy) and PEFT's LoRA ``Linear`` (one adapter,
   dropout off); anything else raises :class:`NotFusable` and the caller keeps the logits path.
3. :class:`FusedCausalLMLoss` -- running a model so that its head *returns the loss*. Why inside the
   model's forward, not by calling the decoder and then the loss: under DDP the forward must go
   through the DDP wrapper (its reducer prepares for backward there), and with
   ``find_unused_parameters=True`` (``Trainer``'s default) every parameter that receives a gradient
   must be reachable from that forward's outputs -- the output layer included. So for one call the
   head module's ``forward`` is replaced by one that computes the loss from the hidden states it is
   given; the model returns it (as a ``[1, 1, 1]`` tensor, through whatever it does to logits) where
   the logits would be, and the loss is taken as the head computed it.

   Before fusing anything, the first micro-batch of a run is *probed* (a short slice, no gradient):
   the head must be called once, on hidden states of every position, its output must equal
   :meth:`LinearHead.logits` of its input, and the model must return that output unchanged or
   transformed exactly as its configuration declares (Gemma 2/3 ``final_logit_softcapping``, Cohere
   ``logit_scale``, Granite ``logits_scaling``), bit for bit. If any of this fails the run keeps the
   logits path and says why, once.
4. :class:`MicroBatchLoss` -- what both front-ends call per micro-batch: the fused path for causal
   LMs while training, the logits path (``hf_accum.loss.token_loss_sum`` or a custom loss) otherwise;
   optionally with :class:`TokenStats` (entropy and arg-max accuracy sums, TRL's metrics) from the
   same chunks.

Sums are taken in :func:`hf_accum.loss.compute_dtype` (at least fp32; fp64 stays fp64), except a bf16
output layer's weight gradient within one chunk, summed in bf16 (see :class:`_GradientSums`); the targets
are the causal ones of :func:`hf_accum.loss.aligned_targets`, so the count is that of
:func:`hf_accum.loss.count_targets`; label smoothing is torch's definition, as in the logits path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from hf_accum.distributed import is_main_process
from hf_accum.loss import (
    DEFAULT_CHUNK_BYTES,
    IGNORE_INDEX,
    LossKind,
    aligned_targets,
    check_label_smoothing,
    compute_dtype,
    count_targets,
    infer_loss_kind,
    loss_kind_spec,
    model_loss_terms,
    probe_model_loss,
    probing,
    resolve_loss_kind,
    rows_per_chunk,
    token_loss_sum,
    unwrap_model,
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
        if self.lora_a is None:
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


# Bytes at a time for the entropy's sum_c exp(x_c) x_c: a small block of rows, so that the extra exp
# it needs adds nothing to the peak (measured: 32 rows at vocab 32000 showed as +0.5% of a
# whole SFT run's peak, 256 KiB as nothing).
_ENTROPY_BLOCK_BYTES = 2**18


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    head: LinearHead,
    targets: torch.Tensor,
    label_smoothing: float = 0.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    stats: TokenStats | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of ``head.model_logits(hidden)`` against ``targets`` (``-100``: no target).

    ``hidden`` is ``[..., H]`` and ``targets`` holds one entry per position of ``hidden`` (already
    aligned: for a causal LM, :func:`hf_accum.loss.aligned_targets`). Returns a 0-dim tensor in
    :func:`~hf_accum.loss.compute_dtype`; its gradient is exact (no recomputation, no approximation).
    ``chunk_bytes`` bounds the chunk's logit buffers, in the loss dtype. ``stats``, when given, gets
    this call's :class:`TokenStats` added (computed from the same chunks: no extra logits).
    """
    check_label_smoothing(label_smoothing)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(hidden.device)
    if flat_hidden.shape[0] != flat_targets.shape[0]:
        raise ValueError(f"{flat_targets.shape[0]} targets for {flat_hidden.shape[0]} hidden positions")
    if stats is None and head.transform == IDENTITY and _use_liger(flat_hidden, head):
        return _liger_loss_sum(flat_hidden, head, flat_targets, label_smoothing)
    vocab = head.weight.shape[0]
    row_bytes = vocab * compute_dtype(head.weight.dtype).itemsize * head.transform.buffers
    chunk_rows = max(1, chunk_bytes // row_bytes)
    return _LinearCrossEntropySum.apply(
        flat_hidden, flat_targets, head.weight, head.bias, head.lora_a, head.lora_b, head.lora_scale,
        label_smoothing, chunk_rows, head.transform, stats,
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
    Rows without a target are never computed (prompt and padding cost nothing here).
    """

    @staticmethod
    def forward(ctx, hidden, targets, weight, bias, lora_a, lora_b, lora_scale, label_smoothing, chunk_rows,
                transform, stats):
        needs = ctx.needs_input_grad
        rows = targets.ne(IGNORE_INDEX).nonzero().squeeze(1)
        accumulators = _GradientSums(hidden, weight, bias, lora_a, lora_b, needs)
        total = torch.zeros((), dtype=compute_dtype(weight.dtype), device=hidden.device)
        chunk_stats = TokenStats.zeros(total.dtype, hidden.device) if stats is not None else None
        for start in range(0, rows.shape[0], chunk_rows):
            chunk = rows[start : start + chunk_rows]
            h = hidden.index_select(0, chunk)
            logits, low_rank_input = _chunk_logits(h, weight, bias, lora_a, lora_b, lora_scale, total.dtype)
            chunk_loss, grad_logits = _loss_and_logit_gradient(
                logits, targets.index_select(0, chunk), label_smoothing, transform, chunk_stats
            )
            total += chunk_loss
            accumulators.add_chunk(chunk, h, grad_logits, low_rank_input, lora_scale)
            del logits, grad_logits  # the next chunk's buffers reuse this memory
        if stats is not None:
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
        return (sums.hidden_grad(grad_total), None, *sums.head_grads(grad_total), None, None, None, None, None)


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
    stats: TokenStats | None,
):
    """Summed loss of a chunk and d(loss)/dz, computed in place in the chunk's buffers (softmax in a
    few passes, no other temporary of the chunk's size; a soft-cap needs a second buffer, which the
    chunk size accounts for). ``stats``, when given, gets the chunk's entropy and arg-max hits added."""
    vocab = z.shape[-1]
    y, tanh = transform.apply_(z)
    picked = y.gather(1, targets[:, None]).squeeze(1)
    smooth_sum = y.sum(1) if label_smoothing else None
    row_max, argmax = y.max(1, keepdim=True)  # argmax: the first maximum, as torch.argmax (TRL) counts ties
    shifted = y.sub_(row_max)
    dot = _exp_dot(shifted) if stats is not None else None
    exp_sum = shifted.exp_().sum(1, keepdim=True)
    log_sum_exp = (row_max + exp_sum.log()).squeeze(1)
    loss = (log_sum_exp - (1.0 - label_smoothing) * picked).sum()
    if smooth_sum is not None:
        loss = loss - label_smoothing / vocab * smooth_sum.sum()
    if stats is not None:
        # entropy = -sum_c p_c log p_c = log S - sum_c e_c x_c / S, with x = y - max, e = exp(x), S = sum e
        stats.entropy_sum += (exp_sum.log() - dot[:, None] / exp_sum).sum()
        stats.top1_hits += argmax.squeeze(1).eq(targets).sum()
    grad = shifted.div_(exp_sum)  # softmax
    grad[torch.arange(grad.shape[0], device=grad.device), targets] -= 1.0 - label_smoothing
    if label_smoothing:
        grad.sub_(label_smoothing / vocab)
    return loss, transform.chain_(grad, tanh)


def _exp_dot(x: torch.Tensor) -> torch.Tensor:
    """``sum_c exp(x_c) * x_c`` per row, a few rows at a time (no temporary of ``x``'s size)."""
    dots = []
    rows = max(1, _ENTROPY_BLOCK_BYTES // (x.shape[1] * x.element_size()))
    for start in range(0, x.shape[0], rows):
        block = x[start : start + rows]
        dots.append(torch.bmm(block.exp().unsqueeze(1), block.unsqueeze(2)).reshape(-1))
    return torch.cat(dots) if dots else x.new_zeros(0)


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
    options = {}
    if "accum_dtype" in inspect.signature(fused).parameters:
        options["accum_dtype"] = torch.float32  # sum the weight gradient over chunks in fp32 (newer Liger)
    return fused(
        hidden.contiguous(), head.weight, targets, bias=head.bias, ignore_index=IGNORE_INDEX,
        label_smoothing=label_smoothing, reduction="sum", **options,
    )


# ----------------------------------------------------------------------------------------------
# The head: what a model's output layer computes
# ----------------------------------------------------------------------------------------------


class NotFusable(Exception):
    """This model's output layer (or what the model does with its output) is not a plain linear map."""


def resolve_head(module: nn.Module) -> LinearHead:
    """The tensors ``module`` computes its logits with; :class:`NotFusable` (with the reason) otherwise."""
    _require_no_hooks(module)
    for cls, resolver in _head_resolvers().items():
        if type(module) is cls:  # exact type: a subclass may override forward
            return resolver(module)
    raise NotFusable(
        f"the output layer is a {type(module).__name__}, not nn.Linear or a PEFT LoRA/modules_to_save wrapper"
    )


def _head_resolvers() -> dict[type, Callable[[nn.Module], LinearHead]]:
    """Module type -> how to read its linear map (one entry per supported kind of output layer)."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.utils.other import ModulesToSaveWrapper

    return {nn.Linear: _plain_linear, ModulesToSaveWrapper: _modules_to_save, LoraLinear: _lora_linear}


def _require_no_hooks(module: nn.Module) -> None:
    if module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__:
        # FSDP2 shards the head and gathers it in a forward pre-hook: the fused pass would read a shard.
        reason = "FSDP shards it (gathered only inside its forward)" if type(module).__name__.startswith("FSDP") \
            else "it has forward hooks or a patched forward"
        raise NotFusable(f"the output layer {type(module).__name__} cannot be read directly: {reason}")


def _plain_linear(module: nn.Linear) -> LinearHead:
    return LinearHead(module.weight, module.bias)


def _modules_to_save(wrapper: nn.Module) -> LinearHead:
    """PEFT's modules_to_save: the active adapter's trainable copy (the frozen original when disabled)."""
    adapters = wrapper.active_adapters
    if wrapper.disable_adapters or not adapters or adapters[0] not in wrapper.modules_to_save:
        return resolve_head(wrapper.original_module)
    return resolve_head(wrapper.modules_to_save[adapters[0]])


def _lora_linear(layer: nn.Module) -> LinearHead:
    """PEFT LoRA on the output layer: ``W x + scale * B A x`` with one active adapter and no dropout."""
    base = resolve_head(layer.get_base_layer())
    if layer.disable_adapters or layer.merged:  # merged: the base weight already holds B A
        return base
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if not active:
        return base
    if len(active) > 1:
        raise NotFusable(f"LoRA on the output layer with {len(active)} active adapters")
    name = active[0]
    dropout = layer.lora_dropout[name]
    if name in getattr(layer, "lora_variant", {}):
        raise NotFusable(f"LoRA variant {type(layer.lora_variant[name]).__name__} on the output layer")
    if not isinstance(dropout, nn.Identity) and not (dropout.p == 0 or not dropout.training):
        raise NotFusable(f"LoRA dropout {dropout.p} on the output layer (the fused head computes dropout-free LoRA)")
    lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
    plain = all(type(matrix) is nn.Linear and matrix.bias is None for matrix in (lora_a, lora_b))
    if not plain:
        raise NotFusable("LoRA matrices of the output layer are not bias-free nn.Linear")
    for part in (lora_a, lora_b, dropout):
        _require_no_hooks(part)
    return LinearHead(base.weight, base.bias, lora_a.weight, lora_b.weight, float(layer.scaling[name]))


# ----------------------------------------------------------------------------------------------
# Running a causal LM with a loss-returning head
# ----------------------------------------------------------------------------------------------


class FusedCausalLMLoss:
    """The fused loss for one training run of one causal LM.

    Call :meth:`forward_loss` per micro-batch: the first call probes the model (see the module
    docstring) and decides, once, whether this run fuses; it returns ``None`` when it does not (the
    caller then takes the logits path) and ``(outputs, loss_sum)`` when it does.
    """

    def __init__(self, label_smoothing: float = 0.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        check_label_smoothing(label_smoothing)
        self.label_smoothing = label_smoothing
        self.chunk_bytes = chunk_bytes
        self.head_module: nn.Module | None = None
        self.transform: LogitTransform = IDENTITY  # what the model does to the head's logits (probed)
        self.reason: str | None = None  # why not fused, once decided
        self._decided = False

    @property
    def active(self) -> bool:
        return self._decided and self.head_module is not None

    def forward_loss(
        self, model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, stats: TokenStats | None = None
    ):
        """``(outputs, loss_sum)`` from one forward whose head returned the summed loss, or None.
        ``stats``, when given, gets the micro-batch's :class:`TokenStats` added."""
        if not self._decided:
            self._decide(model, inputs)
        if self.head_module is None:
            return None
        targets = aligned_targets(labels, "causal_lm")
        # Read per call: the active adapter may change between calls.
        head = dataclasses.replace(resolve_head(self.head_module), transform=self.transform)
        with _head_returns_loss(self.head_module, self._loss_of(head, targets, stats)) as calls:
            outputs = model(**inputs)
        marker = outputs["logits"]
        if len(calls) != 1 or marker.shape != (1, 1, 1):
            raise RuntimeError(
                f"the model called its output layer {len(calls)} times / returned logits of shape "
                f"{tuple(marker.shape)} although the probe saw one plain call; pass fused_loss=False"
            )
        # The loss as the head computed it: what the model returns went through its logit transform
        # (x scale, soft-cap), which applies to the logits, not to a loss. The returned marker still
        # depends on it, so every parameter with a gradient is reachable from the outputs (DDP).
        return outputs, calls[0]

    def disable(self, reason: str) -> None:
        """Decide for the logits path (e.g. a custom loss needs the logits)."""
        self._decided, self.head_module, self.reason = True, None, reason

    def _loss_of(self, head: LinearHead, targets: torch.Tensor, stats: TokenStats | None):
        def loss(hidden: torch.Tensor) -> torch.Tensor:
            if hidden.shape[:-1] != targets.shape:
                raise RuntimeError(f"hidden states {tuple(hidden.shape)} do not match labels {tuple(targets.shape)}")
            return linear_cross_entropy_sum(hidden, head, targets, self.label_smoothing, self.chunk_bytes, stats)

        return loss

    def _decide(self, model: nn.Module, inputs: dict[str, Any]) -> None:
        self._decided = True
        try:
            self.head_module, self.transform = probe_fusable_head(model, inputs)
        except NotFusable as reason:
            self.reason = str(reason)
            if is_main_process():  # every rank decides alike: say it once
                logger.warning("fused linear cross-entropy off, logits path for this run: %s", reason)
            return
        vocab = resolve_head(self.head_module).weight.shape[0]
        if is_main_process():
            logger.info("fused linear cross-entropy on (vocabulary %d, at most %d MiB of logits per chunk%s)",
                        vocab, self.chunk_bytes // 2**20, _describe(self.transform))


def _describe(transform: LogitTransform) -> str:
    steps = [f"{name} {value:g}" for name, value in (("logits x", transform.multiply), ("logits /", transform.divide),
                                                      ("soft-capped at", transform.softcap)) if value is not None]
    return "; " + ", ".join(steps) if steps else ""


def probe_fusable_head(model: nn.Module, inputs: dict[str, Any]) -> tuple[nn.Module, LogitTransform]:
    """The output-layer module to fuse and what the model does to its logits, after checking on a short
    slice of ``inputs`` that the model returns exactly that from every position's hidden state."""
    if isinstance(model, nn.DataParallel):
        raise NotFusable("nn.DataParallel replicates modules per call (use DDP)")
    inner = unwrap_model(model)
    get_head = getattr(inner, "get_output_embeddings", None)
    head_module = get_head() if callable(get_head) else None
    if head_module is None:
        raise NotFusable(f"{type(inner).__name__} has no output embeddings (get_output_embeddings)")
    expected = resolve_head(head_module)
    # Through the model as training calls it (DDP and Accelerate's autocast included); every rank
    # probes its first micro-batch at the same point, so DDP's buffer broadcast stays in step.
    seen = _probe_forward(model, head_module, _probe_slice(inputs))
    if len(seen["calls"]) != 1:
        raise NotFusable(f"the output layer was called {len(seen['calls'])} times in one forward")
    (hidden, head_output), positions = seen["calls"][0], seen["positions"]
    if positions is None or tuple(hidden.shape[:-1]) != positions:
        raise NotFusable("the output layer does not see every position's hidden state")
    _require_equal(
        expected.logits(hidden), head_output, "the output layer computes something other than its linear map"
    )
    returned = seen["logits"]
    if returned is None or returned.dtype.itemsize < head_output.dtype.itemsize:
        raise NotFusable("the model does not return its output layer's logits")
    return head_module, _proven_transform(inner, head_output, returned.to(head_output.dtype))


def _proven_transform(inner: nn.Module, head_output: torch.Tensor, returned: torch.Tensor) -> LogitTransform:
    """What the model does between its output layer and the logits it returns: nothing, or the
    soft-cap / scale its configuration declares -- each accepted only if applying it to the output
    layer's logits gives the returned logits bit for bit (same ops, same order)."""
    if torch.equal(returned, head_output):
        return IDENTITY
    declared = declared_transform(inner)
    if declared != IDENTITY and torch.equal(declared(head_output), returned):
        return declared
    raise NotFusable(
        "the model changes the logits after its output layer in a way the fused loss does not reproduce "
        f"(configured: {_describe(declared).lstrip('; ') or 'nothing'}; e.g. final_logit_softcapping, logit_scale)"
    )


def declared_transform(inner: nn.Module) -> LogitTransform:
    """The logit soft-cap and scale a model's configuration declares (transformers' names: Gemma 2/3
    ``final_logit_softcapping``, Cohere ``logit_scale`` (also a model attribute), Granite
    ``logits_scaling``, which divides); a hypothesis for the probe to prove, never trusted alone."""
    config = getattr(inner, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config

    def number(*owners_and_names) -> float | None:
        for owner, name in owners_and_names:
            value = getattr(owner, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        return None

    return LogitTransform(
        multiply=number((inner, "logit_scale"), (text_config, "logit_scale")),
        divide=number((text_config, "logits_scaling")),
        softcap=number((text_config, "final_logit_softcapping")),
    )


def _probe_forward(model: nn.Module, head_module: nn.Module, inputs: dict[str, Any]) -> dict:
    calls = []

    def record(module, args, output):
        calls.append((args[0].detach(), output.detach()))

    handle = head_module.register_forward_hook(record)
    try:
        with probing(model):
            outputs = model(**inputs)
    finally:
        handle.remove()
    positions = next((tuple(inputs[k].shape[:2]) for k in ("input_ids", "inputs_embeds") if k in inputs), None)
    logits = outputs["logits"] if "logits" in outputs else None
    return {"calls": calls, "positions": positions, "logits": logits}


def _probe_slice(inputs: dict[str, Any]) -> dict[str, Any]:
    """The first row's first positions, when every tensor input is laid out [batch, positions, ...]
    (else the whole micro-batch: correct, only costlier)."""
    reference = inputs.get("input_ids", inputs.get("inputs_embeds"))
    tensors = {k: v for k, v in inputs.items() if torch.is_tensor(v)}
    if reference is None or any(tuple(v.shape[:2]) != tuple(reference.shape[:2]) for v in tensors.values()):
        return dict(inputs)
    return {k: v[:1, :PROBE_POSITIONS] if k in tensors else v for k, v in inputs.items()}


def _require_equal(ours: torch.Tensor, theirs: torch.Tensor, message: str) -> None:
    if ours.shape != theirs.shape:
        raise NotFusable(message)
    tolerance = max(1e-6, 4 * torch.finfo(theirs.dtype).eps) * float(theirs.abs().max().clamp_min(1.0))
    same = bool((ours.to(theirs.dtype) - theirs).abs().max() <= tolerance)
    if not same:
        raise NotFusable(message)


@contextlib.contextmanager
def _head_returns_loss(head_module: nn.Module, loss: Callable[[torch.Tensor], torch.Tensor]):
    """For one forward: the head returns ``loss(hidden_states)`` as a ``[1, 1, 1]`` tensor (the losses
    it computed are in the yielded list)."""
    calls: list[torch.Tensor] = []

    def forward(hidden_states, *args, **kwargs):
        if args or kwargs:
            raise RuntimeError(f"the output layer was called with extra arguments {list(kwargs) or len(args)}")
        calls.append(loss(hidden_states))
        # A copy: a model that transforms its logits in place must not change the loss.
        return calls[-1].reshape(1, 1, 1).clone()

    head_module.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
    try:
        yield calls
    finally:
        del head_module.forward


# ----------------------------------------------------------------------------------------------
# One micro-batch: fused where possible, from the logits otherwise (both front-ends)
# ----------------------------------------------------------------------------------------------

# (outputs, labels, inputs) -> (summed loss, number of targets). Must sum, never average.
LossSumFn = Callable[[Any, torch.Tensor, dict], "tuple[torch.Tensor, torch.Tensor]"]


class MicroBatchLoss:
    """A run's forward and summed loss per micro-batch: ``(outputs, loss_sum, n_targets)``.

    * ``kind`` -- the target layout; None: from the model class, else probed on the first micro-batch
      (:func:`hf_accum.loss.resolve_loss_kind`).
    * ``loss_sum_fn(outputs, labels, inputs)`` -- the loss from the forward's outputs (the logits path);
      None: :func:`hf_accum.loss.token_loss_sum`.
    * ``fused`` -- whether layouts that allow it (causal LMs) may use :class:`FusedCausalLMLoss` while
      training; ``outputs.logits`` then holds the loss, not logits. Pass False when ``loss_sum_fn``
      needs the logits (a custom loss).
    * ``token_stats`` -- also compute each micro-batch's :class:`TokenStats` (entropy, arg-max hits) into
      :attr:`last_token_stats`: inside the fused pass, else from the logits (per-token loss kinds).

    **Terms the model adds to its own loss.** The first micro-batch is probed once
    (:func:`hf_accum.loss.probe_model_loss`): the model's own ``forward(labels=...)`` loss must equal
    the cross-entropy from its logits plus its known terms (:data:`hf_accum.loss.MODEL_LOSS_TERMS`, e.g.
    a MoE router's ``router_aux_loss_coef * aux_loss``), else the run stops naming the model and the
    difference. While training, the known terms are added to the micro-batch's loss *sum* weighted by its
    target count: micro-batch ``k`` (``n_k`` targets, router loss ``aux_k``) adds ``coef * aux_k * n_k``.
    The front-ends divide the update's sum by its ``N`` targets (all micro-batches, all ranks) once, so the
    update minimizes ``CE mean + coef * sum_k (n_k / N) aux_k``: ``coef`` times the token-weighted mean of
    the micro-batches' router losses. Its weight does not grow with K or the number of ranks (stock
    ``Trainer`` adds ``coef * aux_k`` per micro-batch: K times), and when every micro-batch holds the same
    rows it is the big batch's own term exactly. (A load-balancing loss is not a sum over tokens, so no
    accumulation equals a big batch of *different* micro-batches without a pre-pass over the window.)
    :attr:`aux_sum` is the term's detached part of the last training micro-batch's sum (None: none), so
    the front-ends log the cross-entropy and the term apart. Evaluation sums the cross-entropy alone.
    """

    def __init__(
        self,
        kind: LossKind | None = None,
        label_smoothing: float = 0.0,
        problem_type: str | None = None,
        loss_sum_fn: LossSumFn | None = None,
        fused: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        token_stats: bool = False,
    ):
        check_label_smoothing(label_smoothing)
        self.kind = kind
        self.label_smoothing = label_smoothing
        self.problem_type = problem_type
        self.loss_sum_fn = loss_sum_fn or self._token_loss_sum
        self.fused = FusedCausalLMLoss(label_smoothing, chunk_bytes) if fused else None
        self.terms_checked = False
        self.aux_sum: torch.Tensor | None = None
        self.token_stats = token_stats
        self.last_token_stats: TokenStats | None = None

    def __call__(self, model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, need_logits: bool = False):
        if not self.terms_checked:
            self._probe_model_loss(model, inputs, labels)
        if self.kind is None:
            self.kind = resolve_loss_kind(model, inputs, labels)
        outputs, loss_sum, n_targets = self._cross_entropy(model, inputs, labels, need_logits)
        self.aux_sum = None
        terms = model_loss_terms(model, outputs) if model.training else None
        if terms is not None:
            # coef * aux_k * n_k: the update's W / N turns it into the token-weighted mean (class docstring).
            self.aux_sum = terms.to(loss_sum.device, loss_sum.dtype) * torch.as_tensor(
                n_targets, device=loss_sum.device, dtype=loss_sum.dtype
            )
            loss_sum = loss_sum + self.aux_sum
            self.aux_sum = self.aux_sum.detach()
        return outputs, loss_sum, n_targets

    def _cross_entropy(self, model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, need_logits: bool):
        stats = TokenStats.zeros(torch.float64, labels.device) if self.token_stats else None
        self.last_token_stats = stats
        if self._may_fuse(model) and not need_logits:
            fused = self.fused.forward_loss(model, inputs, labels, stats)
            if fused is not None:
                outputs, loss_sum = fused
                return outputs, loss_sum, count_targets(labels, self.kind)
        outputs = model(**inputs)  # no labels: no model-side loss, no wasted (fp32) loss math
        loss_sum, n_targets = self.loss_sum_fn(outputs, labels, inputs)
        if stats is not None and loss_kind_spec(self.kind).per_token:
            stats.add_(logits_token_stats(outputs.logits, labels, self.kind))
        return outputs, loss_sum, n_targets

    def _probe_model_loss(self, model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor) -> None:
        """Once, on the first micro-batch: the layout (when unknown) and no dropped term. Every rank probes
        its first micro-batch (the forward goes through DDP, whose buffer broadcast is a collective); a
        micro-batch without targets has no loss to compare, and is not compared."""
        kind = self.kind
        if kind is None:
            try:
                kind = infer_loss_kind(model)
            except ValueError:
                kind = None  # probe_model_loss finds it from the model's own loss
        self.kind = probe_model_loss(model, inputs, labels, kind).kind
        self.terms_checked = True

    def _may_fuse(self, model: nn.Module) -> bool:
        # Training only: evaluation and prediction want logits, and the fused path computes gradients.
        return (
            self.fused is not None and loss_kind_spec(self.kind).fused and model.training and torch.is_grad_enabled()
        )

    def _token_loss_sum(self, outputs, labels, inputs):
        return token_loss_sum(outputs.logits, labels, self.kind, self.label_smoothing, problem_type=self.problem_type)


@torch.no_grad()
def logits_token_stats(logits: torch.Tensor, labels: torch.Tensor, kind: LossKind = "causal_lm") -> TokenStats:
    """:class:`TokenStats` of a micro-batch from its materialized logits (the logits path's counterpart of
    the fused pass's): entropy ``-sum_c p_c log p_c`` and first-arg-max hits over the prediction targets,
    one chunk of upcast logits at a time. Every position is evaluated and non-targets are masked
    afterwards, so no data-dependent shape forces a host sync."""
    targets = aligned_targets(labels, kind).reshape(-1).to(logits.device)
    flat_logits = logits.detach().reshape(-1, logits.shape[-1])
    is_target = targets.ne(IGNORE_INDEX)
    stats = TokenStats.zeros(compute_dtype(flat_logits.dtype), logits.device)
    stats.targets += is_target.sum()
    rows = rows_per_chunk(flat_logits.shape[-1], flat_logits.dtype)
    for start in range(0, flat_logits.shape[0], rows):
        chunk = flat_logits[start : start + rows].to(compute_dtype(flat_logits.dtype))
        chunk_is_target = is_target[start : start + rows]
        log_p = chunk.log_softmax(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        stats.entropy_sum += entropy.masked_fill(~chunk_is_target, 0).sum()
        stats.top1_hits += (chunk.argmax(-1).eq(targets[start : start + rows]) & chunk_is_target).sum()
    return stats
