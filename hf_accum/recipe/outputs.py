"""A recipe run's output directory and console: claiming the directory, per-update records, the final files.

This module owns what a recipe run leaves behind and what it prints:

* **the output directory's life cycle** -- checked before any model is loaded (a directory holding
  another run is refused, a finished run is not silently retrained, an unfinished one is resumed
  only when asked, a file or an unwritable path is found *before* training); claimed by writing
  ``resolved_config.yaml`` once training starts (so a killed run is recognised as this run's own
  directory); and completed by the final files, each written to a temporary name and renamed into
  place, ``metrics.json`` last (its presence marks a finished run);
* **per-update records** from either engine (``hf_accum.UpdateLog``), kept for ``metrics.json`` and
  the loss/LR plot, and printed every ``logging_steps`` updates;
* **the process edge**: ``run_cli`` turns configuration/data/model errors into one ``error:`` line
  and exit code 2, a full disk into one line naming the last good checkpoint and exit code 3, too many
  inf/NaN updates in a row into exit code 5, and Ctrl-C into one line and exit code 130.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

from hf_accum.checkpointing.checkpoint import OutputDirNotWritable, check_output_dir_writable, write_text_atomically
from hf_accum.checkpointing.run_lock import LOCK_NAME
from hf_accum.distributed import is_main_process
from hf_accum.errors import EXIT_BAD_INPUT, EXIT_DISK_FULL, EXIT_INTERRUPTED, EXIT_NONFINITE, InputError
from hf_accum.recipe import config as config_module
from hf_accum.recipe.cpu_bf16 import SDPA_FLOAT32
from hf_accum.recipe.progress import phase_bar, quiet_third_party_warnings  # noqa: F401 -- one import path

METRICS_NAME = "metrics.json"
PLOT_NAME = "training_curves.png"
ADAPTER_DIR = "adapter"
MODEL_DIR = "model"


def say(*parts: Any) -> None:
    """Print on the main process only (every rank runs the same script)."""
    if is_main_process():
        print(*parts, flush=True)


def barrier() -> None:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


# ----------------------------------------------------------------------------------------------
# The output directory, before anything is loaded
# ----------------------------------------------------------------------------------------------


class OutputDirError(config_module.ConfigError):
    """The output directory cannot take this run (another run, a file, not writable)."""


def check_output_dir(config: config_module.RecipeConfig, resume: bool) -> str:
    """What the run will do with ``training.output_dir``: ``"fresh"``, ``"resume"`` or raise.

    Refuses: a regular file or an unwritable path; a directory with foreign files; a directory
    holding a *different* run (its saved config differs; ``overwrite_output_dir`` allows it); a
    finished run of the same config (retraining would overwrite it silently); an unfinished run
    with checkpoints when not resuming (say which: resume, or overwrite).
    """
    out = config.training["output_dir"]
    probe_writable(out)
    given = config.training.get("resume_from_checkpoint")
    if isinstance(given, str) and not os.path.isdir(given):
        raise OutputDirError(f"training.resume_from_checkpoint={given!r}: no such checkpoint directory")
    if config.overwrite_output_dir or not _entries(out):
        return "resume" if resume and _entries(out) else "fresh"
    saved_path = os.path.join(out, config_module.RESOLVED_CONFIG_NAME)
    if not os.path.isfile(saved_path):
        raise OutputDirError(
            f"output dir {out!r} is not empty and holds no {config_module.RESOLVED_CONFIG_NAME} (not a recipe run); "
            "choose another training.output_dir or set overwrite_output_dir: true"
        )
    # Where the directory is is not part of the run: a run moved (or copied) elsewhere resumes in place.
    diff = [line for line in config_module.differences(config_module.load_yaml(saved_path), config.to_dict())
            if not line.startswith("training.output_dir:")]
    if diff:
        raise OutputDirError(
            f"output dir {out!r} holds a different run ({'; '.join(diff[:5])}); choose another "
            "training.output_dir or set overwrite_output_dir: true"
        )
    if os.path.isfile(os.path.join(out, METRICS_NAME)):
        raise OutputDirError(
            f"output dir {out!r} holds a finished run of this config ({METRICS_NAME} is there); to train it again "
            "set overwrite_output_dir: true, or choose another training.output_dir"
        )
    if resume:
        return "resume"
    checkpoints = [name for name in os.listdir(out) if name.startswith("checkpoint-")]
    if checkpoints:
        raise OutputDirError(
            f"output dir {out!r} holds an unfinished run of this config with {len(checkpoints)} checkpoint(s); add "
            "training.resume_from_checkpoint=true to continue it, or set overwrite_output_dir: true to start over"
        )
    return "fresh"  # an earlier attempt died before its first checkpoint: nothing to resume


def _entries(out: str) -> list[str]:
    """What ``out`` holds, this run's own lock file (:mod:`hf_accum.checkpointing.run_lock`) left out; nothing when it
    does not exist. The main rank's :func:`probe_writable` may create and remove ``out`` while another rank reads it
    (seen under torchrun: ``isdir`` true, then ``listdir`` found it gone), so a directory that vanishes is empty."""
    try:
        return [name for name in os.listdir(out) if name != LOCK_NAME]
    except (FileNotFoundError, NotADirectoryError):
        return []


def probe_writable(path: str) -> None:
    """The output directory can be written: :func:`hf_accum.checkpointing.checkpoint.check_output_dir_writable`, on the
    main process, leaving nothing behind (the directories created for the probe are removed again)."""
    if not is_main_process():
        # One rank probes the (shared) directory: two probing at once race on the directories the probe creates
        # and removes again ("File exists", or a directory gone under the other rank's probe file).
        return
    try:
        check_output_dir_writable(path, "training.output_dir", keep_created=False)
    except OutputDirNotWritable as error:
        raise OutputDirError(str(error)) from None


def claim_output_dir(config: config_module.RecipeConfig) -> None:
    """Mark the directory as this run's (``resolved_config.yaml``), before training starts."""
    if is_main_process():
        out = config.training["output_dir"]
        os.makedirs(out, exist_ok=True)
        write_text_atomically(os.path.join(out, config_module.RESOLVED_CONFIG_NAME), config.to_yaml())


