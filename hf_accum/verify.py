"""Independent check that a training run applies the big-batch gradient at every update.

:class:`BigBatchAuditor` attaches to any training run (the hf_accum loop, AccumTrainer, stock
``Trainer``, a hand-written loop): it records the micro-batches the collator produced, counts
forwards, and at every ``optimizer.step`` recomputes, on a copy of the model holding the live
weights, the gradient of ONE big batch made of every micro-batch of that update on every rank,
with the loss written out plainly (``torch.nn.functional.cross_entropy``, mean over all
targets). It records the relative error of the gradient about to be applied and the LR.

MoE models (``router_loss``): the reference adds ``router_aux_loss_coef`` times the router loss either
of the big batch itself (``"big_batch"``: the true big-batch objective, which accumulation reaches when
every micro-batch holds the same rows) or as hf_accum defines it for an update, the token-weighted mean
of each micro-batch's router loss (``"per_micro_batch"``: each micro-batch run alone, weighted by its
targets over the update's targets).

It shares no code with :mod:`hf_accum.losses.token_loss` or :mod:`hf_accum.accumulation` on purpose: it is
the yardstick they are measured against (tests, ``hf-accum check``).
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass
class AuditRecord:
    """One optimizer update as the auditor saw it."""

    relative_error: float
    learning_rate: float
    targets: int
    micro_batches: int
    reference_loss: float
    applied_norm: float
    reference_norm: float


@dataclass
class BigBatchAuditor:
    """Compare each applied gradient with the big-batch reference.

    Usage: wrap the collator (``collate_fn=auditor.wrap_collator(collator)``) before building
    the dataloader, then ``auditor.attach(model, optimizer)`` before training. ``model`` is the
    module whose forward the training code calls (a DDP wrapper is fine); ``reference_model``
    defaults to a deep copy of its unwrapped module, without gradient checkpointing.
    """

    loss_kind: str = "causal_lm"
    label_smoothing: float = 0.0
    pad_token_id: int = 0
    reference_dtype: torch.dtype | None = None
    """Compute the reference in this dtype (e.g. float64 for a bf16 run); default: the model's."""
    problem_type: str | None = None
    """Sequence heads: as transformers' config.problem_type (inferred like transformers when None)."""
    router_loss: str = "none"
    """``"none"``, ``"big_batch"`` or ``"per_micro_batch"``: how the reference adds a MoE model's
    ``router_aux_loss_coef * aux_loss`` (see the module docstring)."""
    share_weights: bool = False
    """The reference copy holds the live model's parameter tensors themselves instead of copies (modules and
    buffers are still copied): no second copy of the weights and no reload per update, for checks whose memory
    matters (``hf-accum check`` at real sizes). Only where the reference computes in the live dtype, and only
    where the live parameters stay the same objects through training (not FSDP, which replaces them)."""
    records: list[AuditRecord] = field(default_factory=list)
    _pending: deque[dict[str, torch.Tensor]] = field(default_factory=deque, repr=False)
    _forwards: int = field(default=0, repr=False)

    # -- wiring ---------------------------------------------------------------------------
    def wrap_collator(self, collate_fn: Callable[[Sequence[Any]], dict]) -> Callable[[Sequence[Any]], dict]:
        def recording_collate(examples: Sequence[Any]) -> dict:
            batch = collate_fn(examples)
            self._pending.append({k: v.detach().clone() for k, v in batch.items() if torch.is_tensor(v)})
            return batch

        return recording_collate

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               reference_model: torch.nn.Module | None = None) -> None:
        self._live = _unwrap_ddp(model)
        share = self.share_weights and reference_model is None
        if share and self.reference_dtype not in (None, *{p.dtype for p in self._live.parameters()}):
            # Converting shared parameters would convert the live model's.
            raise ValueError(f"share_weights with reference_dtype={self.reference_dtype}: the reference can share "
                             "the live weights only in their own dtype")
        # Copy before registering hooks: a deep copy would otherwise copy the hooks (and us).
        if reference_model is None:
            reference_model = _reference_copy(self._live, share)
        self._reference = reference_model
        if self.reference_dtype is not None and not share:
            self._reference.to(self.reference_dtype)
        # On the unwrapped module: fires once per micro-batch whether or not DDP wraps it later.
        self._live.register_forward_pre_hook(self._count_forward)
        _inner_optimizer(optimizer).register_step_pre_hook(self._audit_step)

    def _count_forward(self, module: torch.nn.Module, args: Any) -> None:
        if module.training:
            self._forwards += 1

    # -- the check ------------------------------------------------------------------------
    def _audit_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        window = [self._pending.popleft() for _ in range(self._forwards)]
        self._forwards = 0
        window = _gather_windows(window)
        live_grads = {n: p.grad for n, p in self._live.named_parameters() if p.requires_grad}
        reference_grads, targets, loss = self.reference_gradient(window)
        error = _relative_error([live_grads[n] for n in reference_grads], list(reference_grads.values()))
        lr = float(optimizer.param_groups[0]["lr"])
        applied_norm = _norm([_dense(live_grads[n], r) for n, r in reference_grads.items()])
        self.records.append(
            AuditRecord(error, lr, targets, len(window), loss, applied_norm, _norm(reference_grads.values()))
        )

    def reference_gradient(self, micro_batches: list[dict]) -> tuple[dict[str, torch.Tensor], int, float]:
        """Gradient and value of the mean loss over all targets of ``micro_batches`` taken as one batch."""
        reference = self._reference
        if not self.share_weights:
            reference.load_state_dict(self._live.state_dict())
        big = _concatenate(micro_batches, self.pad_token_id)
        labels = big.pop("labels")
        device = next(reference.parameters()).device
        outputs = reference(**{k: v.to(device) for k, v in big.items()}, use_cache=False)
        logits, labels = _shift(outputs.logits, labels.to(device), self.loss_kind)
        loss, targets = self._mean_loss(logits, labels)
        if targets == 0:
            return {n: torch.zeros_like(p) for n, p in reference.named_parameters() if p.requires_grad}, 0, float("nan")
        loss = loss + self._router_term(outputs, micro_batches, targets)
        del outputs, logits  # the big batch's logits: only the graph keeps what backward needs
        # autograd.grad, not backward: the parameters' .grad stays untouched (with share_weights it is the live
        # model's accumulated gradient), and no copy of the gradients is made.
        trainable = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
        values = torch.autograd.grad(loss, [p for _, p in trainable], allow_unused=True)
        grads = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(trainable, values)}
        return grads, targets, float(loss.detach())

    def _router_term(self, big_outputs: Any, micro_batches: list[dict], targets: int) -> torch.Tensor | float:
        """``coef * aux`` of the big batch, or ``coef * sum_k (n_k / N) aux_k`` over its micro-batches."""
        if self.router_loss == "none":
            return 0.0
        # The live model's coefficient: a trainer may set it after the reference was copied (TRL's SFTConfig).
        coef = float(getattr(self._live, "router_aux_loss_coef", 0.0) or 0.0)
        if self.router_loss == "big_batch":
            return coef * big_outputs.aux_loss
        if self.router_loss != "per_micro_batch":
            raise ValueError(f"router_loss={self.router_loss!r}; allowed: 'none', 'big_batch', 'per_micro_batch'")
        device = next(self._reference.parameters()).device
        term = 0.0
        for batch in micro_batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch.pop("labels")
            n_k = int(_shift(labels[..., None], labels, self.loss_kind)[1].ne(-100).sum())
            term = term + coef * self._reference(**batch, use_cache=False).aux_loss * (n_k / targets)
        return term

    def _mean_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The big batch's loss as transformers defines it: a mean over every target."""
        return REFERENCE_LAYOUTS[self.loss_kind].mean_loss(self, logits, labels)

    @property
    def max_relative_error(self) -> float:
        return max((r.relative_error for r in self.records), default=float("nan"))


