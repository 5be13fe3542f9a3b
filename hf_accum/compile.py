"""``torch.compile`` under exact accumulation: the model's repeated blocks compiled in place (regional compilation).

Both front-ends call :func:`compile_blocks` (``LoopConfig(compile=True)``; ``TrainingArguments(torch_compile=True)``
in :class:`~hf_accum.trainer.AccumTrainer`; ``training.torch_compile=true`` in the recipe, either engine).

Why the blocks and not the whole model (measured, ``docs/measurements.md``, "torch.compile"):

* **The fused loss stays outside every graph.** It makes the output layer return the loss by replacing the
  layer's ``forward`` for one call (:func:`hf_accum.fused.head._head_returns_loss`), a new function every
  micro-batch. A whole-model graph breaks there and recompiles on every micro-batch until Dynamo's
  ``recompile_limit`` (8), then runs eager (measured on the tiny Llama: 26 graphs and 16 graph breaks for 8
  micro-batches). Compiled blocks never see the head: embeddings, the final norm, the head and the loss run
  eager, exactly as without compile, and the loss is the eager fused loss.
* **Compile time does not grow with depth.** The blocks of a decoder run the same code on the same shapes, and
  Dynamo inlines modules with their parameters as graph inputs, so every layer reuses the first one's graph.
* **In place** (what ``nn.Module.compile`` does: the block's ``_compiled_call_impl``): the model keeps its class,
  its ``state_dict`` keys and its hooks; DDP, PEFT and gradient checkpointing wrap the compiled call as they wrap
  the eager one, so checkpoints, the exactness auditors and ``save_pretrained`` see the same module.
* **Training forwards only.** A block runs its compiled graph when autograd records (training, and the recompute
  of gradient checkpointing) and eager under ``no_grad``: evaluation, the first micro-batch's probes and
  generation (a KV-cache decode step changes Dynamo's guards at every token: it would recompile up to the limit
  for no gain on a held-out pass).

Variable lengths: Dynamo compiles the first shape statically and, at the second sequence length, one graph with a
dynamic length that serves every later one (``dynamic=None``, its automatic dynamic shapes), so a run compiles a
bounded number of graphs per grad mode (training, and no-grad evaluation) whatever its lengths;
``dynamic=True`` starts dynamic; ``pad_to_multiple_of`` in the collator keeps static graphs, one per padded length
(the trade-off measured in ``benchmarks/compile.py``). Exactness is unchanged: a compiled block computes the same
functions (float64 tests: the big-batch gradient within 1e-10, compiled with inductor).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("hf_accum.compile")

BACKENDS_CHECKED = ("inductor", "aot_eager", "eager")
"""Backends the exactness tests run (any other registered backend is accepted, and unverified here)."""


class CompileError(ValueError):
    """The model has nothing ``compile_blocks`` can compile, or a setting it cannot keep exact."""


def repeated_blocks(model: nn.Module) -> list[nn.ModuleList]:
    """The outermost ``nn.ModuleList`` s whose children are all of one class and hold parameters (a decoder's
    layers; under PEFT the adapted layers, whose LoRA matrices are then inside the compiled blocks)."""
    found: list[nn.ModuleList] = []
    stack: list[nn.Module] = [model]
    while stack:
        module = stack.pop()
        if _is_repeated(module):
            found.append(module)  # type: ignore[arg-type]
            continue  # its blocks are compiled whole: nothing inside them is compiled apart
        stack.extend(reversed(list(module.children())))
    return found


def _is_repeated(module: nn.Module) -> bool:
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        return False
    first = type(module[0])
    return all(type(block) is first for block in module) and any(True for _ in module.parameters())


def compile_blocks(model: nn.Module, backend: str | None = "inductor", mode: str | None = None,
                   dynamic: bool | None = None) -> int:
    """Compile every repeated block of ``model`` in place (``block.compile(...)``); returns how many.
    Idempotent: blocks compiled before are left as they are. :class:`CompileError` when the model has none."""
    lists = repeated_blocks(model)
    if not lists:
        raise CompileError(f"torch_compile: {type(model).__name__} has no repeated blocks (an nn.ModuleList of one "
                           "block class, e.g. decoder layers) to compile; train it without torch_compile")
    options: dict[str, Any] = {"backend": backend or "inductor", "dynamic": dynamic}
    if mode is not None:
        options["mode"] = mode
    blocks = [block for blocks in lists for block in blocks]
    for block in blocks:
        if getattr(block, "_compiled_call_impl", None) is None:
            block._compiled_call_impl = _training_call(block, torch.compile(block._call_impl, **options))
    logger.info("torch.compile (%s%s): %d blocks of %s compiled in place; embeddings, head and loss stay eager",
                options["backend"], f", mode {mode}" if mode else "", len(blocks),
                ", ".join(sorted({type(block).__name__ for block in blocks})))
    return len(blocks)


def _training_call(block: nn.Module, compiled: Any) -> Any:
    """``block``'s call: ``compiled`` while autograd records, the eager call otherwise (module docstring)."""
    eager = block._call_impl

    def call(*args: Any, **kwargs: Any) -> Any:
        return compiled(*args, **kwargs) if torch.is_grad_enabled() else eager(*args, **kwargs)

    call.hf_accum_compiled = compiled  # type: ignore[attr-defined]
    return call


def compiled_blocks(model: nn.Module) -> int:
    """How many modules of ``model`` carry an in-place compiled call (0: none)."""
    return sum(getattr(module, "_compiled_call_impl", None) is not None for module in model.modules())


def whole_model_compiled(model: Any) -> bool:
    """``model`` is a ``torch.compile(model)`` wrapper (what ``Accelerator(dynamo_backend=...)`` prepares)."""
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
