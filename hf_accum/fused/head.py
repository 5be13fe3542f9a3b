"""Which output layers the fused loss can take, proven on the model itself, and running a model so that its head
returns the loss (:class:`FusedCausalLMLoss`). The loss itself is :mod:`hf_accum.fused.loss`; what both
front-ends call per micro-batch is :mod:`hf_accum.losses.micro_batch`.

See :mod:`hf_accum.fused.loss` (its docstring, items 2 and 3) for why the head's ``forward`` is replaced for
one call instead of calling the decoder and the loss apart, and for what the probe proves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn

from hf_accum.distributed import is_main_process
from hf_accum.fused.loss import (
    IDENTITY,
    PROBE_POSITIONS,
    LinearHead,
    LogitTransform,
    TokenStats,
    linear_cross_entropy_sum,
    rows_per_chunk,
)
from hf_accum.losses.model_loss import leading_slice, probing
from hf_accum.losses.token_loss import (
    DEFAULT_CHUNK_BYTES,
    aligned_targets,
    check_label_smoothing,
    compute_dtype,
    unwrap_model,
)

Computed = TypeVar("Computed")

logger = logging.getLogger("hf_accum.fused.loss")


# ----------------------------------------------------------------------------------------------
# The head: what a model's output layer computes
# ----------------------------------------------------------------------------------------------


class NotFusable(Exception):
    """This model's output layer (or what the model does with its output) is not a plain linear map."""


def resolve_head(module: nn.Module) -> LinearHead:
    """The tensors ``module`` computes its logits with; :class:`NotFusable` (with the reason) otherwise.

    Under a sharding engine (FSDP2, ZeRO-3) the tensors are whole only inside the module's forward (the
    engine gathers them in its forward pre-hook): the fused loss therefore reads them there
    (:class:`FusedCausalLMLoss` runs inside the head's forward, see :func:`_head_returns_loss`)."""
    _require_no_hooks(module)
    for cls, resolver in _head_resolvers().items():
        if built_class(module) is cls:  # exact type: a subclass may override forward
            return resolver(module)
    raise NotFusable(
        f"the output layer is a {type(module).__name__}, not nn.Linear or a PEFT LoRA/modules_to_save wrapper"
    )


def built_class(module: nn.Module) -> type:
    """The class ``module`` was built as. FSDP2's ``fully_shard`` swaps an instance's class for a generated
    ``FSDP<Class>(FSDPModule, <Class>)`` that adds sharding methods and no forward of its own."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if isinstance(module, FSDPModule):
        return next(base for base in cls.__bases__ if base is not FSDPModule)
    return cls


def linear_leaf(head_module: nn.Module) -> nn.Module:
    """The module whose own forward applies the head's linear map to the hidden states: the head itself, or
    the copy a PEFT ``modules_to_save`` wrapper calls. The fused loss replaces that module's forward, so a
    sharding engine's hooks on it (ZeRO-3 gathers each module's own parameters) and on every module around it
    (FSDP2 units) run as they do for the logits path."""
    from peft.utils.other import ModulesToSaveWrapper

    if isinstance(head_module, ModulesToSaveWrapper):
        adapters = head_module.active_adapters
        if head_module.disable_adapters or not adapters or adapters[0] not in head_module.modules_to_save:
            return linear_leaf(head_module.original_module)
        return linear_leaf(head_module.modules_to_save[adapters[0]])
    return head_module


def _head_resolvers() -> dict[type, Callable[[Any], LinearHead]]:
    """Module type -> how to read its linear map (one entry per supported kind of output layer)."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.utils.other import ModulesToSaveWrapper

    return {nn.Linear: _plain_linear, ModulesToSaveWrapper: _modules_to_save, LoraLinear: _lora_linear}


# Where the forward hooks of the sharding engines are defined: FSDP2 (gathers a unit's parameters before its
# forward, frees them after, and re-gathers for backward from a hook on the forward's outputs) and DeepSpeed
# ZeRO-3 (the same per module). The fused loss runs inside the head's forward and returns a tensor the model
# carries to its outputs (:func:`_through_outputs`), so these hooks do for it what they do for the logits.
ENGINE_HOOK_MODULES = ("torch.distributed.fsdp.", "deepspeed.runtime.zero.")


# Decorators an engine wraps its hooks in without functools.wraps (DeepSpeed's NVTX ranges): the hook is the
# function held in the wrapper's closure.
HOOK_WRAPPER_MODULES = ("deepspeed.utils.nvtx",)


