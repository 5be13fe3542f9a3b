"""The exit codes every hf_accum command and recipe ends with, and the one base class of bad-input errors.

A command line catches :class:`InputError` (and only it) to print one ``error:`` line and exit with
:data:`EXIT_BAD_INPUT`: every error a user can fix by changing a config value, a file or a command
(config keys, data rows, model directories, launch settings, checkpoints that do not match the run)
derives from it. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
"""A check that ran and failed (``hf-accum check`` FAIL), or an unexpected error."""
EXIT_BAD_INPUT = 2
"""A config value, file, model directory or launch setting was refused before (or instead of) training."""
EXIT_DISK_FULL = 3
"""A write failed for lack of disk space (or quota): the run stopped; the last good checkpoint is named. Free
space and run the same command with ``training.resume_from_checkpoint=true``."""
EXIT_CANNOT_RUN = 4
"""``hf-accum check``: the model directory is readable but the check cannot run that model (it says which and why)."""
EXIT_NONFINITE = 5
"""The run diverged: too many inf/NaN updates in a row (a checkpoint was written). Resuming as is diverges
again: change something (learning rate, data, precision) first. Its own code, so that a wrapper can tell it
from a full disk (:data:`EXIT_DISK_FULL`), which a requeue after freeing space fixes."""
EXIT_PREEMPTED = 75
"""SIGTERM/SIGUSR1 (preemption): the update finished and a checkpoint was written; ``EX_TEMPFAIL``: try again."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (SIGINT): as a preemption, with the shell's code for Ctrl-C."""


class InputError(ValueError):
    """Something the user gave (a config value, file, directory, launch setting) cannot be used.

    The message is one line naming the bad key or value, where it came from, and what is allowed.
    """


class NotProvided(InputError, ImportError):
    """A front-end hf_accum refuses by name (``from hf_accum import AccumKTOTrainer``): the message says why. An
    ``ImportError`` too, so code that tries an import and falls back keeps working."""
