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
* **SIGINT** (Ctrl-C): the same, with :data:`EXIT_INTERRUPTED` (130, the shell's code for Ctrl-C); the main
  process says so once (:data:`CTRL_C_NOTE`). A second Ctrl-C -- SIGINT again, or the SIGTERM into which
  torchrun's agent (also behind a multi-process ``accelerate launch``) turns it -- aborts at once with
  ``KeyboardInterrupt``; checkpoints are written atomically (:mod:`hf_accum.checkpointing.checkpoint`), so an abort
  leaves the previous checkpoint whole and nothing half-written in its place.
* **Ctrl-C under accelerate's one-process launcher**: see :class:`LauncherTerminal` (the launcher waits).
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
from hf_accum.settings import DEFAULT_MAX_CONSECUTIVE_NONFINITE  # the setting's default, declared with it

logger = logging.getLogger(__name__)

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

CTRL_C_NOTE = "stopping after this update and saving a checkpoint (Ctrl-C again to abort without saving)"
"""What the main process prints, once, on the first Ctrl-C."""
PREEMPTION_NOTE = "finishing the current update, then checkpoint and stop"


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
    main thread only). A second Ctrl-C raises ``KeyboardInterrupt`` at once (:func:`is_second_interrupt`).
    Under accelerate's one-process launcher, Ctrl-C is made to reach this process alone (:class:`LauncherTerminal`).
    """

    def __init__(self, control: TrainingControl, enabled: bool = True) -> None:
        self.control = control
        self.enabled = enabled
        self._previous: dict[int, Any] = {}
        self._terminal = LauncherTerminal()

    def __enter__(self) -> TrainingControl:
        if self.enabled and threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                number = getattr(signal, name, None)
                if number is not None:  # SIGUSR1 does not exist on Windows
                    self._previous[number] = signal.signal(number, self._handle)
            self._terminal.take()
        return self.control

    def __exit__(self, *exc_info: object) -> None:
        self._terminal.give_back()
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, number: int, frame: object) -> None:
        name = signal.Signals(number).name
        if is_second_interrupt(name, self.control.stop_reason):
            raise KeyboardInterrupt  # abort now, without saving
        if self.control.stop_reason is None and is_main_process():
            # os.write, not logging or print: safe wherever the main thread was interrupted.
            note = CTRL_C_NOTE if name == "SIGINT" else f"{name}: {PREEMPTION_NOTE}"
            os.write(2, f"{note}\n".encode())
        self.control.request_stop(name)


def is_second_interrupt(signal_name: str, stopping_for: str | None) -> bool:
    """Whether a stop signal arriving while the run already stops for ``stopping_for`` means "abort now".

    Ctrl-C while stopping for any reason aborts. So does SIGTERM while stopping for Ctrl-C: torchrun's agent
    (torchrun, and a multi-process ``accelerate launch``, which runs it) starts its workers in sessions of their
    own, so Ctrl-C reaches them only through the agent: the first as SIGINT, and the second, which interrupts the
    agent's wait, as SIGTERM (``torch.distributed.elastic``: ``SimpleElasticAgent.run`` shuts the workers down
    again with its default signal). Other repeats (SIGTERM twice: a scheduler's notice repeated) keep stopping.
    """
    if stopping_for is None:
        return False
    return signal_name == "SIGINT" or (signal_name == "SIGTERM" and stopping_for == "SIGINT")


# The launcher's trace: accelerate's one-process ("simple") launcher exports it, and only a launcher of accelerate's.
ACCELERATE_LAUNCHER_VARIABLE = "ACCELERATE_USE_CPU"


class LauncherTerminal:
    """Under ``accelerate launch`` with one process, Ctrl-C reaches the training process alone, so the launcher
    waits for it instead of returning the prompt.

    A terminal sends Ctrl-C's SIGINT to its whole foreground process group. accelerate's one-process launcher
    runs the script in its own group, and on SIGINT waits 0.25 s for it (``subprocess.Popen.wait``), raises
    ``KeyboardInterrupt`` and exits: the prompt comes back while the script finishes its update and writes its
    checkpoint, and the next Ctrl-C reaches the shell, not the run. So while training, the script moves into a
    process group of its own and makes that group the terminal's foreground: Ctrl-C then reaches the script
    only; the launcher, never interrupted, waits for it and ends after it. Leaving, the script rejoins the
    launcher's group and hands the terminal back (after a ``kill -9`` the shell takes it back when the launcher
    ends). Ctrl-Z meanwhile would stop the script alone, out of the shell's sight, so it is refused with a note.

    Nothing is done elsewhere: ``python`` runs the script as the group's leader; torchrun's agent (torchrun, a
    multi-process ``accelerate launch``) starts its workers in sessions of their own, without a terminal, and
    forwards Ctrl-C to them itself; without a terminal (a pipe, a batch job) there is no foreground to take.
    """

    def __init__(self) -> None:
        self.launcher_group: int | None = None
        self._terminal: int | None = None
        self._previous_tstp: Any = None

    def take(self) -> bool:
        """Make this process's own group the terminal's foreground, when it runs under accelerate's one-process
        launcher in the foreground; True if it did."""
        group = _accelerate_launcher_group()
        terminal = _open_terminal() if group is not None else None
        if group is None or terminal is None:
            return False
        try:
            if os.tcgetpgrp(terminal) != group:  # started in the background: Ctrl-C does not reach it anyway
                raise OSError("not the terminal's foreground group")
            os.setpgid(0, 0)
            with _terminal_writes_allowed():
                os.tcsetpgrp(terminal, os.getpgrp())
        except OSError:
            _rejoin(group, terminal)
            os.close(terminal)
            return False
        self.launcher_group, self._terminal = group, terminal
        self._previous_tstp = signal.signal(signal.SIGTSTP, _refuse_suspend)
        return True

    def give_back(self) -> None:
        """Rejoin the launcher's group and hand it the terminal (if :meth:`take` took it)."""
        if self.launcher_group is None or self._terminal is None:
            return
        signal.signal(signal.SIGTSTP, _restorable(self._previous_tstp))
        _rejoin(self.launcher_group, self._terminal)
        os.close(self._terminal)
        self.launcher_group = self._terminal = None