def _is_engine_hook(hook: Callable) -> bool:
    function = getattr(hook, "func", hook)  # functools.partial
    module = getattr(function, "__module__", None) or ""
    if module.startswith(HOOK_WRAPPER_MODULES):
        cells = getattr(function, "__closure__", None) or ()
        return any(callable(cell.cell_contents) and _is_engine_hook(cell.cell_contents) for cell in cells)
    return module.startswith(ENGINE_HOOK_MODULES)


def _require_no_hooks(module: nn.Module) -> None:
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    foreign = [hook for hook in hooks if not _is_engine_hook(hook)]
    patched = module.__dict__.get("forward")
    if foreign or (patched is not None and not getattr(patched, "is_fused_head", False)):
        names = sorted({getattr(hook, "__qualname__", type(hook).__name__) for hook in foreign}) or ["forward"]
        raise NotFusable(f"the output layer {type(module).__name__} cannot be read directly: it has forward hooks or "
                         f"a patched forward ({', '.join(names)})")


def _require_gathered(head: LinearHead) -> None:
    """ZeRO-3 gathers a module's own parameters before *its* forward: a LoRA adapter's matrices live in
    submodules whose forward the fused head never calls, so they are still partitioned when it runs."""
    for tensor in (head.weight, head.bias, head.lora_a, head.lora_b):
        status = getattr(tensor, "ds_status", None)
        if status is not None and getattr(status, "name", "") == "NOT_AVAILABLE":
            raise NotFusable("LoRA on the output layer under DeepSpeed ZeRO-3 (its matrices are gathered only "
                             "inside their own forward)")


def _plain_linear(module: nn.Linear) -> LinearHead:
    return LinearHead(module.weight, module.bias)


def _modules_to_save(wrapper: Any) -> LinearHead:  # PEFT ModulesToSaveWrapper (dynamic attributes)
    """PEFT's modules_to_save: the active adapter's trainable copy (the frozen original when disabled)."""
    adapters = wrapper.active_adapters
    if wrapper.disable_adapters or not adapters or adapters[0] not in wrapper.modules_to_save:
        return resolve_head(wrapper.original_module)
    return resolve_head(wrapper.modules_to_save[adapters[0]])


