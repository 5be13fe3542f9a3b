"""The fused linear cross-entropy's chunk buffers, their softmax, and the gradient sums (:mod:`hf_accum.fused.loss`
owns the loss).

:class:`ChunkBuffers` -- the ``[chunk rows, vocab]`` buffers every chunk reuses: the logits in the loss dtype and,
for a low-precision head, the same logits (then the logit gradient) in the head's dtype, the operand of its GEMMs;
on a CPU a head in the loss dtype keeps them vocab-major (``[vocab, rows]``, the faster GEMM), and
:func:`softmax_`, :func:`top1_hits` and :func:`xlogx_sum` run on either layout.
A fresh chunk-sized tensor per chunk costs more than the softmax over it: the allocator hands blocks that large
back to the OS when they are freed, so every chunk page-faults its buffers in again (a bf16 ``[512, 128256]``
upcast measured 0.75 s fresh against 0.13 s into a reused buffer, on this 2-core CPU under load).

:class:`GradientSums` -- the gradients of the summed loss, summed over chunks: the hidden states' gradient and the
small head tensors (bias, LoRA) in at least fp32; the output layer's weight gradient in the weight's own dtype,
in place (``addmm_``), widened to fp32 after a low-precision micro-batch's first
:data:`LOW_PRECISION_INPLACE_CHUNKS` chunks (the reason is on :meth:`GradientSums._widen_weight_sum`).
"""

from __future__ import annotations

import torch

from hf_accum.losses.token_loss import compute_dtype

# Chunks a low-precision weight's gradient is summed over in its own dtype, in place, before the sum moves to fp32
# (the measurement is on GradientSums._widen_weight_sum).
LOW_PRECISION_INPLACE_CHUNKS = 4

# Bytes of the one scratch block for the entropy's sums over a chunk (xlogx_sum; the general path's
# sum_c exp(x_c) x_c): small beside a chunk's logits (4 MiB: 8 rows at vocab 128256, 32 at 32000), large enough
# that the per-block calls cost nothing.
ENTROPY_BLOCK_BYTES = 4 * 2**20

# Bytes of a vocab-major chunk's softmax block (softmax_): [256, 384] fp32 rows at a time stay in cache (256 and
# 1024 rows per block measured the same, 64 slower: more calls).
_SOFTMAX_BLOCK_BYTES = 384 * 2**10

# Rows of the weight gradient per matmul when its product cannot be summed in place (a bf16 product into the
# fp32 sum): bounds the product's buffer to a slice of the weight's rows instead of the weight's size.
WEIGHT_SLICE_BYTES = 32 * 2**20


def vocab_major(weight: torch.Tensor) -> bool:
    """Whether the fast path keeps this output layer's chunks vocab-major (:class:`ChunkBuffers`): on a CPU, a head
    in its own loss dtype (fp32, fp64). The one place that decides it: the buffers' layout and the chunk's size
    (:func:`hf_accum.fused.loss.rows_per_chunk`) both ask here."""
    return weight.device.type == "cpu" and weight.dtype == compute_dtype(weight.dtype)


