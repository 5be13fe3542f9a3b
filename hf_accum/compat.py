"""Every place hf_accum relies on a private or version-specific detail of a library it builds on.

One home, so that an upgrade of transformers / accelerate / TRL / bitsandbytes is checked here and
nowhere else. Each entry names the version it was checked against and what breaks without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

import torch

# The objects here are reached through private or version-specific attributes that their libraries do not
# type (or type otherwise), so they are Any: Trainer / TRL trainers, Accelerator, bitsandbytes' layers.

# --------------------------------------------------------------------------------------------------
# bitsandbytes (checked: 0.50.2)
# --------------------------------------------------------------------------------------------------


def keep_4bit_training_layout(model: torch.nn.Module) -> int:
    """Keep every bitsandbytes ``Linear4bit`` weight in the layout it was quantized in, on every CPU.

    bitsandbytes 0.50 ``Linear4bit.forward`` repacks a 4-bit weight into a CPU *inference* layout
    (``_convert_weight_packed_for_cpu``) whenever it runs on a CPU with ``avx512_bf16``, in eval mode,
    on an input without grad -- a held-out evaluation before or during training. The repacked weight
    is then a different tensor from the one training, DeepSpeed ZeRO-3 partitioning and
    ``state_dict`` expect: under ZeRO-3 saving dies in ``_convert_weight_packed_for_cpu_inverse``
    ("packed_weight should be [N, K/2]"), so the same run passes or fails depending on the CPU.

    A fine-tune alternates training and evaluation, so the inference layout buys nothing here. This
    turns the repacking off for every ``Linear4bit`` (the module's own ``support_avx512bf16_for_cpu``
    switch) and unpacks any weight that was already repacked. Idempotent and cheap: call it after
    loading and again before training. Returns the number of 4-bit layers it holds in place.
    """
    layers: list[Any] = [module for module in model.modules() if _is_linear4bit(module)]  # bitsandbytes' Linear4bit
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False  # bitsandbytes reads this on every forward
        weight = layer.weight
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
            layer.quant_state = weight.quant_state
    return len(layers)


def _is_linear4bit(module: torch.nn.Module) -> bool:
    # By name, so that hf_accum imports without bitsandbytes installed (QLoRA is an optional extra).
    return any(cls.__name__ == "Linear4bit" and cls.__module__.startswith("bitsandbytes")
               for cls in type(module).__mro__)


# --------------------------------------------------------------------------------------------------
# accelerate (checked: 1.15)
# --------------------------------------------------------------------------------------------------


def set_sync_gradients(accelerator: Any, sync: bool) -> None:
    """Tell Accelerate (and through it the DeepSpeed engine) whether this micro-batch closes the window.

    The loop's DeepSpeed stepper fetches a whole window before its forwards (it counts the targets first), so
    ``accumulate()`` would see the dataloader's end while the last window's first micro-batch still runs;
    ``Trainer._run_epoch`` sets the flag by hand for the same reason. ``GradientState._set_sync_gradients``
    is private in accelerate 1.15."""
    accelerator.gradient_state._set_sync_gradients(sync)


def set_optimizer_step_skipped(optimizer: Any, skipped: bool) -> None:
    """Make ``accelerator.optimizer_step_was_skipped`` say ``skipped`` for this ``AcceleratedOptimizer``.

    Trainer steps the LR scheduler unless that property is True, and it reads each optimizer's private
    ``_is_overflow`` flag (set by fp16's GradScaler, accelerate 1.15). AccumTrainer sets it for an update the
    boundary skipped, between ``optimizer.step()`` and that check, and clears it after."""
    if not hasattr(optimizer, "_is_overflow"):
        raise RuntimeError(
            "accelerate's AcceleratedOptimizer has no _is_overflow flag any more: AccumTrainer cannot keep the LR "
            "scheduler still on a skipped inf/NaN update with this accelerate version"
        )
    optimizer._is_overflow = skipped


def force_fsdp_distributed_type(accelerator: Any, plugin: Any) -> None:
    """Make an ``Accelerator`` built with an FSDP plugin on CPU processes really run FSDP.

    Accelerate 1.15 (``AcceleratorState.__init__``) sets ``DistributedType.FSDP`` only for GPU-like
    distributed types; on ``MULTI_CPU`` it keeps DDP and drops the plugin, saying nothing. FSDP2 itself
    runs on CPU (a ``cpu`` device mesh over gloo), and Accelerate's FSDP2 ``prepare`` path works once the
    state says FSDP: set exactly the fields that branch would have set, before any ``prepare``.
    """
    from accelerate.utils import DistributedType

    state = accelerator.state
    if not hasattr(state, "distributed_type") or not hasattr(type(accelerator), "is_fsdp2"):
        raise RuntimeError("accelerate's AcceleratorState changed: hf_accum cannot set FSDP on CPU with this "
                           "accelerate version (checked: 1.15)")
    from accelerate.state import PartialState

    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    # Every later AcceleratorState() (prepare creates some) copies PartialState's shared fields over its own:
    # the GPU branch records FSDP there too (AcceleratorState.__init__'s last line), so must we.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def keep_accelerate_from_compiling(accelerator: Any) -> None:
    """Stop ``Accelerator.prepare`` from wrapping the whole model in ``torch.compile``.

    transformers 5.23 hands ``TrainingArguments.torch_compile`` to Accelerate (a ``TorchDynamoPlugin``), whose
    ``prepare_model`` (1.15) compiles the whole model when ``state.dynamo_plugin.backend`` is not ``NO``.
    AccumTrainer compiles the model's blocks in place instead (:mod:`hf_accum.compile`: the fused loss breaks a
    whole-model graph at every micro-batch); this sets exactly that field, before any ``prepare``.
    """
    from accelerate.utils import DynamoBackend

    plugin = getattr(accelerator.state, "dynamo_plugin", None)
    if plugin is None or not hasattr(plugin, "backend"):
        raise RuntimeError("accelerate's AcceleratorState has no dynamo_plugin.backend any more: hf_accum cannot "
                           "keep it from compiling the whole model (checked: accelerate 1.15)")
    plugin.backend = DynamoBackend.NO


# --------------------------------------------------------------------------------------------------
# transformers (checked: 5.23)
# --------------------------------------------------------------------------------------------------

TRAINER_STATE_NAME = "trainer_state.json"
"""``transformers.trainer.TRAINER_STATE_NAME``: the file a checkpoint's ``TrainerState`` is saved in."""

