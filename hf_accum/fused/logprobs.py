"""Fused per-token log-probabilities (and entropies): each target's ``log p(target)`` from a causal LM's hidden
states and output layer, without ever holding the ``(tokens x vocab)`` logits.

This module owns the log-probs the pairwise and RL losses need (DPO's per-sequence sums, GRPO's per-token
ratios, KL and entropy); :mod:`hf_accum.fused.loss` owns the summed cross-entropy of SFT. The difference: a
cross-entropy *sum* has a gradient that is final when the chunk is computed (the fused loss computes it in its
forward), while DPO and GRPO are nonlinear in the log-probs, so each token's upstream gradient is known only in
backward. :class:`_TargetLogProbs` therefore saves the hidden states, the targets and one log-sum-exp (and
entropy) per target, and recomputes each chunk's logits in backward -- twice the head's forward GEMM, one chunk's
logits alive at a time (TRL's ``ChunkedLogProbFunction`` does the same; its sums are float32, ours are in
:func:`hf_accum.losses.token_loss.compute_dtype`, so a float64 model stays float64 and matches the full-logits path to
rounding).

* :class:`FusedLogProbs` -- per run: probes each model's output layer once (:func:`hf_accum.fused.head.
  probe_fusable_head`: what it computes and what the model does to its logits) and runs a forward whose head
  returns the per-position log-probs instead of logits (inside the head's forward, where FSDP2 / ZeRO-3 have
  gathered its weights, as the fused loss does). A model whose head cannot be fused gets ``None`` (the caller
  takes the logits path) and one warning.
* :func:`target_logps` -- the chunked log-probs of given hidden rows, differentiable (the Function).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable

import torch
from torch import nn

from hf_accum.distributed import is_main_process
from hf_accum.fused.gradients import GradientSums
from hf_accum.fused.head import NotFusable, _through_outputs, head_computes, probe_fusable_head, resolve_head
from hf_accum.fused.loss import LinearHead, LogitTransform, _chunk_logits
from hf_accum.losses.token_loss import DEFAULT_CHUNK_BYTES, IGNORE_INDEX, aligned_targets, compute_dtype, unwrap_model

logger = logging.getLogger("hf_accum.fused.loss")


def logps_chunk_rows(vocab: int, weight: torch.Tensor, entropy: bool, chunk_bytes: int | None) -> int:
    """Target rows per chunk: ``chunk_bytes`` (default 192 MiB) of logits in the loss dtype, counting the
    chunk-sized temporaries of the forward (the log-probs beside the logits; the entropy's product) and of the
    backward (the probabilities, the logit gradient)."""
    budget = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    buffers = 3 if entropy else 2
    return max(1, budget // (vocab * compute_dtype(weight.dtype).itemsize * buffers))


def target_logps(hidden: torch.Tensor, head: LinearHead, targets: torch.Tensor, *, temperature: float = 1.0,
                 entropy: bool = False, chunk_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logp[N], entropy[N] or None)`` of the rows of ``hidden`` (``[N, H]``, every row a target) under
    ``softmax(head.model_logits(hidden) / temperature)``, in the loss dtype; differentiable in the hidden states
    and the head's tensors (the entropy too)."""
    rows = logps_chunk_rows(head.weight.shape[0], head.weight, entropy, chunk_bytes)
    options = _LogProbOptions(head.lora_scale, head.transform, float(temperature), rows, entropy)
    logps, entropies = _TargetLogProbs.apply(hidden, targets, head.weight, head.bias, head.lora_a, head.lora_b,
                                             options)
    return logps, (entropies if entropy else None)


def _model_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor | None,
                  lora_b: torch.Tensor | None, lora_scale: float, transform: LogitTransform, temperature: float,
                  loss_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One chunk's ``T(z) / temperature`` in the loss dtype, the soft-cap's tanh (its derivative) and ``h A^T``
    (a LoRA head's gradients need it): the same ops as the model's head, so float64 rounds as it does."""
    z, low_rank_input = _chunk_logits(h, weight, bias, lora_a, lora_b, lora_scale, loss_dtype)
    y, tanh = transform.apply_(z)
    if temperature != 1.0:
        y = y / temperature  # as the full-logits path divides (not a multiplication by 1 / T)
    return y, tanh, low_rank_input


@dataclasses.dataclass(frozen=True)
class _LogProbOptions:
    """What :class:`_TargetLogProbs` takes besides the tensors it differentiates (one argument of ``apply``)."""

    lora_scale: float
    transform: LogitTransform
    temperature: float
    chunk_rows: int
    with_entropy: bool


class _TargetLogProbs(torch.autograd.Function):
    """Per target row with model logits ``y`` (after the transform and the temperature), ``lse = logsumexp(y)``,
    ``log p = y - lse``, ``p = exp(log p)``, entropy ``H = -sum_c p_c log p_c``::

        logp_t = y_t - lse                     d logp_t / d y_c = [c == t] - p_c
        H                                      d H / d y_c      = -p_c (log p_c + H)

    Backward recomputes each chunk's ``y`` (autocast as in forward), forms ``g_logp * ([c == t] - p) + g_H * dH/dy``,
    chains it through the temperature and the transform, and multiplies it back through the head
    (:class:`~hf_accum.fused.gradients.GradientSums`)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None,
                options: _LogProbOptions) -> tuple[torch.Tensor, torch.Tensor]:
        lora_scale, transform, temperature = options.lora_scale, options.transform, options.temperature
        chunk_rows, with_entropy = options.chunk_rows, options.with_entropy
        ctx.set_materialize_grads(False)
        loss_dtype = compute_dtype(weight.dtype)
        count = hidden.shape[0]
        logps = torch.empty(count, dtype=loss_dtype, device=hidden.device)
        lse = torch.empty_like(logps)
        entropies = torch.zeros_like(logps)
        for start in range(0, count, chunk_rows):
            end = min(start + chunk_rows, count)
            y, _, _ = _model_logits(hidden[start:end], weight, bias, lora_a, lora_b, lora_scale, transform,
                                    temperature, loss_dtype)
            row_lse = torch.logsumexp(y, 1)
            lse[start:end] = row_lse
            logps[start:end] = y.gather(1, targets[start:end, None]).squeeze(1) - row_lse
            if with_entropy:
                log_p = y.sub_(row_lse[:, None])
                entropies[start:end] = -(log_p.exp() * log_p).sum(1)
            del y
        ctx.save_for_backward(hidden, targets, weight, bias, lora_a, lora_b, lse, entropies)
        ctx.options = options
        device_type = hidden.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        return logps, entropies

    @staticmethod
    def backward(ctx: Any, grad_logps: torch.Tensor | None,
                 grad_entropy: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, targets, weight, bias, lora_a, lora_b, lse, entropies = ctx.saved_tensors
        options = ctx.options
        device_type, autocast, autocast_dtype = ctx.autocast
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast):
            sums = GradientSums(hidden, weight, bias, lora_a, lora_b, ctx.needs_input_grad)
            if grad_logps is not None or grad_entropy is not None:
                head = LinearHead(weight, bias, lora_a, lora_b, options.lora_scale, options.transform)
                _backward_chunks(sums, hidden, targets, head, (lse, entropies), (grad_logps, grad_entropy),
                                 options)
        one = torch.ones((), dtype=lse.dtype, device=lse.device)
        return (sums.hidden_grad(one), None, *sums.head_grads(one), None)


def _backward_chunks(sums: GradientSums, hidden: torch.Tensor, targets: torch.Tensor, head: LinearHead,
                     saved: tuple[torch.Tensor, torch.Tensor],
                     grads: tuple[torch.Tensor | None, torch.Tensor | None], options: _LogProbOptions) -> None:
    """Each chunk's logit gradient, recomputed, into ``sums``: ``saved`` is the forward's ``(lse, entropies)``,
    ``grads`` the incoming ``(grad_logps, grad_entropy)``."""
    lse, entropies = saved
    grad_logps, grad_entropy = grads
    weight, bias, lora_a, lora_b = head.weight, head.bias, head.lora_a, head.lora_b
    lora_scale, transform = head.lora_scale, head.transform
    temperature, chunk_rows = options.temperature, options.chunk_rows
    loss_dtype = lse.dtype
    for start in range(0, hidden.shape[0], chunk_rows):
        end = min(start + chunk_rows, hidden.shape[0])
        h = hidden[start:end]
        y, tanh, low_rank_input = _model_logits(h, weight, bias, lora_a, lora_b, lora_scale, transform,
                                                temperature, loss_dtype)
        log_p = y.sub_(lse[start:end, None])
        p = log_p.exp()
        g_lp = None if grad_logps is None else grad_logps[start:end, None].to(loss_dtype)
        if grad_entropy is not None:
            g_h = grad_entropy[start:end, None].to(loss_dtype)
            grad = log_p.add_(entropies[start:end, None]).mul_(p).mul_(-g_h)  # -g_H p (log p + H), in log_p
            if g_lp is not None:
                grad.sub_(p.mul_(g_lp))
        else:
            assert g_lp is not None  # the caller skips a backward without either gradient
            grad = p.mul_(-g_lp)  # -g_logp p, in p
        if g_lp is not None:
            grad[torch.arange(end - start, device=grad.device), targets[start:end]] += g_lp.squeeze(1)
        if temperature != 1.0:
            grad.div_(temperature)
        grad = transform.chain_(grad, tanh)
        rows = torch.arange(start, end, device=hidden.device)
        sums.add_chunk(rows, h, grad, low_rank_input, lora_scale)
        del y, grad, log_p, p  # the next chunk's logits reuse this memory


# ----------------------------------------------------------------------------------------------
# Running a model so that its head returns the log-probs
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TokenLogProbs:
    """One forward's per-position log-probs ``[B, T]`` (position ``p`` scores the target aligned with it: for a
    causal LM, label ``p + 1``; 0 where there is no target), entropies alike (``None`` unless asked) and the
    model's outputs (whose ``logits`` is a ``[1, 1, 1]`` marker, not logits)."""

    logps: torch.Tensor
    entropies: torch.Tensor | None
    outputs: Any


class FusedLogProbs:
    """The fused log-probs of one run, for any number of models (the policy, a reference copy): each model's
    output layer is probed once on its first call; a model that cannot be fused is refused once (``None``)."""

    def __init__(self, chunk_bytes: int | None = None):
        self.chunk_bytes = chunk_bytes
        self.forwards = 0  # fused forwards run (what the tests check the fused path ran with)
        self._heads: dict[int, tuple[nn.Module, LogitTransform] | None] = {}

    def token_logps(self, model: nn.Module, inputs: dict[str, Any], targets: torch.Tensor, *,
                    temperature: float = 1.0, entropy: bool = False) -> TokenLogProbs | None:
        """``model(**inputs)`` with its head returning the log-probs of ``targets`` (``[B, T]``, aligned with the
        positions, -100: none); ``None`` when this model's head cannot be fused (take the logits path)."""
        head = self._head(model, inputs)
        if head is None:
            return None
        head_module, transform = head

        def compute(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            if hidden.shape[:-1] != targets.shape:
                raise RuntimeError(f"hidden states {tuple(hidden.shape)} do not match targets {tuple(targets.shape)}")
            linear = dataclasses.replace(resolve_head(head_module), transform=transform)  # read here: gathered
            return _scatter_logps(hidden, linear, targets.to(hidden.device), temperature, entropy, self.chunk_bytes)

        with _head_returns_logps(head_module, compute) as calls:
            outputs = model(**inputs)
        marker = outputs["logits"]
        if len(calls) != 1 or marker.shape != (1, 1, 1):
            raise RuntimeError(f"the model called its output layer {len(calls)} times / returned logits of shape "
                               f"{tuple(marker.shape)} although the probe saw one plain call; pass fused_loss=False")
        logps, entropies = calls[0]
        self.forwards += 1
        # Through the outputs: a sharding engine's backward hooks on them run before the log-probs' backward.
        return TokenLogProbs(_through_outputs(logps, marker), entropies, outputs)

    def causal_logps(self, model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, **options: Any
                     ) -> TokenLogProbs | None:
        """:meth:`token_logps` of a causal LM's ``labels`` (the causal shift: position ``p`` scores label
        ``p + 1``)."""
        return self.token_logps(model, inputs, aligned_targets(labels, "causal_lm"), **options)

    def _head(self, model: nn.Module, inputs: dict[str, Any]) -> tuple[nn.Module, LogitTransform] | None:
        key = id(unwrap_model(model))
        if key not in self._heads:
            try:
                head_module, transform, vocab = probe_fusable_head(model, inputs)
            except NotFusable as reason:
                if is_main_process():
                    logger.warning("fused log-probs off for %s, logits path: %s", type(unwrap_model(model)).__name__,
                                   reason)
                self._heads[key] = None
            else:
                self._heads[key] = (head_module, transform)
                if is_main_process():
                    logger.info("fused log-probs on (vocabulary %d)", vocab)
        return self._heads[key]


def _scatter_logps(hidden: torch.Tensor, head: LinearHead, targets: torch.Tensor, temperature: float,
                   entropy: bool, chunk_bytes: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target rows' log-probs put back at their positions (``[B, T]``, 0 elsewhere): only target rows are
    computed (a prompt costs nothing)."""
    flat_targets = targets.reshape(-1)
    rows = flat_targets.ne(IGNORE_INDEX).nonzero().squeeze(1)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    logps, entropies = target_logps(flat_hidden, head, flat_targets.index_select(0, rows), temperature=temperature,
                                    entropy=entropy, chunk_bytes=chunk_bytes)

    def placed(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(flat_targets.shape[0]).index_copy(0, rows, values).reshape(targets.shape)

    return placed(logps), (placed(entropies) if entropies is not None else None)


def _head_returns_logps(
    head_module: nn.Module, compute: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
) -> contextlib.AbstractContextManager[list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """For one forward: the head computes ``compute(hidden_states)`` (kept in the yielded list) and returns a marker
    that depends on its log-probs (:func:`hf_accum.fused.head.head_computes`)."""
    return head_computes(head_module, compute, lambda computed: computed[0].sum())
