"""What a loop checkpoint holds and how it is saved and loaded (:class:`LoopCheckpointer`), and the random
states every rank must get back for an exact resume.

The writing is :func:`hf_accum.checkpointing.checkpoint.staged_checkpoint` (atomic, verified by its manifest); this
module owns the contents: the model in safetensors (only the adapter for PEFT models), optimizer, LR scheduler,
GradScaler (under DeepSpeed: its own per-rank files; under FSDP2: sharded state through
``torch.distributed.checkpoint``), the update counter and log, the data position (epoch and micro-batches
consumed) and every random state of every rank -- including the state the epoch's shuffle was drawn from.
Pickles are read only with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from hf_accum.checkpointing.checkpoint import (
    DEEPSPEED_TAG,
    LOOP_STATE_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    SCALER_FILE,
    SCHEDULER_FILE,
    ResumeMismatchError,
    check_resume_engine,
    check_resume_plan,
    checkpoint_path,
    rotate_checkpoints,
    save_batch_plan,
    staged_checkpoint,
)
from hf_accum.checkpointing.fsdp_checkpoint import check_fsdp_resume, is_fsdp_model, load_fsdp_state, save_fsdp_state
from hf_accum.planning.schedule import BatchPlan

logger = logging.getLogger("hf_accum.checkpointing.checkpoint")


# -- random states ------------------------------------------------------------------------------------


def data_generators(dataloader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a (prepared) dataloader draws its order from: its own, Accelerate's
    synchronized one, its samplers' and its dataset's; each once, in a fixed order."""
    found: list[torch.Generator] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if obj is None or depth > 4:
            return
        if isinstance(obj, torch.Generator):
            if id(obj) not in seen:
                seen.add(id(obj))
                found.append(obj)
            return
        for name in ("generator", "synchronized_generator", "batch_sampler", "sampler", "dataset"):
            child = getattr(obj, name, None)
            if child is not None and child is not obj and not isinstance(child, (str, int, float)):
                visit(child, depth + 1)

    visit(dataloader, 0)
    return found