TRAINER_PRIVATE_HOOKS = ("_maybe_log_save_evaluate", "_save_checkpoint", "_get_output_dir")
"""Private ``Trainer`` methods AccumTrainer overrides (narrowly, calling ``super()``):
``_maybe_log_save_evaluate`` (called once per update after the optimizer step: the update is recorded there),
``_save_checkpoint`` and ``_get_output_dir`` (the checkpoint is written into a staging directory and renamed
once complete). :func:`check_trainer_hooks` fails loudly if a transformers release renames them."""


def check_trainer_hooks(trainer_class: type) -> None:
    """Raise when ``Trainer`` lacks a private method AccumTrainer relies on (a silent no-op override otherwise)."""
    missing = [name for name in TRAINER_PRIVATE_HOOKS if not callable(getattr(trainer_class, name, None))]
    if missing:
        raise RuntimeError(
            f"transformers.Trainer has no {', '.join(missing)} any more (checked against transformers 5.23): "
            "AccumTrainer cannot record updates and write atomic checkpoints with this version"
        )


def trainer_learning_rate(trainer: Any) -> float:
    """The LR of the current step, ``Trainer._get_learning_rate()`` (transformers 5.23): the fallback when
    ``_maybe_log_save_evaluate`` is not handed one."""
    return float(trainer._get_learning_rate())


def prepare_inputs(trainer: Any, batch: dict) -> dict:
    """``Trainer._prepare_inputs``: a collated batch moved to the device as ``training_step`` sees it
    (transformers 5.23)."""
    return trainer._prepare_inputs(batch)


def train_batch_size(trainer: Any) -> int:
    """The per-device micro-batch ``Trainer`` builds its dataloader with: ``Trainer._train_batch_size``, which
    ``auto_find_batch_size`` lowers after an out-of-memory error (transformers 5.23)."""
    return trainer._train_batch_size


def set_train_batch_size(trainer: Any, size: int) -> None:
    trainer._train_batch_size = size


# --------------------------------------------------------------------------------------------------
# TRL (checked: 1.16)
# --------------------------------------------------------------------------------------------------


def trl_metrics(trainer: Any, mode: str) -> dict[str, list[float]]:
    """``SFTTrainer._metrics[mode]``: the lists TRL's ``log`` averages into ``entropy``, ``mean_token_accuracy``,
    ``num_tokens`` (TRL 1.16)."""
    return trainer._metrics[mode]