def _lora_linear(layer: Any) -> LinearHead:  # PEFT LoRA Linear (dynamic attributes)
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

    def __init__(self, label_smoothing: float = 0.0, chunk_bytes: int | None = None):
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
        self, model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, stats: TokenStats | None = None,
        weights: torch.Tensor | None = None,
    ) -> tuple[Any, torch.Tensor] | None:
        """``(outputs, loss_sum)`` from one forward whose head returned the summed loss, or None.
        ``stats``, when given, gets the micro-batch's :class:`TokenStats` added; ``weights`` (aligned with the
        causal LM's targets, one per position) weigh each target's loss."""
        if not self._decided:
            self._decide(model, inputs)
        if self.head_module is None:
            return None
        targets = aligned_targets(labels, "causal_lm")
        with _head_returns_loss(self.head_module, self._loss_of(targets, stats, weights)) as calls:
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
        return outputs, _through_outputs(calls[0], marker)

    def disable(self, reason: str) -> None:
        """Decide for the logits path (e.g. a custom loss needs the logits)."""
        self._decided, self.head_module, self.reason = True, None, reason

    def _loss_of(
        self, targets: torch.Tensor, stats: TokenStats | None, weights: torch.Tensor | None = None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        head_module = self.head_module
        assert head_module is not None  # decided for the fused path before a loss is built
        def loss(hidden: torch.Tensor) -> torch.Tensor:
            if hidden.shape[:-1] != targets.shape:
                raise RuntimeError(f"hidden states {tuple(hidden.shape)} do not match labels {tuple(targets.shape)}")
            # Read here, inside the head's forward: a sharding engine has gathered the weights (and the active
            # adapter may change between calls).
            head = dataclasses.replace(resolve_head(head_module), transform=self.transform)
            return linear_cross_entropy_sum(hidden, head, targets, self.label_smoothing, self.chunk_bytes, stats,
                                            weights)

        return loss

    def _decide(self, model: nn.Module, inputs: dict[str, Any]) -> None:
        self._decided = True
        try:
            self.head_module, self.transform, vocab = probe_fusable_head(model, inputs)
        except NotFusable as reason:
            self.reason = str(reason)
            if is_main_process():  # every rank decides alike: say it once
                logger.warning("fused linear cross-entropy off, logits path for this run: %s", reason)
            return
        if is_main_process():
            logger.info("fused linear cross-entropy on (vocabulary %d, at most %d MiB of logits per chunk%s%s)",
                        vocab, self._chunk_mib(vocab), _describe(self.transform), _engine_note(self.head_module))

    def _chunk_mib(self, vocab: int) -> int:
        """The logits of one chunk, in MiB, as :func:`~hf_accum.fused.loss.rows_per_chunk` sizes them for this head
        (taken as on the fast path when it has no adapter and no logit transform)."""
        assert self.head_module is not None
        weight = getattr(linear_leaf(self.head_module), "weight", None)
        if not isinstance(weight, torch.Tensor):
            return (DEFAULT_CHUNK_BYTES if self.chunk_bytes is None else self.chunk_bytes) // 2**20
        # (LoRA on the head, or a logit transform, takes the general path: the budget as given.)
        fast = self.transform == IDENTITY and getattr(self.head_module, "lora_A", None) is None  # PEFT's LoRA layer
        rows = rows_per_chunk(vocab, weight, self.transform, fast, self.chunk_bytes)
        return rows * vocab * compute_dtype(weight.dtype).itemsize * self.transform.buffers // 2**20


def _describe(transform: LogitTransform) -> str:
    steps = [f"{name} {value:g}" for name, value in (("logits x", transform.multiply), ("logits /", transform.divide),
                                                      ("soft-capped at", transform.softcap)) if value is not None]
    return "; " + ", ".join(steps) if steps else ""


def probe_fusable_head(model: nn.Module, inputs: dict[str, Any]) -> tuple[nn.Module, LogitTransform, int]:
    """The output-layer module to fuse, what the model does to its logits and the vocabulary size, after
    checking on a short slice of ``inputs`` that the model returns exactly that from every position's hidden
    state. The head's tensors are read inside its forward, where a sharding engine has gathered them."""
    if isinstance(model, nn.DataParallel):
        raise NotFusable("nn.DataParallel replicates modules per call (use DDP)")
    inner = unwrap_model(model)
    get_head = getattr(inner, "get_output_embeddings", None)
    head_module = get_head() if callable(get_head) else None
    if head_module is None:
        raise NotFusable(f"{type(inner).__name__} has no output embeddings (get_output_embeddings)")
    resolve_head(head_module)  # its kind, and no foreign hooks (before any forward)
    # Through the model as training calls it (DDP and Accelerate's autocast included); every rank
    # probes its first micro-batch at the same point, so DDP's buffer broadcast stays in step.
    seen = _probe_forward(model, head_module, _probe_slice(inputs))
    if len(seen["calls"]) != 1:
        raise NotFusable(f"the output layer was called {len(seen['calls'])} times in one forward")
    (hidden, head_output, expected), positions = seen["calls"][0], seen["positions"]
    if isinstance(expected, NotFusable):
        raise expected
    if positions is None or tuple(hidden.shape[:-1]) != positions:
        raise NotFusable("the output layer does not see every position's hidden state")
    _require_equal(expected, head_output, "the output layer computes something other than its linear map")
    returned = seen["logits"]
    if returned is None or returned.dtype.itemsize < head_output.dtype.itemsize:
        raise NotFusable("the model does not return its output layer's logits")
    return head_module, _proven_transform(inner, head_output, returned.to(head_output.dtype)), head_output.shape[-1]


def _engine_note(head_module: nn.Module) -> str:
    """``; inside the FSDP2/ZeRO-3 head's forward`` when a sharding engine gathers the head (the log line)."""
    modules = [head_module, linear_leaf(head_module)]
    hooks = [hook for module in modules for hook in (*module._forward_pre_hooks.values(),)]
    engines = {("FSDP2" if "fsdp" in getattr(getattr(h, "func", h), "__module__", "") else "ZeRO-3")
               for h in hooks if _is_engine_hook(h)}
    return f"; inside the {'/'.join(sorted(engines))}-gathered head's forward" if engines else ""


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
    config: Any = getattr(inner, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config

    def number(*owners_and_names: tuple[Any, str]) -> float | None:
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
    """One no-grad forward recording, per call of the head, ``(hidden, head output, what the fused loss would
    compute from the head's tensors)``: the last is computed inside the forward (gathered weights), or is the
    :class:`NotFusable` met reading them (raised by the caller, after the forward has finished cleanly)."""
    calls = []
    leaf = linear_leaf(head_module)
    original = leaf.forward

    def record(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        expected: torch.Tensor | NotFusable
        output = original(hidden, *args, **kwargs)
        try:
            head = resolve_head(head_module)
            _require_gathered(head)
            expected = head.logits(hidden)
        except NotFusable as reason:
            expected = reason
        calls.append((hidden.detach(), output.detach(), expected))
        return output

    record.is_fused_head = True  # type: ignore[attr-defined]  # a marker read by linear_leaf's callers
    leaf.forward = record
    try:
        with probing(model):
            outputs = model(**inputs)
    finally:
        del leaf.forward
    positions = next((tuple(inputs[k].shape[:2]) for k in ("input_ids", "inputs_embeds") if k in inputs), None)
    logits = outputs["logits"] if "logits" in outputs else None
    return {"calls": calls, "positions": positions, "logits": logits}


def _probe_slice(inputs: dict[str, Any]) -> dict[str, Any]:
    """The first row's first positions (padding-free rows included, :func:`hf_accum.losses.model_loss.leading_slice`),
    when the inputs' layout lets them be cut (else the whole micro-batch: correct, only costlier)."""
    cut = leading_slice(inputs, 0, PROBE_POSITIONS)
    return cut if cut is not None else dict(inputs)


def _require_equal(ours: torch.Tensor, theirs: torch.Tensor, message: str) -> None:
    if ours.shape != theirs.shape:
        raise NotFusable(message)
    tolerance = max(1e-6, 4 * torch.finfo(theirs.dtype).eps) * float(theirs.abs().max().clamp_min(1.0))
    same = bool((ours.to(theirs.dtype) - theirs).abs().max() <= tolerance)
    if not same:
        raise NotFusable(message)


@contextlib.contextmanager
def head_computes(
    head_module: nn.Module, compute: Callable[[torch.Tensor], Computed], marker: Callable[[Computed], torch.Tensor]
) -> Iterator[list[Computed]]:
    """For one forward: the output layer runs ``compute(hidden_states)`` instead of its matmul (each call's result
    kept in the yielded list) and returns ``marker(result)`` as a ``[1, 1, 1]`` tensor that depends on it, so the
    engines' hooks on the model's outputs and DDP's reachability see the head's tensors. The fused loss
    (:func:`_head_returns_loss`) and the fused log-probs (:mod:`hf_accum.fused.logprobs`) both run through it."""
    calls: list[Computed] = []
    leaf = linear_leaf(head_module)

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:
            raise RuntimeError(f"the output layer was called with extra arguments {list(kwargs) or len(args)}")
        calls.append(compute(hidden_states))
        # A copy: a model that transforms its logits in place must not change what was computed.
        return marker(calls[-1]).reshape(1, 1, 1).clone()

    forward.is_fused_head = True  # type: ignore[attr-defined]  # a marker read by linear_leaf's callers
    # An instance attribute: nn.Module.__call__ finds it first, after the module's (engine) pre-hooks ran.
    leaf.forward = forward
    try:
        yield calls
    finally:
        del leaf.forward


def _head_returns_loss(
    head_module: nn.Module, loss: Callable[[torch.Tensor], torch.Tensor]
) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
    """For one forward: the head returns ``loss(hidden_states)`` (the losses it computed are in the yielded list)."""
    return head_computes(head_module, loss, lambda computed: computed)


def _through_outputs(loss_sum: torch.Tensor, marker: torch.Tensor) -> torch.Tensor:
    """``loss_sum``, made to reach the model's outputs in backward: the same value and gradient (the marker
    contributes an exact zero), but backward now runs the hooks a sharding engine put on every module's
    *outputs* (FSDP2's root and unit pre-backward: re-gather, queue the gradient reduce-scatter; ZeRO-3's
    pre-backward gather) before the fused loss's own backward, as it does for the logits path."""
    return loss_sum + _ZeroThrough.apply(marker)


class _ZeroThrough(torch.autograd.Function):
    """A 0-dim zero whose backward sends zeros to its input: the input's autograd hooks fire, nothing
    changes numerically (unlike ``0 * x``, which turns an inf marker into nan)."""

    @staticmethod
    def forward(ctx: Any, marker: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = marker.shape, marker.dtype
        return marker.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.new_zeros(ctx.shape, dtype=ctx.dtype)


# ----------------------------------------------------------------------------------------------
# One micro-batch: fused where possible, from the logits otherwise (both front-ends)
# ----------------------------------------------------------------------------------------------