def _accelerate_launcher_group() -> int | None:
    """The process group this process shares with its parent, when the parent is accelerate's launcher."""
    if os.name != "posix" or ACCELERATE_LAUNCHER_VARIABLE not in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        return None
    group, parent = os.getpgrp(), os.getppid()
    try:
        if group == os.getpid() or os.getpgid(parent) != group:
            return None
        with open(f"/proc/{parent}/cmdline", "rb") as handle:  # Linux; elsewhere the variable alone decides
            if b"accelerate" not in handle.read():
                return None
    except FileNotFoundError:
        pass
    except OSError:
        return None
    return group


def _open_terminal() -> int | None:
    try:
        return os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:  # no controlling terminal
        return None


class _terminal_writes_allowed:
    """SIGTTOU ignored: a process outside the foreground group may then set the terminal's foreground group
    (otherwise the kernel stops it for trying)."""

    def __enter__(self) -> None:
        self._previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)

    def __exit__(self, *exc_info: object) -> None:
        signal.signal(signal.SIGTTOU, _restorable(self._previous))


def _restorable(handler: Any) -> Any:
    """A handler ``signal.signal`` returned, fit to hand back to it (None: one installed outside Python)."""
    return signal.SIG_DFL if handler is None else handler


def _rejoin(launcher_group: int, terminal: int) -> None:
    """Back into the launcher's group, the terminal handed to it -- unless the launcher is gone (the shell has
    the terminal then) or the terminal already went elsewhere."""
    own_group = os.getpgrp()
    with _terminal_writes_allowed():
        try:
            os.setpgid(0, launcher_group)
            if os.tcgetpgrp(terminal) == own_group:
                os.tcsetpgrp(terminal, launcher_group)
        except OSError:
            pass


def _refuse_suspend(number: int, frame: object) -> None:
    os.write(2, b"Ctrl-Z: a run under accelerate launch is not suspended (Ctrl-C stops it after this update)\n")