def trl_train_tokens(trainer: Any) -> int:
    """``SFTTrainer._total_train_tokens``: TRL's running count of trained tokens (all ranks; TRL 1.16)."""
    return trainer._total_train_tokens


def add_trl_train_tokens(trainer: Any, tokens: int) -> None:
    trainer._total_train_tokens += tokens


def trl_reference_context(trainer: Any) -> contextlib.AbstractContextManager[Any]:
    """The context in which ``trainer.model`` is its own DPO reference, as ``DPOTrainer`` picks it (TRL 1.16,
    ``compute_ref_log_probs``): a PEFT model without ``ref_model`` is its base model with the adapters disabled
    (or the adapter named ``"ref"`` when one was loaded); anything else needs no context."""
    from accelerate.utils import is_peft_model
    from trl.trainer.utils import use_adapter

    if trainer.ref_model is not None or not is_peft_model(trainer.model):
        return contextlib.nullcontext()
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    return use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)


def trl_without_gradient_checkpointing(trainer: Any) -> contextlib.AbstractContextManager[Any]:
    """TRL 1.16's ``disable_gradient_checkpointing`` for a no-grad reference forward (what ``DPOTrainer`` does)."""
    from trl.models.utils import disable_gradient_checkpointing

    return disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs)


def evened_batches(accelerator: Any) -> contextlib.AbstractContextManager[None]:
    """A context in which dataloaders prepared by ``accelerator`` repeat examples to give every rank as many
    batches of the same size (``even_batches=True``). TRL 1.16's reference precompute pass (``_precompute_ref_logps``)
    all-gathers each batch's log-probs with ``gather_for_metrics``, which fails (gloo size mismatch) when ranks hold
    batches of different sizes; with even batches it drops the repeated rows itself."""
    @contextlib.contextmanager
    def context() -> Iterator[None]:
        previous = accelerator.even_batches
        accelerator.even_batches = True
        try:
            yield
        finally:
            accelerator.even_batches = previous

    return context()


def trl_precompute_model(trainer: Any) -> Any:
    """The model TRL 1.16's ``DPOTrainer._precompute_ref_logps`` scores the reference with: ``ref_model``, else the
    policy -- under DeepSpeed without ``ref_model`` (before ``train`` prepares the policy) one inference engine,
    built once and kept in ``_precompute_engine`` for the later passes (eval, ``evaluate``)."""
    if trainer.ref_model is not None:
        return trainer.ref_model
    if not trainer.is_deepspeed_enabled:
        return trainer.model
    if trainer._precompute_engine is None:
        from trl.models import prepare_deepspeed

        trainer._precompute_engine = prepare_deepspeed(trainer.model, trainer.accelerator)
    return trainer._precompute_engine


# GRPOTrainer (TRL 1.16, trl/trainer/grpo_trainer.py) -- AccumGRPOTrainer's private touches.


