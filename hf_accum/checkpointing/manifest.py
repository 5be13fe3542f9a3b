"""Verified checkpoints: the manifest each checkpoint carries, its verification, and which checkpoint to resume.

A checkpoint's files can be damaged after they were written (a truncated copy, a full disk on a later
write, bytes flipped on the way to or from storage); loading them gives a traceback deep inside
torch/safetensors -- or, for bytes inside a tensor, nothing at all and a silently wrong run. So:

* **Writing** (:func:`write_manifest`): the process that commits a checkpoint writes :data:`MANIFEST_FILE`
  -- every file's relative path, size and sha256 -- as the last file of the staging directory, right
  after the completion marker and before the rename (:func:`hf_accum.checkpointing.checkpoint.staged_checkpoint`).
* **Verifying** (:func:`verify_checkpoint`): sizes first (free), then sha256 streamed in 1 MiB blocks.
  A checkpoint without a manifest (written before manifests existed) is accepted with a note. Under a
  process group of several ranks, one rank (global rank 0) hashes and broadcasts its verdict: every rank
  takes the same decision (the same checkpoint, or the same refusal and exit code), and a 100 GB checkpoint
  is read once, not once per rank.
* **Choosing** (:func:`newest_verified_checkpoint`): the newest complete checkpoint that verifies; the ones
  skipped are reported with why. An explicitly named checkpoint that fails is refused
  (:class:`CheckpointCorrupt`, an :class:`~hf_accum.errors.InputError`) naming the bad file and the
  newest good checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, replace
from typing import Callable

import torch

from hf_accum.errors import InputError

logger = logging.getLogger(__name__)

MANIFEST_FILE = "hf_accum_manifest.json"
MANIFEST_FORMAT = 1
_BLOCK = 1 << 20  # 1 MiB: sha256 runs at disk/page-cache speed with a constant, small buffer


class CheckpointCorrupt(InputError):
    """A checkpoint's files do not match its manifest."""


@dataclass
class Verdict:
    """What :func:`verify_checkpoint` found: ``problem`` is None for a good checkpoint."""

    checkpoint: str
    problem: str | None = None
    has_manifest: bool = True

    @property
    def ok(self) -> bool:
        return self.problem is None


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: str) -> list[str]:
    """Every regular file under ``folder`` (relative, sorted), the manifest itself excluded."""
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative != MANIFEST_FILE:
                found.append(relative)
    return sorted(found)


def write_manifest(folder: str) -> None:
    """Record every file of ``folder`` (path, size, sha256) in :data:`MANIFEST_FILE`; call it last."""
    files = {}
    for relative in _files(folder):
        path = os.path.join(folder, relative)
        files[relative] = {"size": os.path.getsize(path), "sha256": file_digest(path)}
    with open(os.path.join(folder, MANIFEST_FILE), "w") as handle:
        json.dump({"format": MANIFEST_FORMAT, "files": files}, handle, indent=1)


def verify_checkpoint(checkpoint: str, collective: bool = True) -> Verdict:
    """Compare ``checkpoint``'s files with its manifest: every listed file present, of its size and sha256.

    Under a process group of several ranks (``collective``, the default) the global rank 0 verifies and
    broadcasts its verdict; the other ranks read nothing. Every rank must then call it, in the same order --
    the resume paths do: every rank resolves the same checkpoint of the same (shared) output directory, and the
    broadcast verdicts keep their choices in step. ``collective=False``: this process alone, for a path only
    some ranks take (the full-disk message)."""
    if not (collective and _several_ranks()):
        return _verify_here(checkpoint)
    shared: list[Verdict | None] = [_verify_here(checkpoint) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(shared, src=0)
    verdict = shared[0]
    assert verdict is not None  # rank 0 always sends one
    return replace(verdict, checkpoint=checkpoint)  # the name this rank asked for (the same directory)


def _several_ranks() -> bool:
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def _verify_here(checkpoint: str) -> Verdict:
    path = os.path.join(checkpoint, MANIFEST_FILE)
    if not os.path.isfile(path):
        return Verdict(checkpoint, has_manifest=False)
    key = _cache_key(path)
    if key in _verified:  # the recipe verifies before the engine does: hash once per process
        return Verdict(checkpoint)
    verdict = _compare(checkpoint, path)
    if verdict.ok:
        _verified.add(key)
    return verdict


_verified: set[tuple] = set()


def _cache_key(manifest: str) -> tuple:
    """Every file's identity, size and modification time (stat calls only): any write since invalidates it."""
    folder = os.path.dirname(manifest)
    stats = []
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            stat = os.stat(path)
            stats.append((os.path.relpath(path, folder), stat.st_ino, stat.st_size, stat.st_mtime_ns))
    return os.path.realpath(folder), tuple(sorted(stats))


def _compare(checkpoint: str, path: str) -> Verdict:
    try:
        with open(path) as handle:
            files = json.load(handle)["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return Verdict(checkpoint, f"{MANIFEST_FILE} is unreadable ({error})")
    for relative, expected in files.items():  # sizes first: a truncated file is found without hashing
        file = os.path.join(checkpoint, relative)
        if not os.path.isfile(file):
            return Verdict(checkpoint, f"{relative} is missing")
        size = os.path.getsize(file)
        if size != expected["size"]:
            problem = f"{relative} has {size} bytes, the manifest says {expected['size']} (truncated?)"
            return Verdict(checkpoint, problem)
    for relative, expected in files.items():
        if file_digest(os.path.join(checkpoint, relative)) != expected["sha256"]:
            return Verdict(checkpoint, f"{relative} differs from its manifest's sha256 (its bytes changed)")
    return Verdict(checkpoint)


def newest_verified_checkpoint(
    checkpoints: list[str], report: Callable[[str], None] | None = None, collective: bool = True
) -> tuple[str | None, list[Verdict]]:
    """The newest of ``checkpoints`` (oldest first, complete ones) that verifies, and the verdicts of the
    newer ones skipped. ``report`` gets one line per skipped checkpoint and per checkpoint without manifest.
    ``collective``: as :func:`verify_checkpoint` (every rank calls it, with the same list)."""
    report = report or logger.warning
    skipped: list[Verdict] = []
    for checkpoint in reversed(checkpoints):
        verdict = verify_checkpoint(checkpoint, collective)
        if verdict.ok:
            if not verdict.has_manifest:
                report(f"note: {checkpoint} has no {MANIFEST_FILE} (written by an older hf_accum): resuming unverified")
            return checkpoint, skipped
        report(f"warning: skipping {checkpoint}: {verdict.problem}")
        skipped.append(verdict)
    return None, skipped


def check_named_checkpoint(checkpoint: str, newest_good: Callable[[], str | None]) -> None:
    """Refuse an explicitly named checkpoint that fails verification, naming the bad file and the newest
    checkpoint that verifies (``newest_good()``, only asked when needed)."""
    verdict = verify_checkpoint(checkpoint)
    if verdict.ok:
        if not verdict.has_manifest:
            logger.info("%s has no %s (written by an older hf_accum): resuming unverified", checkpoint, MANIFEST_FILE)
        return
    good = newest_good()
    advice = f"resume from {good} instead" if good else "no checkpoint of this run verifies: start fresh"
    raise CheckpointCorrupt(f"checkpoint {checkpoint} is damaged: {verdict.problem}; {advice}")