def _shift(logits: torch.Tensor, labels: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the labels they predict, aligned position by position."""
    return REFERENCE_LAYOUTS[kind].align(logits, labels)


def _next_token(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits[:, :-1, :], labels[:, 1:]


def _same_positions(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits, labels


def _cross_entropy_mean(auditor: BigBatchAuditor, logits: torch.Tensor, labels: torch.Tensor
                        ) -> tuple[torch.Tensor, int]:
    targets = int(labels.ne(-100).sum())
    if targets == 0:
        return logits.sum() * 0, 0
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=-100,
        reduction="mean",
        label_smoothing=auditor.label_smoothing,
    )
    return loss, targets


def _sequence_mean(auditor: BigBatchAuditor, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """transformers' three problem types of a sequence-classification head."""
    problem = auditor.problem_type
    if problem is None:
        if logits.shape[-1] == 1:
            problem = "regression"
        else:
            problem = "multi_label_classification" if labels.is_floating_point() else "single_label_classification"
    if problem == "regression":
        return F.mse_loss(logits.reshape(labels.shape), labels.to(logits.dtype)), labels.numel()
    if problem == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype)), labels.numel()
    return _cross_entropy_mean(auditor, logits, labels)


@dataclass(frozen=True)
class ReferenceLayout:
    """How the reference pairs logits with labels, and its mean loss, for one loss kind (written
    independently of hf_accum.losses.token_loss.LOSS_KIND_SPECS: this is the yardstick)."""

    align: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    mean_loss: Callable[[BigBatchAuditor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]]


