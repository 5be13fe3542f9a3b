"""What a recipe run is doing at every moment: a line before each phase, and a progress bar on each long one.

The training loop draws its ``updates`` bar (:mod:`hf_accum.loop`); the recipe's other long phases -- the held-out
evaluation before and after training (greedy generation, minutes on a CPU), DPO's reference log-prob pass, writing
the final outputs -- draw one the same way here: tqdm (``tqdm.auto``), on the main process only, with the rows done,
the rate and the time left. A bar is a side feature: tqdm writes to stderr and never raises into the run.

And what third-party libraries print that carries no action for the user is filtered at the recipe's edge
(:func:`quiet_third_party_warnings`); every other warning still shows. ``accelerate launch``'s warning that it used
its defaults is printed before the recipe starts: :func:`launcher_defaults_note` says once what it means for the run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from typing import Any, Callable, Iterator, Mapping

from hf_accum.distributed import is_main_process


@contextlib.contextmanager
def phase_bar(total: int, desc: str, unit: str = "row") -> Iterator[Callable[[int], Any]]:
    """A progress bar of ``total`` ``unit``s named ``desc`` (main process only; none for an empty phase); yields
    ``advance(n)``, to call as each batch of ``n`` is done."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, disable=not is_main_process() or total <= 0, dynamic_ncols=True)
    try:
        yield bar.update
    finally:
        bar.close()


@contextlib.contextmanager
def ticking(desc: str, every: float | None = None) -> Iterator[None]:
    """An elapsed-time bar for a phase whose length nothing reports (reading a GGUF's metadata, building and loading
    a model: a minute on a busy CPU), redrawn every ``every`` seconds (default: 1 on a terminal, 15 into a log) by a
    daemon thread, so a working run never looks hung. Main process only; a side feature: a failing redraw ends
    the ticking, never the phase."""
    if not is_main_process():
        yield
        return
    from tqdm.auto import tqdm

    interval = every if every is not None else (1.0 if sys.stderr.isatty() else 15.0)
    bar = tqdm(total=None, desc=desc, bar_format="{desc}: {elapsed} elapsed", dynamic_ncols=True)
    done = threading.Event()

    def redraw() -> None:
        while not done.wait(interval):
            try:
                bar.refresh()
            except Exception:  # a closed stream, an odd terminal: stop ticking, let the phase go on
                return

    thread = threading.Thread(target=redraw, name="hf_accum-ticking", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)
        bar.close()


# Warnings (message regexes) raised inside transformers/peft/accelerate calling each other: nothing for the user to do.
_NO_ACTION_WARNINGS = (
    r".*is_gradient_checkpointing.* is deprecated",
    r".*`gradient_checkpointing` is deprecated",
    r".*torch\.utils\.checkpoint: the use_reentrant parameter",
    # PEFT saving an adapter whose base came from a GGUF file or a package: it looks for a config.json beside the
    # base to tell whether the embeddings were resized; the recipe saves modules_to_save (the embeddings) anyway.
    r"Could not find a config file in .* - will assume that the vocabulary was not modified",
)
# Log lines (logger name, message start) with nothing to act on: DeepSpeed, imported by transformers or Accelerate
# on a machine without a GPU, announcing that it falls back to the CPU; transformers checking a model's tensor-
# parallel plan (the recipe never shards by tensor parallelism).
_NO_ACTION_LOG_LINES = (("DeepSpeed", "Setting accelerator to CPU"),
                        ("transformers.distributed.tensor_parallel", "The following layers were not sharded"))


class _DropMessages(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_third_party_warnings() -> None:
    """Filter the known third-party warnings and log lines that carry no action for the user (the lists above);
    every other one still shows."""
    for pattern in _NO_ACTION_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name, start in _NO_ACTION_LOG_LINES:
        logging.getLogger(name).addFilter(_DropMessages((start,)))


def launcher_defaults_note(precision: str, environ: Mapping[str, str] | None = None) -> str | None:
    """One line after ``accelerate launch``'s warning that it used defaults (run without ``--config_file``, no
    default config written by ``accelerate config``): its ``--mixed_precision 'no'`` is not what decides this run's
    precision (``precision``: the run's own, from its config), and how to silence the warning. None otherwise, and
    whenever the launcher's command line cannot be read (Linux ``/proc``): a note never stops a run."""
    environ = os.environ if environ is None else environ
    if "ACCELERATE_MIXED_PRECISION" not in environ:  # not started by accelerate launch
        return None
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as handle:
            launcher = handle.read().decode(errors="replace").split("\0")
        from accelerate.commands.config import default_config_file
    except (OSError, ImportError):
        return None
    named = any(arg.split("=")[0] in ("--config_file", "--mixed_precision") for arg in launcher)
    if named or not any("accelerate" in arg for arg in launcher) or os.path.isfile(default_config_file):
        return None
    return (f"note: accelerate launch's warning above (defaults used, --mixed_precision 'no') does not set this "
            f"run's precision: its config does ({precision}); to silence the warning: accelerate launch "
            "--config_file recipes/accelerate/single_process.yaml ...")
