"""One run per output directory: an exclusive lock held for a whole run.

Two runs writing into one directory mix their checkpoints and leave a ``resolved_config.yaml`` that
describes neither, so the first thing a run does with its output directory is take :data:`LOCK_NAME`
in it (exclusive, non-blocking) with :func:`filelock.lock_descriptor` -- ``flock`` on POSIX, ``LockFileEx``
on Windows: the lock primitive of the ``filelock`` package, portable, on a descriptor this module owns, so
the holder can write its description into the file. The lock belongs to the open file, so it is
released on *any* exit -- normal, exception, SIGKILL -- and a dead holder's lock is free at once: there
is no stale lock to clean up by hand. The holder writes its pid, host and start time into the file
so that a second run is refused (:class:`OutputDirInUse`, exit 2) with a message naming the running one.

Only the global main process (rank 0) takes the lock: every process of one run shares it, and the
other ranks of a second run stop with it (the launcher ends them when rank 0 exits). The lock file is
removed when its holder releases it; a killed holder leaves it behind, unlocked and harmless.

Within one process the lock is re-entrant: the recipe takes it before anything is written, and the
engine it calls (``hf_accum.train`` / ``AccumTrainer.train``) taking it again is a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import os
import socket
from typing import Any, Callable, Iterator

from filelock import lock_descriptor

from hf_accum.distributed import is_main_process
from hf_accum.errors import InputError

LOCK_NAME = ".hf_accum.lock"

_held: dict[str, _Held] = {}  # realpath of the output directory -> this process's lock on it


class OutputDirInUse(InputError):
    """Another live run holds the output directory's lock."""


class _Held:
    def __init__(self, descriptor: int, path: str, created: list[str]) -> None:
        self.descriptor = descriptor
        self.path = path
        self.created = created
        self.depth = 1


def acquire(output_dir: str, label: str = "output_dir") -> None:
    """Take ``output_dir``'s lock for this process (creating the directory), or raise :class:`OutputDirInUse`
    naming the run that holds it. Re-entrant: count on :func:`release` being called as often."""
    key = os.path.realpath(output_dir)
    if key in _held:
        _held[key].depth += 1
        return
    created = _make_directories(output_dir)
    path = os.path.join(output_dir, LOCK_NAME)
    while True:
        # No truncation before the lock is ours: the holder's description stays readable for the refusal.
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if not lock_descriptor(descriptor, blocking=False):
            holder = _read(descriptor)
            os.close(descriptor)
            _remove_empty(created)
            raise OutputDirInUse(
                f"{label}={output_dir!r} is in use by another run ({holder}); wait for it to end, stop it, "
                "or choose another output directory (overwrite_output_dir does not override a running run)"
            ) from None
        # The previous holder may have unlinked the file between our open and our flock: then we hold a lock
        # on a name nobody sees any more; start again on the current file.
        if _same_file(descriptor, path):
            break
        os.close(descriptor)
    _describe_holder(descriptor)
    _held[key] = _Held(descriptor, path, created)


def release(output_dir: str) -> None:
    """Give back this process's lock on ``output_dir`` (the outermost release removes the file)."""
    key = os.path.realpath(output_dir)
    held = _held.get(key)
    if held is None:
        return
    held.depth -= 1
    if held.depth > 0:
        return
    del _held[key]
    with contextlib.suppress(OSError):
        os.unlink(held.path)  # while still locked: nobody can take the old file after we let go
    os.close(held.descriptor)
    _remove_empty(held.created)  # a run refused before writing anything leaves no directory behind


def locks_output_dir(where: Callable[[dict[str, Any]], tuple[str | None, bool]], label: str) -> Callable:
    """Decorator: hold the output directory's lock while the function runs. ``where(arguments)`` -> (the
    output directory or None, whether this process takes the lock), from the call's bound arguments."""

    def decorate(function: Callable) -> Callable:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def locked(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            output_dir, main = where(bound.arguments)
            with run_lock(output_dir, label, enabled=main):
                return function(*args, **kwargs)

        return locked

    return decorate


@contextlib.contextmanager
def run_lock(output_dir: str | None, label: str = "output_dir", enabled: bool | None = None) -> Iterator[None]:
    """Hold ``output_dir``'s lock for the block (on the main rank; ``enabled`` overrides that choice)."""
    locked = output_dir if output_dir and (is_main_process() if enabled is None else enabled) else None
    if locked:
        acquire(locked, label)
    try:
        yield
    finally:
        if locked:
            release(locked)


def holds(output_dir: str) -> bool:
    return os.path.realpath(output_dir) in _held


def _describe_holder(descriptor: int) -> None:
    since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    text = f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n"
    os.ftruncate(descriptor, 0)
    os.lseek(descriptor, 0, os.SEEK_SET)
    os.write(descriptor, text.encode())


def _read(descriptor: int) -> str:
    try:
        os.lseek(descriptor, 0, os.SEEK_SET)
        text = os.read(descriptor, 4096).decode(errors="replace").strip()
    except OSError:  # Windows: the holder's locked byte cannot be read by another process
        text = ""
    return text or "holder unknown: it is still starting"


def _same_file(descriptor: int, path: str) -> bool:
    try:
        return os.fstat(descriptor).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _make_directories(path: str) -> list[str]:
    """``os.makedirs(path)``; returns the directories it created, deepest first."""
    created, missing = [], os.path.abspath(path)
    while missing and not os.path.exists(missing):
        created.append(missing)
        missing = os.path.dirname(missing)
    os.makedirs(path, exist_ok=True)
    return created


def _remove_empty(directories: list[str]) -> None:
    for directory in directories:  # deepest first
        with contextlib.suppress(OSError):
            os.rmdir(directory)  # fails (and stays) when not empty