def capture_random_states(generators: Iterable[torch.Generator] = ()) -> dict[str, Any]:
    """Python, numpy, torch (CPU and every visible CUDA device) and the given generators' states, in a form
    ``torch.load(weights_only=True)`` reads back (numpy's key array becomes a tensor)."""
    numpy_state: Any = np.random.get_state()  # the legacy tuple form (typed as a union with the dict form)
    kind, keys, position, has_gauss, cached_gaussian = numpy_state
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        "generators": [generator.get_state() for generator in generators],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_random_states(state: dict[str, Any], generators: Iterable[torch.Generator] | None = ()) -> None:
    """Restore what :func:`capture_random_states` captured; ``generators=None`` leaves the data generators
    alone (only the global random states are restored)."""
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["position"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generators is None:
        return
    generators = list(generators)
    if len(generators) != len(state["generators"]):
        raise ValueError(
            f"the dataloader draws its order from {len(generators)} random generators, the checkpoint saved "
            f"{len(state['generators'])}: resume with the same dataloader setup (shuffle, sampler, generator)"
        )
    for generator, saved in zip(generators, state["generators"]):
        generator.set_state(saved)


# -- the loop's checkpoints ----------------------------------------------------------------------------


@dataclass
class LoopState:
    """The JSON part of a loop checkpoint."""

    update: int
    """Updates done (applied or skipped): the next update is ``update + 1``."""
    epoch: int
    """The epoch the next micro-batch comes from."""
    micro_batches_in_epoch: int
    """Micro-batches of that epoch already consumed on each process (skipped on resume)."""
    planned_updates: int
    micro_batches_per_epoch: int | None = None
    """Per process (None for a stream): another number means other data, and the position would be wrong."""
    window_magnitude: float | None = None
    """fp16 only: the loss magnitude hint carried from window to window (hf_accum.loop.steppers.LossMagnitude)."""
    consecutive_nonfinite: int = 0
    noise_scale: dict | None = None
    """With noise-scale tracking: the moving averages (``NoiseScaleTracker.state_dict``), continued on resume."""
    log_history: list[dict] = field(default_factory=list)
    """Every update's log so far (``UpdateLog`` fields), so a resumed run reports the whole run."""
    window_plan: str | None = None
    """Ramp-up / token budget: the planned windows' fingerprint (``WindowPlan.digest``); another plan is refused."""


@dataclass
class _Resumed:
    state: LoopState
    random_states: dict[str, Any]


class LoopCheckpointer:
    """Writes and reads :func:`hf_accum.loop.train`'s checkpoints and replays the data position.

    ``model``, ``optimizer`` and ``dataloader`` are the objects ``accelerator.prepare`` returned; the LR
    scheduler is the loop's own (not prepared). ``output_dir`` must be one directory shared by all processes.
    """

    def __init__(
        self, output_dir: str | None, accelerator: Any, model: torch.nn.Module, optimizer: Any, scheduler: Any,
        dataloader: Any, plan: BatchPlan, save_total_limit: int | None = None,
    ) -> None:
        self.output_dir = output_dir
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.plan = plan
        self.save_total_limit = save_total_limit
        self.generators = data_generators(dataloader)
        self._epoch_start_states: dict[str, Any] | None = None
        self._pending: _Resumed | None = None

    # -- saving ------------------------------------------------------------------------------------
    def save(self, state: LoopState) -> str:
        """Write ``checkpoint-<state.update>`` (every rank calls this at the same update). Returns its path."""
        if self.output_dir is None:  # a checkpointer built only to resume: the loop saves nowhere then
            raise ValueError("LoopCheckpointer.save needs an output directory (LoopConfig.output_dir)")
        output_dir = self.output_dir
        accelerator = self.accelerator
        is_main = accelerator.is_main_process
        random_states = {"now": capture_random_states(self.generators), "epoch_start": self._epoch_start_states}
        with staged_checkpoint(
            output_dir, state.update, commits=is_main, barrier=accelerator.wait_for_everyone,
            seal=lambda folder: save_batch_plan(folder, self.plan),
        ) as folder:
            torch.save(random_states, os.path.join(folder, _rng_file(accelerator.process_index)))
            engine = _deepspeed_engine(accelerator)
            fsdp = is_fsdp_model(self.model)
            if engine is not None:  # collective: every rank writes its shards of weights and optimizer state
                engine.save_checkpoint(folder, tag=DEEPSPEED_TAG, save_latest=False)
            elif fsdp:  # collective as well (torch.distributed.checkpoint)
                save_fsdp_state(folder, self.model, self.optimizer, accelerator.num_processes, is_main)
            if is_main:
                if engine is None and not fsdp:
                    _save_model(accelerator.unwrap_model(self.model), folder)
                    torch.save(self.optimizer.state_dict(), os.path.join(folder, OPTIMIZER_FILE))
                torch.save(self.scheduler.state_dict(), os.path.join(folder, SCHEDULER_FILE))
                if accelerator.scaler is not None:
                    torch.save(accelerator.scaler.state_dict(), os.path.join(folder, SCALER_FILE))
                with open(os.path.join(folder, LOOP_STATE_FILE), "w") as handle:
                    json.dump(asdict(state), handle)
        if is_main:
            rotate_checkpoints(output_dir, self.save_total_limit)
        accelerator.wait_for_everyone()
        return checkpoint_path(output_dir, state.update)

    # -- resuming ----------------------------------------------------------------------------------
    def resume(self, checkpoint: str, micro_batches_per_epoch: int | None) -> LoopState:
        """Load ``checkpoint`` into the model, optimizer, scheduler and scaler (every rank); the data position
        and random states are applied by :meth:`epoch_batches`. Refuses another batch plan first."""
        check_resume_plan(checkpoint, self.plan)
        with open(os.path.join(checkpoint, LOOP_STATE_FILE)) as handle:
            state = LoopState(**json.load(handle))
        if state.micro_batches_per_epoch != micro_batches_per_epoch:
            raise ResumeMismatchError(
                f"cannot resume from {checkpoint}: it was trained on {state.micro_batches_per_epoch} micro-batches "
                f"per epoch and process, this run has {micro_batches_per_epoch} (other data?); the data position "
                "would be wrong. Resume with the checkpoint's data"
            )
        rng_path = os.path.join(checkpoint, _rng_file(self.accelerator.process_index))
        random_states = _load(rng_path)
        engine = _deepspeed_engine(self.accelerator)
        check_resume_engine(checkpoint, deepspeed=engine is not None)
        fsdp = is_fsdp_model(self.model)
        check_fsdp_resume(checkpoint, self.model if fsdp else None, self.accelerator.num_processes)
        if engine is not None:
            _load_deepspeed_state(engine, checkpoint)
        elif fsdp:
            load_fsdp_state(checkpoint, self.model, self.optimizer)
        else:
            _load_model(self.accelerator.unwrap_model(self.model), checkpoint)
            self.optimizer.load_state_dict(_load(os.path.join(checkpoint, OPTIMIZER_FILE)))
        self.scheduler.load_state_dict(_load(os.path.join(checkpoint, SCHEDULER_FILE)))
        if self.accelerator.scaler is not None:
            self.accelerator.scaler.load_state_dict(_load(os.path.join(checkpoint, SCALER_FILE)))
        if micro_batches_per_epoch is not None and state.micro_batches_in_epoch >= micro_batches_per_epoch:
            state.epoch, state.micro_batches_in_epoch = state.epoch + 1, 0  # saved at an epoch's very end
        self._pending = _Resumed(state, random_states)
        return state

    def epoch_batches(self, dataloader: Any, epoch: int) -> tuple[Iterable, int]:
        """The micro-batches of ``epoch`` to train on and how many of the epoch precede them: the whole
        dataloader and 0, or -- in the epoch a resume lands in -- the ones not consumed yet, in the order the
        interrupted run would have seen them, and the number consumed.

        Call after ``dataloader.set_epoch(epoch)`` and right before iterating (the epoch's order is drawn
        from the random states at that moment, which this records for the epoch's checkpoints).
        """
        pending, self._pending = self._pending, None
        if pending is not None and pending.state.epoch == epoch and pending.state.micro_batches_in_epoch > 0:
            self._epoch_start_states = pending.random_states["epoch_start"]
            return self._rest_of_epoch(dataloader, pending), pending.state.micro_batches_in_epoch
        if pending is not None:  # the checkpoint sits at this epoch's start
            restore_random_states(pending.random_states["now"], self.generators)
        self._epoch_start_states = capture_random_states(self.generators)
        return dataloader, 0

    def _rest_of_epoch(self, dataloader: Any, pending: _Resumed) -> Iterator:
        """The epoch's order is re-drawn from the states saved at its start; Accelerate's
        ``skip_first_batches`` then skips the consumed micro-batches by index (without loading them).

        Fetching the first remaining batch starts the sampler, and -- fetching one batch ahead -- may already
        reach the sampler's end, where it draws again; the interrupted run made that draw after the
        checkpoint. So the data generators keep the state this replay gives them (the same draws from the
        same start), and only the global states (dropout, ...) of the checkpoint's moment are restored, after
        that fetch and before any forward pass. (A collator that draws from the global states would see its
        draws of the first prefetched batch overwritten; the collators of this package draw none.)"""
        from accelerate import skip_first_batches

        restore_random_states(pending.random_states["epoch_start"], self.generators)
        iterator = iter(skip_first_batches(dataloader, pending.state.micro_batches_in_epoch))
        first = next(iterator, _END)
        restore_random_states(pending.random_states["now"], generators=None)
        if first is _END:
            return
        yield first
        yield from iterator


_END = object()


def _deepspeed_engine(accelerator: Any) -> Any:
    """The DeepSpeed engine of a DeepSpeed Accelerator (after ``prepare``), else None."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return wrapped.engine if wrapped is not None else None


def _load_deepspeed_state(engine: Any, checkpoint: str) -> None:
    """Weights and optimizer state from DeepSpeed's own files (each rank reads its ZeRO shards); the LR
    scheduler is the loop's, saved beside them (the engine has none)."""
    path, _ = engine.load_checkpoint(
        checkpoint, tag=DEEPSPEED_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
    )
    if path is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint to load in {os.path.join(checkpoint, DEEPSPEED_TAG)}")


def _rng_file(process_index: int) -> str:
    return f"rng_state_{process_index}.pth"


def _load(path: str) -> Any:
    """Read a pickle written by this module: tensors and plain containers only."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint file {path} is missing (a checkpoint of another run layout?)") from None


def _is_peft_model(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency; without it no model is a PeftModel
        return False
    return isinstance(model, PeftModel)


def _save_model(model: torch.nn.Module, folder: str) -> None:
    """PEFT: the adapter only (``adapter_model.safetensors``, ``adapter_config.json``), which is all that
    trains; otherwise every weight in ``model.safetensors`` (tied weights stored once)."""
    if _is_peft_model(model):
        peft_model: Any = model
        peft_model.save_pretrained(folder, safe_serialization=True)
        return
    from safetensors.torch import save_model

    save_model(model, os.path.join(folder, MODEL_FILE))


def _load_model(model: torch.nn.Module, folder: str) -> None:
    if _is_peft_model(model):
        from peft import load_peft_weights, set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_peft_weights(folder, device="cpu"))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"checkpoint {folder} holds adapter weights this model lacks: {unexpected[:5]}")
        return
    from safetensors.torch import load_model

    path = os.path.join(folder, MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {folder} has no {MODEL_FILE} (saved from a PEFT model?)")
    try:
        missing, unexpected = load_model(model, path, strict=False)
    except RuntimeError as error:  # shape mismatches
        raise ValueError(f"checkpoint {folder} does not fit this model: {str(error).splitlines()[0]}") from None
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {folder} does not fit this model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