def wrap_trl_generation(trainer: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``GRPOTrainer._generate_and_score_completions`` (TRL 1.16: one call per generation batch) by
    ``wrap(original)``; False, and nothing changed, where this TRL has no such method."""
    original = getattr(trainer, "_generate_and_score_completions", None)
    if not callable(original):
        return False
    trainer._generate_and_score_completions = wrap(original)
    return True



def grpo_step(trainer: Any) -> int:
    """``GRPOTrainer._step``: micro-batches trained so far; ``_prepare_inputs`` generates when
    ``_step % (steps_per_generation * num_iterations) == 0`` and otherwise returns slice
    ``_step % steps_per_generation`` of its buffer; ``training_step`` adds 1 after each micro-batch (TRL 1.16)."""
    return trainer._step


def set_grpo_step(trainer: Any, step: int) -> None:
    trainer._step = step


class grpo_entropy_bonus_switch:  # noqa: N801 -- a context manager, named like one
    """Turn ``GRPOTrainer``'s entropy bonus (``_entropy_bonus_enabled``, TRL 1.16: read by ``_compute_loss`` only)
    on or off for one loss computation, and restore it."""

    def __init__(self, trainer: Any, enabled: bool) -> None:
        if not hasattr(trainer, "_entropy_bonus_enabled"):
            raise RuntimeError("trl.GRPOTrainer has no _entropy_bonus_enabled any more (checked: TRL 1.16): "
                               "AccumGRPOTrainer cannot carry the entropy bonus as a term of its own")
        self.trainer, self.enabled = trainer, enabled

    def __enter__(self) -> None:
        self.previous = self.trainer._entropy_bonus_enabled
        self.trainer._entropy_bonus_enabled = self.enabled

    def __exit__(self, *exc: Any) -> None:
        self.trainer._entropy_bonus_enabled = self.previous


def trl_grpo_divisor(trainer: Any, inputs: dict, mask: torch.Tensor) -> float | torch.Tensor:
    """What ``GRPOTrainer._compute_loss`` (TRL 1.16, training mode) divides a micro-batch's summed loss by, per
    ``loss_type``, so that ``loss * divisor`` is the micro-batch's sum again (K = the update's micro-batches,
    ``current_gradient_accumulation_steps``; W = processes):

    - grpo, sapo, luspo: rows x K (a mean over the micro-batch's completions, divided by K);
    - bnpo: max(1, the micro-batch's tokens) x K;
    - dr_grpo: rows x max_completion_length x K;
    - dapo, cispo, vespo: max(1, num_items_in_batch) / W x K / steps_per_generation (the generation batch's tokens
      over all ranks, scaled to an average window: not this window's count).
    """
    loss_type = trainer.loss_type
    k = trainer.current_gradient_accumulation_steps
    rows = mask.shape[0]
    if loss_type in ("grpo", "sapo", "luspo"):
        return rows * k
    if loss_type == "bnpo":
        return mask.sum().clamp(min=1.0).detach() * k
    if loss_type == "dr_grpo":
        return rows * trainer.max_completion_length * k
    if loss_type in ("dapo", "cispo", "vespo"):
        generation_tokens = torch.as_tensor(inputs["num_items_in_batch"]).clamp(min=1.0).detach()
        return generation_tokens / trainer.accelerator.num_processes * k / trainer.args.steps_per_generation
    raise ValueError(f"no TRL 1.16 divisor known for loss_type={loss_type!r}")


def forget_gguf_quantization(model: torch.nn.Module) -> None:
    """Make a model loaded from a GGUF file, dequantized, a plain model again (transformers 5.23).

    ``from_pretrained(..., gguf_file=...)`` attaches a ``GgufHfQuantizer``. For an architecture its newer GGUF
    path does not cover (Llama, Gemma 3: ``GgufHfQuantizer.supported`` is False) the legacy loader dequantizes
    every weight to a plain tensor, yet the quantizer stays attached: ``model.hf_quantizer``,
    ``model.is_quantized``, ``model.quantization_method``, ``config.quantization_config`` and each
    sub-model's ``config._is_quantized``. Then ``save_pretrained`` refuses ("quantized with gguf and is not
    serializable": ``GgufHfQuantizer.is_serializable()`` is False) and ``Trainer`` refuses full fine-tuning of
    a "quantized" model (``trainer_utils.validate_quantization_for_training``). The quantizer's own
    ``remove_quantization_config`` -- what transformers itself runs after a ``GgufConfig(dequantize=True)``
    load on its newer path -- clears the first four; ``_is_quantized`` is set per sub-model by
    ``quantizers.base._assign_is_quantized``. Refuses a model whose weights are still packed in GGUF blocks
    (``GgufLinear`` modules): those are really quantized."""
    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Gguf")})
    if packed:
        raise RuntimeError(f"the GGUF model still holds packed weights ({', '.join(packed)}): load it with "
                           "quantization_config=GgufConfig(dequantize=True)")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        method = getattr(quantizer.quantization_config, "quant_method", None)
        if str(getattr(method, "value", method)) != "gguf":
            raise RuntimeError(f"the model is quantized with {method}, not loaded from a GGUF file: it stays quantized")
        quantizer.remove_quantization_config(model)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_is_quantized"):
            del config._is_quantized


def cache_gguf_tensor_name_maps() -> None:
    """Build gguf's tensor-name map of an architecture once per process instead of once per module (gguf 0.17,
    transformers 5.23: ``get_gguf_hf_weights_map`` recurses over every module of the model and calls
    ``gguf.get_tensor_name_map(arch, n_blocks)`` in each, 397 times for SmolLM2-135M: ~13-18 s of a ~60 s load on
    a busy 2-core CPU). The map depends only on its two arguments and is read, never changed, so one cached map
    serves every call. transformers imports the name inside the function (``from gguf import ...``), so replacing
    the module attribute is enough; a gguf without it is left as it is."""
    import functools

    import gguf

    current = getattr(gguf, "get_tensor_name_map", None)
    if current is None or hasattr(current, "cache_info"):
        return
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(current)
