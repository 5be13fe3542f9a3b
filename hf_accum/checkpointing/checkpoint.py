"""Checkpoints for exact resumption: what they hold, how they are written, how the latest complete one is found.

Shared by both engines:

* **Atomic writes** (:func:`staged_checkpoint`, on :func:`atomic_directory`; :func:`atomic_file` for single
  files): every rank writes into a hidden sibling directory
  ``.staging-checkpoint-<update>/checkpoint-<update>``; when all ranks are done (barrier) the main process
  writes the batch plan (:data:`PLAN_FILE`, the completion marker), flushes to disk and renames the directory
  into place. A kill in the middle leaves only the staging directory (ignored, and removed by the next
  save); the previous checkpoints stay complete. Old checkpoints are deleted (``save_total_limit``) only
  after the new one is in place.
* **Finding** (:func:`latest_complete_checkpoint`): the ``checkpoint-<n>`` with the largest ``n`` that holds
  the marker; incomplete ones are skipped. To resume (:func:`resolve_resume_checkpoint`,
  :func:`verified_resume_checkpoint`), the newest one whose files match the manifest written with it
  (:mod:`hf_accum.checkpointing.manifest`); a damaged one named explicitly is refused before anything loads.
* **The batch plan** (:func:`check_resume_plan`): a checkpoint trained with another micro-batch,
  accumulation or world size is refused, naming the difference -- the effective batch and the data
  position would silently change.

What a loop checkpoint holds (:class:`~hf_accum.checkpointing.loop_checkpoint.LoopCheckpointer`, for
:func:`hf_accum.train`; AccumTrainer uses Trainer's own checkpoint contents) lives in
:mod:`hf_accum.checkpointing.loop_checkpoint`: the model, optimizer, scheduler, GradScaler, the update log, the data
position and every random state of every rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from typing import Callable, Iterator

from hf_accum.checkpointing.manifest import check_named_checkpoint, newest_verified_checkpoint, write_manifest
from hf_accum.errors import InputError
from hf_accum.planning.schedule import BatchPlan

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR: Trainer's checkpoint-<step> naming
PLAN_FILE = "hf_accum_plan.json"
"""The batch plan; written last, so its presence marks a complete checkpoint."""
LOOP_STATE_FILE = "hf_accum_loop_state.json"
UPDATES_FILE = "hf_accum_updates.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"
DEEPSPEED_TAG = "deepspeed"
"""Under DeepSpeed the weights and optimizer state are DeepSpeed's own files (``engine.save_checkpoint``),
in this subdirectory: under ZeRO each rank holds a shard nobody else has."""
STAGING_PREFIX = ".staging-"
_CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")


# -- names and finding ---------------------------------------------------------------------------------


def checkpoint_path(output_dir: str, update: int) -> str:
    return os.path.join(output_dir, f"{CHECKPOINT_PREFIX}-{update}")


def checkpoint_update(path: str) -> int | None:
    """The update number of a ``checkpoint-<n>`` directory name (None for other names)."""
    match = _CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def is_complete_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, PLAN_FILE))


def complete_checkpoints(output_dir: str) -> list[str]:
    """Complete ``checkpoint-<n>`` directories of ``output_dir``, oldest update first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        update = checkpoint_update(name)
        path = os.path.join(output_dir, name)
        if update is not None and is_complete_checkpoint(path):
            found.append((update, path))
    return [path for _, path in sorted(found)]


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """The checkpoint to resume from: the complete ``checkpoint-<n>`` with the largest ``n``, or None.

    A directory without :data:`PLAN_FILE` (its write was killed, or another tool wrote it) is skipped.
    """
    checkpoints = complete_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def resolve_resume_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str | None) -> str | None:
    """``True`` -> the latest complete checkpoint of ``output_dir`` (it must exist); a path -> that path
    (it must be a complete checkpoint); ``None``/``False`` -> None (a fresh start)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        if not output_dir:
            raise ValueError("resume_from_checkpoint=True needs an output directory to look for checkpoints in")
        latest = latest_complete_checkpoint(output_dir)
        if latest is not None:
            latest = verified_resume_checkpoint(output_dir)
            if latest is None:
                raise ValueError(
                    f"resume_from_checkpoint=True: no checkpoint in {output_dir!r} verifies (each was skipped, with "
                    "why, above); move the damaged ones away to start afresh"
                )
        if latest is None:
            raise ValueError(  # a ValueError, like Trainer's for the same case
                f"resume_from_checkpoint=True: no complete {CHECKPOINT_PREFIX}-<n> in {output_dir!r} (a complete "
                f"one holds {PLAN_FILE}); to resume when there is one and start fresh otherwise, pass "
                "resume_from_checkpoint=latest_complete_checkpoint(output_dir)"
            )
        return latest
    path = os.fspath(resume_from_checkpoint)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"resume_from_checkpoint={path!r}: no such checkpoint directory")
    if not is_complete_checkpoint(path):
        raise ValueError(
            f"resume_from_checkpoint={path!r} is incomplete (no {PLAN_FILE}: its write was interrupted); "
            f"resume from latest_complete_checkpoint({os.path.dirname(os.path.normpath(path))!r}) instead"
        )
    check_checkpoint_files(path)
    return path


def check_checkpoint_files(checkpoint: str) -> None:
    """Refuse (:class:`hf_accum.checkpointing.manifest.CheckpointCorrupt`) a named checkpoint whose files do not match
    its manifest, naming the bad file and the newest checkpoint beside it that verifies."""
    check_named_checkpoint(checkpoint, lambda: _newest_good_sibling(checkpoint))


def verified_resume_checkpoint(
    output_dir: str, report: Callable[[str], None] | None = None, collective: bool = True
) -> str | None:
    """The newest complete checkpoint of ``output_dir`` whose files match its manifest (None: none does, or
    there is none); each newer one skipped is reported (``report``, default: a logged warning) with why.
    Under several ranks one rank verifies and broadcasts (:func:`hf_accum.checkpointing.manifest.verify_checkpoint`):
    every rank calls it; ``collective=False`` on a path only some ranks take."""
    checkpoint, _ = newest_verified_checkpoint(complete_checkpoints(output_dir), report, collective)
    return checkpoint


def _newest_good_sibling(path: str) -> str | None:
    """The newest verified checkpoint beside ``path`` (for the advice when ``path`` is damaged)."""
    others = [c for c in complete_checkpoints(os.path.dirname(os.path.normpath(path)))
              if os.path.normpath(c) != os.path.normpath(path)]
    checkpoint, _ = newest_verified_checkpoint(others, report=lambda line: None)
    return checkpoint


def remove_staging_debris(output_dir: str) -> list[str]:
    """Remove what killed checkpoint writes left in ``output_dir`` (hidden staging directories, probes);
    returns their names. Only for the run that holds the directory's lock (:mod:`hf_accum.checkpointing.run_lock`)."""
    if not os.path.isdir(output_dir):
        return []
    names = sorted(name for name in os.listdir(output_dir) if name.startswith(STAGING_PREFIX))
    _remove_stale_staging(output_dir)
    return names