# The held-out metric before training, scored once per output directory: a resumed run reads it back.
EVAL_BEFORE_NAME = "eval_before.json"


def saved_eval_before(config: config_module.RecipeConfig) -> tuple[bool, Any]:
    """``(found, result)``: the before-training metric this run's directory holds from an earlier start of the same
    run (its saved config equal to this one, where the directory is left aside), read by the main process and
    handed to every rank (they decide alike whether to score: a partitioned model scores on all ranks in step)."""
    found, result = False, None
    if is_main_process():
        path = os.path.join(config.training["output_dir"], EVAL_BEFORE_NAME)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            with open(path) as handle:
                saved = json.load(handle)
            same_run = not [line for line in config_module.differences(saved["config"], config.to_dict())
                            if not line.startswith("training.output_dir:")]
            found, result = same_run, saved["result"] if same_run else None
    return _from_main_process((found, result))


def save_eval_before(config: config_module.RecipeConfig, result: Any) -> None:
    """Keep the before-training metric (None: not scored) with the config it was scored for (main process)."""
    if is_main_process():
        path = os.path.join(config.training["output_dir"], EVAL_BEFORE_NAME)
        write_text_atomically(path, json.dumps({"config": config.to_dict(), "result": result}, default=str))


def _from_main_process(value: Any) -> Any:
    """``value`` as the main process has it, on every rank (a broadcast when there is a process group)."""
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


# ----------------------------------------------------------------------------------------------
# During and after the run
# ----------------------------------------------------------------------------------------------


