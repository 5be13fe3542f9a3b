"""Stopping a run early and cleanly: stop signals, save/stop requests, inf/NaN updates, and the exit codes.

Both engines (:func:`hf_accum.loop.train` and :class:`hf_accum.AccumTrainer`) act on a request only at an
update boundary, and only once every rank agrees: each rank's flags ride in the window tally's one
all-reduce (:meth:`hf_accum.accumulation.WindowTally.mark_boundary`), so under DDP all ranks finish the
same update, write the same checkpoint and stop together, even when a signal reached only one of them.

* **SIGTERM or SIGUSR1** (a scheduler's preemption notice, SLURM's ``--signal``): the update in progress
  finishes, a checkpoint is written (when the run has an output directory), and the run raises
  :class:`TrainingStopped`, a ``SystemExit`` with code :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL`` of
  sysexits.h: "temporary failure, try again"). Uncaught, Python exits with that code and prints no
  traceback. Re-running with ``resume_from_checkpoint`` continues exactly.
* **SIGINT** (Ctrl-C): the same, with :data:`EXIT_INTERRUPTED` (130, the shell's code for Ctrl-C). A second
  Ctrl-C aborts at once with ``KeyboardInterrupt``; checkpoints are written atomically
  (:mod:`hf_accum.checkpoint`), so an abort leaves nothing half-written.
* **inf/NaN**: an update whose loss or gradients are not finite is skipped (weights, optimizer state and LR
  schedule untouched); after ``max_consecutive_nonfinite`` skipped updates in a row the run writes a
  checkpoint and raises :class:`NonFiniteLossError`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from hf_accum.distributed import is_main_process
from hf_accum.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONSECUTIVE_NONFINITE = 5
"""Skipped inf/NaN updates in a row before the run stops: an isolated bad micro-batch is survivable, five
consecutive updates mean the run has diverged."""

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


class TrainingControl:
    """Requests to a running training loop, honoured at the next update boundary on every rank.

    Safe to call from a signal handler, another thread or an ``on_update`` callback. A request made on one
    rank only is seen by all: the flags are summed in the window's all-reduce.
    """

    def __init__(self) -> None:
        self.stop_reason: str | None = None
        self._checkpoint_requested = False

    def request_checkpoint(self) -> None:
        """Write a checkpoint at the end of the current update (then keep training)."""
        self._checkpoint_requested = True

    def request_stop(self, reason: str = "stop requested") -> None:
        """Finish the current update, write a checkpoint, raise :class:`TrainingStopped`."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def take_checkpoint_request(self) -> bool:
        """The pending checkpoint request of this rank, cleared (it is counted in one window only)."""
        requested, self._checkpoint_requested = self._checkpoint_requested, False
        return requested

    def reset(self) -> None:
        self.stop_reason = None
        self._checkpoint_requested = False


class TrainingStopped(SystemExit):
    """Raised after a stop signal or request, once the update finished and the checkpoint is written.

    A ``SystemExit``: uncaught, the process exits with :data:`EXIT_PREEMPTED` (or :data:`EXIT_INTERRUPTED`
    after Ctrl-C) and prints no traceback; ``except TrainingStopped`` catches it. ``str()`` is a one-line
    message naming the update and the checkpoint.
    """

    def __init__(self, reason: str, update: int, checkpoint: str | None) -> None:
        super().__init__(EXIT_INTERRUPTED if reason == "SIGINT" else EXIT_PREEMPTED)
        self.reason = reason
        self.update = update
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        saved = f"checkpoint {self.checkpoint}" if self.checkpoint else "no checkpoint written (no output directory)"
        return f"training stopped after update {self.update} ({self.reason}); {saved}; exit code {self.code}"


class NonFiniteLossError(RuntimeError):
    """Too many consecutive updates had inf/NaN losses or gradients: the run has diverged."""


class NonFiniteGuard:
    """Counts updates skipped for inf/NaN in a row and says when the limit is reached."""

    def __init__(self, max_consecutive: int = DEFAULT_MAX_CONSECUTIVE_NONFINITE) -> None:
        if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) or max_consecutive < 1:
            raise ValueError(f"max_consecutive_nonfinite={max_consecutive!r} must be an integer >= 1")
        self.max_consecutive = max_consecutive
        self.consecutive = 0

    def record(self, nonfinite: bool) -> bool:
        """Count one update; True when it is the ``max_consecutive``-th skipped update in a row."""
        self.consecutive = self.consecutive + 1 if nonfinite else 0
        return self.consecutive >= self.max_consecutive

    def error(self, update: int, checkpoint: str | None) -> NonFiniteLossError:
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint written (no output directory)"
        return NonFiniteLossError(
            f"updates {update - self.consecutive + 1}..{update}: {self.consecutive} consecutive updates had inf/NaN "
            f"losses or gradients and were skipped (max_consecutive_nonfinite={self.max_consecutive}); the run has "
            f"diverged or the data holds bad rows: lower the learning rate, check the data, or use fp32/bf16; {saved}"
        )


class StopSignals:
    """Context manager: SIGTERM, SIGUSR1 and SIGINT become :meth:`TrainingControl.request_stop` while it is
    active; the previous handlers come back on exit.

    Installs nothing when ``enabled`` is False or outside the main thread (Python delivers signals to the
    main thread only). A second Ctrl-C raises ``KeyboardInterrupt`` at once.
    """

    def __init__(self, control: TrainingControl, enabled: bool = True) -> None:
        self.control = control
        self.enabled = enabled
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> TrainingControl:
        if self.enabled and threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                number = getattr(signal, name, None)
                if number is not None:  # SIGUSR1 does not exist on Windows
                    self._previous[number] = signal.signal(number, self._handle)
        return self.control

    def __exit__(self, *exc_info: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, number: int, frame: object) -> None:
        name = signal.Signals(number).name
        if name == "SIGINT" and self.control.stop_reason is not None:
            raise KeyboardInterrupt  # second Ctrl-C: abort now
        if self.control.stop_reason is None and is_main_process():
            # os.write, not logging or print: safe wherever the main thread was interrupted.
            note = " (Ctrl-C again to abort now)" if name == "SIGINT" else ""
            os.write(2, f"{name}: finishing the current update, then checkpoint and stop{note}\n".encode())
        self.control.request_stop(name)