def _block_rows(columns: torch.Tensor, block_bytes: int) -> int:
    """Rows of a ``[V, rows]`` chunk in one block of ``block_bytes`` (at least one, at most all)."""
    return max(1, min(columns.shape[0], block_bytes // (columns.shape[1] * columns.element_size())))


class ChunkBuffers:
    """The chunk's logit buffers, allocated once per call (``rows`` = the largest chunk) and reused by each chunk.

    On a CPU, a head in the loss dtype (fp32, fp64) keeps its chunk *vocab-major*: the logits GEMM writes
    ``W h^T`` (``[vocab, rows]``) and the chunk is handed on as its transpose, a ``[rows, vocab]`` view. Why: MKL
    runs the row-major product ``h W^T`` of a few hundred rows ~20% slower than the unchunked one (the weight is
    the packed "A" operand of every chunk's call), while ``W h^T`` runs at the unchunked speed -- measured at
    N = 4096, H = 2048, V = 128256, fp32, 2 threads, 384-row chunks: 8.6-9.0 s against 7.4 s for the logits
    GEMMs of one loss step; the hidden- and weight-gradient GEMMs take the transposed view at their usual speed.
    The softmax then runs down the columns (:func:`softmax_`).
    """

    def __init__(self, rows: int, weight: torch.Tensor, loss_dtype: torch.dtype):
        vocab = weight.shape[0]
        self.vocab_major = vocab_major(weight)
        if self.vocab_major:
            # One flat buffer: a chunk of n rows views its first n * vocab elements as a contiguous [vocab, n].
            self.logits = weight.new_empty(rows * vocab, dtype=loss_dtype)
        else:
            self.logits = weight.new_empty(rows, vocab, dtype=loss_dtype)
        # A head in the loss dtype (fp32, fp64) multiplies straight into the loss buffer; a bf16 head into its own.
        self.operand = self.logits if weight.dtype == loss_dtype else weight.new_empty(rows, vocab)

    def logits_of(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``h W^T + b`` in the loss dtype, in the reused buffer. Row-major: the ops ``F.linear`` runs (``mm``, or
        ``addmm`` with a bias), into the head-dtype buffer, then upcast once (a bf16 head). Vocab-major (a head in
        the loss dtype): ``W h^T + b`` into a contiguous ``[vocab, rows]`` block, returned as its transpose."""
        rows = h.shape[0]
        if self.vocab_major:
            columns = self.logits[: rows * weight.shape[0]].view(weight.shape[0], rows)
            if bias is None:
                torch.mm(weight, h.t(), out=columns)
            else:
                torch.addmm(bias[:, None], weight, h.t(), out=columns)
            return columns.t()
        product = self.operand[:rows]
        if bias is None:
            torch.mm(h, weight.t(), out=product)
        else:
            torch.addmm(bias, h, weight.t(), out=product)
        logits = self.logits[:rows]
        if product is not logits:
            logits.copy_(product)
        return logits

    def operand_of(self, grad_logits: torch.Tensor) -> torch.Tensor:
        """The logit gradient in the head's dtype (rounded once, into the head-dtype buffer): what its GEMMs take."""
        if self.operand is self.logits:  # a head in the loss dtype: the gradient is already in its buffer
            return grad_logits
        return self.operand[: grad_logits.shape[0]].copy_(grad_logits)


# ----------------------------------------------------------------------------------------------
# The fast path's softmax and entropy, on either chunk layout
# ----------------------------------------------------------------------------------------------


def softmax_(y: torch.Tensor) -> torch.Tensor:
    """``softmax(y, dim=1)`` in place in ``y`` (``[rows, V]``); ``y`` may be the transposed view of a contiguous
    ``[V, rows]`` chunk (:class:`ChunkBuffers`' vocab-major layout).

    A row-major ``y``: one ``torch.softmax(out=)``. A vocab-major one: torch's softmax down the columns takes 5x the
    row-wise time (0.12 s against 0.025 s on ``[128256, 384]`` fp32, 2 threads) and is less exact (9e-5 absolute
    against a float64 softmax, where this is 1e-7), so it is done in three passes: the column maxima, then the
    exponentials and their sums a block of vocabulary rows at a time (a block in cache: one read and one write of
    the chunk), then the scaling (0.068 s in all).
    """
    if y.stride(1) == 1:
        return torch.softmax(y, 1, out=y)
    columns = y.t()
    maxima = columns.amax(0)
    sums = torch.zeros_like(maxima)
    block = _block_rows(columns, _SOFTMAX_BLOCK_BYTES)
    for start in range(0, columns.shape[0], block):
        part = columns[start : start + block]
        sums += part.sub_(maxima).exp_().sum(0)
    columns.mul_(sums.reciprocal_())
    return y


def top1_hits(y: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many rows of ``y`` (``[rows, V]`` logits, either layout) have their target as the *first* maximum, as
    ``torch.argmax`` (TRL's accuracy) counts ties.

    Vocab-major: torch's ``argmax`` down the columns takes ~4x the row-wise time (0.23 s against 0.06 s on
    ``[128256, 384]`` fp32, 2 threads), while ``amax`` runs at one read of the chunk. So: a row is a hit when its
    target attains the row's maximum and nothing else does; a row whose maximum is attained more than once (a tie:
    rare, e.g. tied output rows) gets its first maximum's index looked up alone. A chunk with a NaN logit (its loss
    is NaN already) takes torch's ``argmax``, for which NaN is the maximum."""
    if y.stride(1) == 1:
        return y.argmax(1).eq(targets).sum()
    columns = y.t()
    maxima = columns.amax(0)
    if bool(maxima.isnan().any()):
        return columns.argmax(0).eq(targets).sum()
    attained = torch.zeros(columns.shape[1], dtype=torch.int64, device=y.device)
    block = _block_rows(columns, _SOFTMAX_BLOCK_BYTES)
    scratch = torch.empty(block, columns.shape[1], dtype=torch.bool, device=y.device)
    for start in range(0, columns.shape[0], block):  # one scratch block: no fresh tensor per block (xlogx_sum)
        part = columns[start : start + block]
        attained += torch.eq(part, maxima, out=scratch[: part.shape[0]]).sum(0)
    hits = y.gather(1, targets[:, None]).squeeze(1).eq(maxima)
    for row in (hits & attained.gt(1)).nonzero().flatten().tolist():  # a tie: hit only if the target comes first
        hits[row] = bool(columns[:, row].argmax() == targets[row])  # one column: no chunk-sized temporary
    return hits.sum()


def xlogx_sum(p: torch.Tensor) -> torch.Tensor:
    """``sum_c p_c log p_c`` per row of ``p`` (``[rows, V]``, either layout; ``0 log 0 = 0``), a block at a time
    into one scratch block: a fresh ``xlogy`` per block left the heap fragmented -- each freed block's hole was
    split by the small tensors allocated after it, so the next block took new memory -- and the resident size
    grew by one block per block (see :func:`hf_accum.fused.loss._exp_dot`)."""
    if p.stride(1) != 1:  # vocab-major: blocks of vocabulary rows of the contiguous [V, rows] chunk
        columns = p.t()
        block = _block_rows(columns, ENTROPY_BLOCK_BYTES)
        scratch = columns.new_empty(block, columns.shape[1])
        sums = columns.new_zeros(columns.shape[1])
        for start in range(0, columns.shape[0], block):
            part = columns[start : start + block]
            sums += torch.special.xlogy(part, part, out=scratch[: part.shape[0]]).sum(0)
        return sums
    rows = max(1, min(p.shape[0], ENTROPY_BLOCK_BYTES // (p.shape[1] * p.element_size())))
    sums = p.new_empty(p.shape[0])
    scratch = p.new_empty(rows, p.shape[1])
    for start in range(0, p.shape[0], rows):
        row_block = p[start : start + rows]
        part = torch.special.xlogy(row_block, row_block, out=scratch[: row_block.shape[0]])
        torch.sum(part, dim=1, out=sums[start : start + row_block.shape[0]])
    return sums


# ----------------------------------------------------------------------------------------------
# The gradient sums
# ----------------------------------------------------------------------------------------------


class GradientSums:
    """The gradients of the summed loss, summed over chunks (the matmuls run in the head's own dtype, as autograd
    would run them); rounded to each input's dtype once, in backward.

    The output layer's weight gradient -- the one tensor as large as the weight -- starts in the weight's own
    dtype, i.e. in the tensor autograd hands to ``.grad``: a micro-batch of a few chunks needs no copy at all (an
    fp32 copy of a bf16 weight's gradient would triple the memory the weight's gradient needs; where a front-end
    accumulates bf16 gradients in fp32 over a window it keeps that sum itself:
    :class:`hf_accum.accumulation.Fp32GradientAccumulator`).
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 lora_a: torch.Tensor | None, lora_b: torch.Tensor | None, needs_input_grad: tuple[bool, ...]):
        def zeros_if(needed: bool, like: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
            if not needed or like is None:
                return None
            return torch.zeros_like(like, dtype=dtype or compute_dtype(like.dtype))

        self.dtypes = [t.dtype if t is not None else None for t in (hidden, weight, bias, lora_a, lora_b)]
        self.weight, self.lora_a, self.lora_b = weight, lora_a, lora_b
        self.hidden = zeros_if(needs_input_grad[0], hidden)
        self._chunks_added = 0
        self._slice: torch.Tensor | None = None  # the product buffer of a widened weight sum (allocated once)
        # The weight's gradient sum is written, not added to, by the first chunk (no zero-filling pass over a
        # weight-sized tensor: 1 GiB at vocab 128256 x hidden 2048 in fp32); under autocast its products may
        # differ in dtype, so it starts at zero there.
        self._weight_sum_unwritten = needs_input_grad[2] and not torch.is_autocast_enabled(weight.device.type)
        first_weight_sum = torch.empty_like(weight) if self._weight_sum_unwritten else zeros_if(
            needs_input_grad[2], weight, weight.dtype)
        self.head = [
            first_weight_sum,
            *[zeros_if(needs_input_grad[i], t) for i, t in zip((3, 4, 5), (bias, lora_a, lora_b))],
        ]

    def add_chunk(self, rows: torch.Tensor, h: torch.Tensor, grad_logits: torch.Tensor,
                  low_rank_input: torch.Tensor | None, lora_scale: float,
                  buffers: ChunkBuffers | None = None) -> None:
        """Add one chunk's gradients. ``buffers`` (the fast path's): the logit gradient goes to the head's dtype
        into their reused buffer; without, a new tensor (autocast, LoRA: the general path)."""
        self._widen_weight_sum()
        grad_weight, grad_bias, grad_a, grad_b = self.head
        if buffers is not None:
            base = buffers.operand_of(grad_logits)
        else:
            base = grad_logits.to(self.weight.dtype) if grad_logits.dtype != self.weight.dtype else grad_logits
        if self.hidden is not None:
            self.hidden.index_copy_(0, rows, torch.mm(base, self.weight).to(self.hidden.dtype))
        if grad_weight is not None and self._weight_sum_unwritten:
            torch.mm(base.t(), h.to(self.weight.dtype), out=grad_weight)
            self._weight_sum_unwritten = False
        elif grad_weight is not None:
            self._add_product_(grad_weight, base.t(), h.to(self.weight.dtype))
        if grad_bias is not None:
            grad_bias.add_(grad_logits.sum(0))
        del base
        if self.lora_a is None or self.lora_b is None:
            return
        low = grad_logits.to(self.lora_b.dtype)
        grad_low_rank_input = torch.mm(low, self.lora_b) * lora_scale  # d loss / d (h A^T)
        if self.hidden is not None:
            self.hidden.index_add_(0, rows, torch.mm(grad_low_rank_input, self.lora_a).to(self.hidden.dtype))
        if grad_b is not None and low_rank_input is not None:
            self._add_product_(grad_b, low.t(), low_rank_input * lora_scale)
        if grad_a is not None:
            self._add_product_(grad_a, grad_low_rank_input.t(), h.to(self.lora_a.dtype))

    def _widen_weight_sum(self) -> None:
        """Before chunk ``LOW_PRECISION_INPLACE_CHUNKS + 1``: a low-precision weight's gradient sum moves to fp32.

        Up to there the chunks are summed in bf16, in place: ``addmm_`` adds each chunk's product to the sum in the
        GEMM's fp32 accumulator and rounds once per chunk, with no extra pass over the weight-sized sum. Summing in
        fp32 instead costs a buffer the weight's size and, per chunk, the product rounded to bf16 then added (one
        more pass over 6 bytes per weight element: on a bf16 head that pass costs as much as the GEMM). Measured
        against a float64 reference (N = 4096 targets, H = 256, V = 8192; RMS / max error of the weight gradient,
        relative): autograd's single rounding 1.67e-3 / 2.26e-3; in place over 2 / 4 / 8 / 16 chunks 2.04e-3 /
        4.15e-3, 2.63e-3 / 6.57e-3, 3.52e-3 / 8.39e-3, 4.97e-3 / 1.20e-2; the fp32 sum 2.3e-3 / 4.1e-3 at any
        count. In place is as accurate as the fp32 sum up to 2 chunks and within 1.15x (RMS) up to 4; beyond, the
        error keeps growing, so the sum moves to fp32 there (a micro-batch that large costs the full-logits path
        several times more memory than this buffer)."""
        grad_weight = self.head[0]
        if (self._chunks_added == LOW_PRECISION_INPLACE_CHUNKS and grad_weight is not None
                and grad_weight.dtype.itemsize < 4):
            self.head[0] = grad_weight.to(compute_dtype(grad_weight.dtype))  # the bf16 partial is freed
        self._chunks_added += 1

    def _add_product_(self, total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """``total += a @ b`` without a temporary the size of ``total``: in place when the dtypes allow it, else
        (a bf16 / autocast matmul summed into a wider total) a slice of ``total``'s rows at a time, each slice's
        product into one reused buffer."""
        if total.dtype == a.dtype == b.dtype and not torch.is_autocast_enabled(total.device.type):
            total.addmm_(a, b)
            return
        rows = min(total.shape[0], max(1, WEIGHT_SLICE_BYTES // max(1, total.shape[1] * total.element_size())))
        buffer = self._slice_buffer(rows, total.shape[1], a) if a.dtype == b.dtype else None
        for start in range(0, total.shape[0], rows):
            part = a[start : start + rows]
            product = torch.mm(part, b) if buffer is None else torch.mm(part, b, out=buffer[: part.shape[0]])
            total[start : start + rows].add_(product)

    def _slice_buffer(self, rows: int, columns: int, like: torch.Tensor) -> torch.Tensor | None:
        """The reused product buffer of :meth:`_add_product_` (none under autocast: its matmul picks the dtype)."""
        if torch.is_autocast_enabled(like.device.type):
            return None
        held = self._slice
        if held is None or held.dtype != like.dtype or held.shape[1] != columns or held.shape[0] < rows:
            self._slice = held = like.new_empty(rows, columns)
        return held

    def hidden_grad(self, grad_total: torch.Tensor) -> torch.Tensor | None:
        return _scaled(self.hidden, grad_total, self.dtypes[0])

    def head_grads(self, grad_total: torch.Tensor) -> list[torch.Tensor | None]:
        if self._weight_sum_unwritten and self.head[0] is not None:  # no target row: nothing was written
            self.head[0].zero_()
            self._weight_sum_unwritten = False
        return [_scaled(g, grad_total, dtype) for g, dtype in zip(self.head, self.dtypes[1:])]


def _scaled(grad: torch.Tensor | None, grad_total: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``grad * d(output)/d(loss)``, in place in the sum, then rounded once to the input's dtype (a no-op
    for the weight gradient, summed in the weight's dtype)."""
    if grad is None:
        return None
    # A bf16 sum is multiplied by the fp32 scalar in fp32 arithmetic and rounded once (x * 1 stays x).
    return grad.mul_(grad_total.to(grad.dtype) if grad.dtype.itemsize >= 4 else grad_total).to(dtype)