@dataclass
class RunRecord:
    """Everything ``metrics.json`` holds; filled by the recipe as the run goes."""

    config: config_module.RecipeConfig
    started: float
    updates: list[dict[str, Any]] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    noise_scale_advice: str | None = None
    """``accumulation.noise_scale``: the end-of-run line on the batch size (also in metrics.json)."""
    utilization: dict[str, Any] | None = None
    """Either engine's :func:`hf_accum.measure.utilization.summarize`: ``flops_per_update``, ``flops_per_second``,
    ``mfu``, the peak and its source (top-level keys of metrics.json; each update's own are in ``updates``)."""
    resumed_at: int = 0
    """The update the run resumed after (its checkpoint's number); 0 for a fresh start. The updates up to it were
    trained by an earlier process: ``updates`` holds them too, the end line and ``trained_*`` do not."""

    def keep_update(self, update: Any) -> None:  # an hf_accum.UpdateLog
        """``on_update``: keep every update for ``metrics.json`` and the plot."""
        self.updates.append(asdict(update))

    def record_update(self, update: Any) -> None:  # an hf_accum.UpdateLog
        """``on_update``: keep every update, and print one line every ``logging_steps`` (and at every change of the
        auto batch ramp, with its reason)."""
        self.keep_update(update)
        every = max(1, int(self.config.training.get("logging_steps", 10) or 1))
        if update.step == 1 or update.step % every == 0 or getattr(update, "batch_change", None):  # auto ramp
            from tqdm.auto import tqdm

            if is_main_process():
                tqdm.write(update.line())

    def add_result(self, plan: Any, **facts: Any) -> None:
        """The batch plan that ran (``hf_accum.planning.schedule.BatchPlan``) and the run's other facts, for
        metrics.json."""
        self.facts.update(
            world_size=plan.num_processes, batch_plan=plan.describe(), micro_batch_size=plan.micro_batch_size,
            accumulation_steps=plan.accumulation_steps, global_batch_size=plan.global_batch_size, **facts,
        )

    @property
    def wall_seconds(self) -> float:
        return time.time() - self.started

    def metrics(self) -> dict[str, Any]:
        advice = {"noise_scale_advice": self.noise_scale_advice} if self.noise_scale_advice else {}
        here = self.trained_here()
        trained = {"resumed_after_update": self.resumed_at, "trained_updates": len(here),
                   "trained_targets": sum(int(u.get("targets", 0)) for u in here), "total_updates": len(self.updates)}
        return {"engine": self.config.engine, **self.facts, **trained, **advice, **(self.utilization or {}),
                "wall_seconds": self.wall_seconds, "updates": self.updates}

    def trained_here(self) -> list[dict[str, Any]]:
        """The updates this process trained (a resumed run's ``updates`` include the ones before its checkpoint)."""
        return [update for update in self.updates if int(update.get("step", 0)) > self.resumed_at]

    def trained_line(self, seconds: float, unit: str = "tokens") -> str:
        """``trained 1 update (8 in all), 36 tokens (290 in all) in 52 s``: what this process trained, and for a
        resumed run the run's totals beside it. ``unit``: what ``targets`` counts (tokens; DPO: pairs)."""
        here = self.trained_here()
        count, targets = len(here), sum(int(u.get("targets", 0)) for u in here)
        updates = f"{count} update{'' if count == 1 else 's'}"
        amount = f"{targets:,} {unit}"
        if self.resumed_at:
            updates += f" ({len(self.updates)} in all)"
            amount += f" ({sum(int(u.get('targets', 0)) for u in self.updates):,} in all)"
        return f"trained {updates}, {amount} in {seconds:.0f} s"

    def utilization_line(self) -> str:
        """The end line's utilization: model FLOPs per update, achieved FLOP/s, MFU and the peak it is measured
        against (:func:`hf_accum.measure.utilization.describe`); no MFU when there is no peak to measure it against."""
        from hf_accum.measure.utilization import describe

        summary = self.utilization or {}
        if summary.get("flops_per_update") is not None and not summary.get("peak_flops"):
            achieved = summary.get("flops_per_second")
            rate = f", {achieved / 1e9:,.1f} GFLOP/s" if achieved is not None else ""
            return (f"model FLOPs {summary['flops_per_update']:.3g}/update{rate} (no MFU: no peak FLOP/s known for "
                    "this device; set accumulation.peak_flops to get one)")
        return describe(summary)


def save_outputs(record: RunRecord, model: Any, tokenizer: Any) -> str:
    """Adapter (or model) + tokenizer, the loss/LR plot, then ``metrics.json`` (the run is finished)."""
    from hf_accum.distributed import save_pretrained

    config = record.config
    out = config.training["output_dir"]
    main = is_main_process()
    target = os.path.join(out, ADAPTER_DIR if config.lora is not None else MODEL_DIR)
    temporary = f"{target}.tmp"
    # weights, tokenizer, plot, metrics.json: a bar of 4 steps (a full model's weights take a while)
    with phase_bar(4, f"writing {os.path.basename(target)}/, plot and {METRICS_NAME}", unit="file") as advance:
        # Every rank: under ZeRO-3 the sharded parameters are gathered (a collective); the main process writes.
        try:
            save_pretrained(model, temporary, main)
            advance(1)
            if main:
                tokenizer.save_pretrained(temporary)
            advance(1)
        except BaseException:  # a full disk: the unfinished copy goes, the checkpoints stay
            if main:
                shutil.rmtree(temporary, ignore_errors=True)
            raise
        if not main:
            return out
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(temporary, target)  # the finished weights appear whole, or not at all
        drawn = not record.updates or plot_curves(record.updates, os.path.join(out, PLOT_NAME), title=run_title(config))
        advance(1)
        write_text_atomically(os.path.join(out, METRICS_NAME), json.dumps(record.metrics(), indent=2, default=str))
        advance(1)
    if not drawn:
        say(f"note: {PLOT_NAME} not drawn: matplotlib is not installed (pip install 'hf_accum[recipe]')")
    return out