# -- the batch plan ------------------------------------------------------------------------------------


class ResumeMismatchError(InputError):
    """The checkpoint was trained with other batch arithmetic than this run."""


def save_batch_plan(folder: str, plan: BatchPlan) -> None:
    with open(os.path.join(folder, PLAN_FILE), "w") as handle:
        json.dump(
            {
                "micro_batch_size": plan.micro_batch_size,
                "accumulation_steps": plan.accumulation_steps,
                "num_processes": plan.num_processes,
            },
            handle,
        )


def load_batch_plan(folder: str) -> BatchPlan | None:
    path = os.path.join(folder, PLAN_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return BatchPlan(**json.load(handle))


def written_by_deepspeed(checkpoint: str) -> bool:
    """The checkpoint holds DeepSpeed's own state files: the loop's ``deepspeed/``, Trainer's ``global_step<N>/``."""
    return os.path.isdir(checkpoint) and any(
        (name == DEEPSPEED_TAG or name.startswith("global_step")) and os.path.isdir(os.path.join(checkpoint, name))
        for name in os.listdir(checkpoint)
    )


def check_resume_engine(checkpoint: str, deepspeed: bool) -> None:
    """Refuse a checkpoint written with(out) DeepSpeed when resuming without (with) it. Under ZeRO the
    weights and optimizer state are per-rank shards in DeepSpeed's files; the other way round DeepSpeed
    finds nothing to load. Either way training would go on from the wrong state, or fail deep inside."""
    written = written_by_deepspeed(checkpoint)
    if written and not deepspeed:
        raise ResumeMismatchError(
            f"cannot resume from {checkpoint} without DeepSpeed: its weights and optimizer state are DeepSpeed's "
            "(sharded per rank) -- resume with the DeepSpeed config (training.deepspeed) and launcher that wrote it"
        )
    if deepspeed and not written:
        raise ResumeMismatchError(
            f"cannot resume from {checkpoint} under DeepSpeed: it holds no DeepSpeed state files (written without "
            "DeepSpeed, or by hf_accum before its DeepSpeed checkpoints) -- resume it without training.deepspeed"
        )


def save_update_history(folder: str, updates: list[dict]) -> None:
    """Every update's log so far (AccumTrainer's checkpoints; the loop's are in its state file), so a
    resumed run reports the whole run, not only its resumed part."""
    with open(os.path.join(folder, UPDATES_FILE), "w") as handle:
        json.dump(updates, handle)


def load_update_history(folder: str) -> list[dict]:
    """The updates :func:`save_update_history` wrote; [] for a checkpoint without them (another writer)."""
    path = os.path.join(folder, UPDATES_FILE)
    if not os.path.isfile(path):
        return []
    with open(path) as handle:
        return json.load(handle)


def plan_differences(saved: BatchPlan, current: BatchPlan) -> str:
    labels = {
        "micro_batch_size": "per-device micro-batch",
        "accumulation_steps": "gradient_accumulation_steps",
        "num_processes": "number of processes",
    }
    return "; ".join(
        f"{label} {getattr(saved, key)} -> {getattr(current, key)}"
        for key, label in labels.items()
        if getattr(saved, key) != getattr(current, key)
    )


def check_resume_plan(checkpoint: str, current: BatchPlan, same_global_batch_ok: bool = False) -> BatchPlan | None:
    """Refuse to resume with other batch arithmetic: the data position is counted in micro-batches of the
    saved plan, and the effective batch would silently change. ``same_global_batch_ok``: accept another
    (micro-batch, accumulation) split of the same global batch on the same number of processes
    (``auto_find_batch_size`` re-derives it). Returns the saved plan (None when the checkpoint has none)."""
    saved = load_batch_plan(checkpoint)
    if saved is None or saved == current:
        return saved
    if (
        same_global_batch_ok
        and saved.global_batch_size == current.global_batch_size
        and saved.num_processes == current.num_processes
    ):
        return saved
    raise ResumeMismatchError(
        f"cannot resume from {checkpoint}: it was trained with {saved.describe()}, this run has "
        f"{current.describe()} ({plan_differences(saved, current)}). Resuming would change the effective "
        "batch and misplace the data position; resume with the checkpoint's settings"
    )


# -- atomic writing ------------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_directory(
    final: str,
    *,
    commits: bool = True,
    barrier: Callable[[], None] = lambda: None,
    seal: Callable[[str], None] | None = None,
) -> Iterator[str]:
    """Write the directory ``final`` atomically: yields ``<parent>/.staging-<name>/<name>`` to write into,
    then renames it to ``final`` (replacing an existing one) when the block succeeds. On an exception the
    staging directory is removed and ``final`` is untouched; after a kill only the hidden staging directory
    remains (removed by the next write).

    Several processes: every rank enters with the same ``final``; ``commits`` is True on the process that
    renames (the main process, or each node's main process when every node has its own disk), which runs
    ``seal(staged)`` (e.g. writing a completion marker) after the ``barrier()`` that follows everyone's
    writes. On exit every rank has passed a barrier after the rename.
    """
    parent, name = os.path.split(os.path.normpath(final))
    staging = os.path.join(parent, f"{STAGING_PREFIX}{name}")
    staged = os.path.join(staging, name)
    if commits:
        shutil.rmtree(staging, ignore_errors=True)  # left over from a write that was killed
        os.makedirs(staged)
    barrier()
    try:
        yield staged
        barrier()  # every rank's files are written
        if commits:
            if seal is not None:
                seal(staged)
            _fsync_tree(staged)
            _move_into_place(staged, final)
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        if commits:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    barrier()  # nobody reads or rotates before the directory is in place


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[str]:
    """Yields a temporary path next to ``path``; it replaces ``path`` only when the block succeeds (a kill or
    an error leaves ``path`` as it was). The file is flushed to disk before the rename and its directory
    after it: without the second, a power or node failure can lose the rename itself (the old file, or
    none, comes back), as with a checkpoint directory (:func:`_move_into_place`)."""
    folder, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(folder, f"{STAGING_PREFIX}{name}.{os.getpid()}")
    try:
        yield temporary
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        _fsync_directory(folder)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise


def write_text_atomically(path: str, text: str) -> None:
    """Write a whole text file through :func:`atomic_file`: flushed to disk, then renamed over ``path``."""
    with atomic_file(path) as temporary, open(temporary, "w") as handle:
        handle.write(text)


@contextlib.contextmanager
def staged_checkpoint(
    output_dir: str,
    update: int,
    *,
    commits: bool,
    barrier: Callable[[], None],
    seal: Callable[[str], None],
) -> Iterator[str]:
    """:func:`atomic_directory` for ``output_dir/checkpoint-<update>``; ``seal`` writes the completion marker
    (:data:`PLAN_FILE`), then the manifest of every file is written last (:mod:`hf_accum.checkpointing.manifest`). Also
    removes staging directories that killed writes left in ``output_dir``."""

    def seal_and_list(folder: str) -> None:
        seal(folder)
        write_manifest(folder)

    with atomic_directory(
        checkpoint_path(output_dir, update), commits=commits, barrier=barrier, seal=seal_and_list
    ) as staged:
        yield staged
    if commits:
        _remove_stale_staging(output_dir)


def _move_into_place(staged: str, final: str) -> None:
    """``os.replace`` cannot replace a non-empty directory: move an existing one aside first (a resumed run
    that writes the same update again), then delete it once the new one is in place."""
    aside = None
    if os.path.exists(final):
        aside = os.path.join(os.path.dirname(final), f"{STAGING_PREFIX}replaced-{os.path.basename(final)}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(staged, final)
    _fsync_directory(os.path.dirname(final))
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _remove_stale_staging(output_dir: str) -> None:
    for name in os.listdir(output_dir):
        if name.startswith(STAGING_PREFIX):
            path = os.path.join(output_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:  # a killed atomic_file's temporary
                with contextlib.suppress(OSError):
                    os.remove(path)


def _fsync_tree(root: str) -> None:
    """Flush every file to disk before the rename, so that a node failure cannot leave a renamed (complete-
    looking) checkpoint with missing data."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_directory(folder)


def _fsync_directory(folder: str) -> None:
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:  # not supported on this platform / filesystem
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def rotate_checkpoints(output_dir: str, save_total_limit: int | None) -> None:
    """Keep the ``save_total_limit`` newest complete checkpoints (the newest always survives)."""
    if not save_total_limit or save_total_limit < 1:
        return
    for path in complete_checkpoints(output_dir)[:-save_total_limit]:
        shutil.rmtree(path, ignore_errors=True)


class OutputDirNotWritable(InputError):
    """The output directory cannot be created or written (a file in the way, no permission, no space)."""


def check_output_dir_writable(output_dir: str, label: str = "output_dir", keep_created: bool = True) -> None:
    """Create ``output_dir`` and a probe file in it, before training: a checkpoint must not fail hours later.
    The probe is an unnamed temporary file (``O_TMPFILE`` where supported): a kill leaves nothing behind.
    ``keep_created=False``: the directories created for the probe are removed again (nothing stays).
    The one writability probe of the package (the recipe's output directory check calls it too)."""
    import tempfile

    created = []
    missing = os.path.abspath(output_dir)
    while missing and not os.path.lexists(missing):
        created.append(missing)  # deepest first
        missing = os.path.dirname(missing)
    try:
        if missing and not os.path.isdir(missing):
            in_the_way = "it" if missing == os.path.abspath(output_dir) else repr(missing)
            raise OutputDirNotWritable(f"{label}={output_dir!r} is not a writable directory: {in_the_way} is a file")
        os.makedirs(output_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir, prefix=STAGING_PREFIX) as handle:
            handle.write(b"probe")
    except OSError as error:
        raise OutputDirNotWritable(
            f"{label}={output_dir!r} is not a writable directory ({error.strerror or error})"
        ) from None
    finally:
        if not keep_created:
            for directory in created:
                with contextlib.suppress(OSError):
                    os.rmdir(directory)  # only when empty