REFERENCE_LAYOUTS: dict[str, ReferenceLayout] = {
    "causal_lm": ReferenceLayout(_next_token, _cross_entropy_mean),
    "token": ReferenceLayout(_same_positions, _cross_entropy_mean),
    "sequence": ReferenceLayout(_same_positions, _sequence_mean),
}


def _concatenate(micro_batches: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """One big batch: padded rows are re-padded (right) to the longest and stacked; packed
    single-row micro-batches (position_ids, no attention mask) are joined into one packed row.
    Labels not laid out per token (sequence heads: ``[B]`` or ``[B, C]``) are stacked as they are."""
    packed = "attention_mask" not in micro_batches[0] and "position_ids" in micro_batches[0]
    if packed:
        keys = [k for k in micro_batches[0] if k not in _VARLEN_METADATA]
        return {k: torch.cat([b[k] for b in micro_batches], dim=1) for k in keys}
    length = max(b["input_ids"].shape[1] for b in micro_batches)
    big = {}
    for key in micro_batches[0]:
        if all(_per_token(b, key) for b in micro_batches):
            big[key] = torch.cat([_pad_to(b[key], length, _fill(key, pad_token_id)) for b in micro_batches])
        else:  # laid out per row, not per token (sequence labels, a vision model's pixel_values): stacked as is
            big[key] = torch.cat([b[key] for b in micro_batches])
    return big


def _per_token(batch: dict, key: str) -> bool:
    """``batch[key]`` holds one value per token, ``[rows, tokens]`` like the batch's ``input_ids``."""
    return batch[key].shape == batch["input_ids"].shape


# Sequence boundaries that padding-free collators (TRL's, transformers' DataCollatorWithFlattening)
# add for varlen attention kernels. They restate position_ids per micro-batch, so they cannot be
# joined; the reference passes the joined position_ids, from which the model derives the boundaries.
_VARLEN_METADATA = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _fill(key: str, pad_token_id: int) -> int:
    return {"labels": -100, "attention_mask": 0}.get(key, pad_token_id)


def _pad_to(tensor: torch.Tensor, length: int, value: int) -> torch.Tensor:
    return F.pad(tensor, (0, length - tensor.shape[1]), value=value)


def _relative_error(live: list[torch.Tensor | None], reference: list[torch.Tensor]) -> float:
    diff = sum(float((_dense(g, r) - r).double().pow(2).sum()) for g, r in zip(live, reference))
    norm = sum(float(r.double().pow(2).sum()) for r in reference)
    return (diff / norm) ** 0.5 if norm > 0 else (0.0 if diff == 0 else float("inf"))


def _norm(tensors: Iterable[torch.Tensor]) -> float:
    return sum(float(t.double().pow(2).sum()) for t in tensors) ** 0.5


def _dense(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad.detach().to(like.dtype)


def _gather_windows(window: list[dict]) -> list[dict]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return window
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, window)
    return [batch for rank_window in gathered for batch in rank_window]


def _unwrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)


def _reference_copy(model: torch.nn.Module, share_weights: bool = False) -> torch.nn.Module:
    """A deep copy of ``model`` to recompute with; with ``share_weights``, holding the same parameter objects."""
    memo: dict[int, Any] = {id(p): p for p in model.parameters()} if share_weights else {}
    reference = copy.deepcopy(model, memo)
    base = getattr(reference, "get_base_model", lambda: reference)()
    # The yardstick recomputes nothing (transformers >= 5.2x renamed the switch).
    disable = getattr(base, "activation_checkpointing_disable", None) or getattr(
        base, "gradient_checkpointing_disable", None
    )
    if disable is not None:
        disable()
    reference.train()
    return reference