def run_title(config: config_module.RecipeConfig) -> str:
    kind = "full fine-tuning" if config.lora is None else ("QLoRA" if config.quantization else "LoRA")
    return f"{config.model.name_or_path} - {kind} - engine {config.engine} - {config.data.dataset}"


def plot_curves(updates: list[dict[str, Any]], path: str, title: str = "") -> bool:
    """Per-update loss (and held-out loss where evaluated), LR, and a panel with tokens per update and the
    measured gradient noise scale (when tracked), against integer update numbers. False (nothing drawn)
    without matplotlib: the ``recipe`` extra, imported only here."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [u["step"] for u in updates]
    fig, (ax_loss, ax_lr, ax_batch) = plt.subplots(3, 1, figsize=(8, 7.5), sharex=True)
    ax_loss.plot(steps, [u.get("loss", math.nan) for u in updates], lw=1, label="training loss (per-token mean)")
    evaluated = [(u["step"], u["eval_loss"]) for u in updates if u.get("eval_loss") is not None]
    if evaluated:
        ax_loss.plot(*zip(*evaluated), "o-", ms=3, label="held-out loss (per-token mean)")
    ax_loss.set_ylabel("loss")
    ax_loss.legend(loc="upper right", fontsize=8)
    ax_lr.plot(steps, [u.get("learning_rate", math.nan) for u in updates], lw=1, color="tab:orange")
    ax_lr.set_ylabel("learning rate")
    _plot_batch_panel(ax_batch, updates, steps)
    ax_batch.set_xlabel("optimizer update")
    ax_batch.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _plot_batch_panel(ax: Any, updates: list[dict[str, Any]], steps: list[int]) -> None:
    """Tokens (targets) per update, and the noise scale B_simple in the same unit: above the tokens line,
    larger updates would still pay off."""
    ax.plot(steps, [u.get("targets", math.nan) for u in updates], lw=1, color="tab:green", label="tokens per update")
    measured = [(u["step"], u["noise_scale"]) for u in updates if u.get("noise_scale") is not None]
    if measured:
        ax.plot(*zip(*measured), lw=1, color="tab:purple", label="gradient noise scale (tokens)")
        ax.set_yscale("log")
    ax.set_ylabel("tokens")
    ax.legend(loc="upper right", fontsize=8)
    changes = [u["step"] for u in updates if u.get("batch_change")]
    if changes:  # accumulation.rampup_batch_size=auto: the batch in sequences, and where the controller grew it
        for step in changes:
            ax.axvline(step + 0.5, color="tab:gray", lw=0.8, ls=":")
        sequences = ax.twinx()
        sequences.step(steps, [u.get("sequences", math.nan) for u in updates], where="mid", lw=1, color="tab:blue")
        sequences.set_ylabel("sequences per update (batch)", color="tab:blue", fontsize=8)


def describe_trainable(summary: dict[str, Any]) -> str:
    """One short line: counts, the modules carrying LoRA adapters, and the modules trained in full."""
    lora, full = set(), set()
    for group in summary["trainable_modules"]:
        parts = group.split(".")
        if any(p.startswith("lora_") for p in parts):
            lora.add(parts[[p.startswith("lora_") for p in parts].index(True) - 1])
        else:
            inner = parts[: parts.index("modules_to_save")] if "modules_to_save" in parts else parts
            full.add(inner[-1])
    described = [f"LoRA on {', '.join(sorted(lora))}"] if lora else []
    described += [f"in full: {', '.join(sorted(full)[:8])}{' ...' if len(full) > 8 else ''}"] if full else []
    if summary.get("attention") == SDPA_FLOAT32:
        described.append("attention: SDPA in float32 on the bf16 weights (torch's CPU bf16 kernel is slower; "
                         "model.attn_implementation=sdpa keeps it)")
    return (f"trainable: {summary['trainable_parameters']:,} of {summary['total_parameters']:,} parameters "
            f"({summary['trainable_fraction']:.1%}); {'; '.join(described) or 'nothing'}")


def percent(result: dict[str, Any] | None) -> str:
    return "n/a" if result is None else f"{100 * result['exact_match']:.1f}%"


# ----------------------------------------------------------------------------------------------
# The process edge
# ----------------------------------------------------------------------------------------------


def run_cli(
    run: Callable[[Sequence[str]], Any], argv: Sequence[str] | None = None,
    bad_input: tuple[type[BaseException], ...] = (), stopped: tuple[type[BaseException], ...] = (),
) -> int:
    """Run ``run(argv)`` and turn its ends into one line and an exit code:

    * bad input (:class:`hf_accum.errors.InputError`, the base of every configuration, data, model, launch and
      output-directory error, an output directory in use by another run, a damaged checkpoint; and ``bad_input``):
      ``error: ...``, exit 2;
    * a full disk (:class:`DiskFullError`): ``error: ...`` naming the last good checkpoint, exit 3;
    * a stop (``stopped``): a preemption signal (``hf_accum.control.TrainingStopped``: its checkpoint
      is written, exit 75; Ctrl-C exit 130) or too many inf/NaN updates in a row (exit 5);
    * a second Ctrl-C while stopping: exit 130.

    Under ``accelerate launch`` the launcher reports any non-zero code as 1 (and adds its own traceback).
    """
    bad: tuple[type[BaseException], ...] = (InputError, *bad_input)
    try:
        run(sys.argv[1:] if argv is None else argv)
    except bad as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _after_an_early_end(EXIT_BAD_INPUT)
    except DiskFullError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return _after_an_early_end(EXIT_DISK_FULL)
    except tuple(stopped) as exc:
        resume = RESUME_HINT if getattr(exc, "checkpoint", None) else ""
        print(f"stopped: {exc}{resume}", file=sys.stderr)
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else EXIT_NONFINITE
        return _after_an_early_end(code)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): stopped; final outputs were not written", file=sys.stderr)
        return _after_an_early_end(EXIT_INTERRUPTED)
    return 0


RESUME_HINT = "; to continue, run the same command with training.resume_from_checkpoint=true"


class DiskFullError(RuntimeError):
    """A write of the run failed for lack of space: one line naming the last good checkpoint (exit 3)."""


# How a failed write for lack of space shows up: OSError's errno; safetensors' and transformers' wrapped
# "os error 28"; torch.save's C++ writer only says its stream broke ("unexpected pos", "file write failed").
_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_DISK_FULL_TEXT = ("no space left on device", "os error 28", "disk quota exceeded", "file write failed",
                   "unexpected pos")


def is_disk_full(error: BaseException) -> bool:
    """``error`` (or what it was raised from) is a write that failed for lack of space."""
    current: BaseException | None = error
    seen = 0
    while current is not None and seen < 5:
        if isinstance(current, OSError) and current.errno in _DISK_FULL_ERRNOS:
            return True
        if any(text in str(current).lower() for text in _DISK_FULL_TEXT):  # SafetensorError is neither
            return True
        current, seen = current.__cause__ or current.__context__, seen + 1
    return False


@contextlib.contextmanager
def disk_full_is_one_line(output_dir: str) -> Iterator[None]:
    """Turn a write that failed for lack of space into :class:`DiskFullError`: one line saying what failed and
    the newest checkpoint that verifies (checkpoints are atomic: a failed write leaves the earlier ones whole)."""
    try:
        yield
    except Exception as error:
        if not is_disk_full(error):
            raise
        from hf_accum.checkpointing.checkpoint import verified_resume_checkpoint

        # Only the ranks whose write failed get here: each looks for itself (no collective verification).
        last = (verified_resume_checkpoint(output_dir, report=lambda line: None, collective=False)
                if os.path.isdir(output_dir) else None)
        saved = (f"the last good checkpoint is {last}: free space, then run the same command with "
                 "training.resume_from_checkpoint=true") if last else "no checkpoint written yet: free space and rerun"
        what = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise DiskFullError(f"no space left on the device of {output_dir!r} ({what}); {saved}") from None


def _after_an_early_end(code: int) -> int:
    """Tear the process group down (no barrier: the other ranks may be gone or stuck) so the exit code is
    ours, not an abort from the backend's threads at interpreter exit."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group()
    return code
