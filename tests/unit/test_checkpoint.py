"""Checkpoint files, atomic writing, the finder, the loop's save/stop requests and stop signals (in-process)."""

from __future__ import annotations

import io
import os
import random
import signal

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from hf_accum import LoopConfig, train
from hf_accum.batching import PaddingCollator
from hf_accum.checkpointing.checkpoint import (
    DEEPSPEED_TAG,
    PLAN_FILE,
    ResumeMismatchError,
    atomic_directory,
    atomic_file,
    check_output_dir_writable,
    check_resume_engine,
    complete_checkpoints,
    latest_complete_checkpoint,
    resolve_resume_checkpoint,
    rotate_checkpoints,
    save_batch_plan,
    staged_checkpoint,
)
from hf_accum.checkpointing.loop_checkpoint import capture_random_states, restore_random_states
from hf_accum.control import EXIT_INTERRUPTED, EXIT_PREEMPTED, StopSignals, TrainingControl, TrainingStopped
from hf_accum.planning.schedule import BatchPlan
from hf_accum.testing import PAD, fresh_accelerator, random_rows, tiny_causal_lm

PLAN = BatchPlan(2, 4, 1)


def write_checkpoint(output_dir: str, update: int, fail: bool = False) -> None:
    with staged_checkpoint(output_dir, update, commits=True, barrier=lambda: None,
                           seal=lambda folder: save_batch_plan(folder, PLAN)) as folder:
        with open(os.path.join(folder, "weights.txt"), "w") as handle:
            handle.write(f"update {update}")
        if fail:
            raise KeyboardInterrupt  # e.g. a second Ctrl-C in the middle of the write


def test_finder_takes_the_newest_complete_checkpoint(tmp_path):
    out = str(tmp_path)
    write_checkpoint(out, 2)
    write_checkpoint(out, 10)
    os.makedirs(os.path.join(out, "checkpoint-12"))  # no plan file: incomplete (another tool, an old kill)
    os.makedirs(os.path.join(out, "checkpoint-x"))
    assert latest_complete_checkpoint(out) == os.path.join(out, "checkpoint-10")  # 10 > 2 numerically
    assert complete_checkpoints(out) == [os.path.join(out, "checkpoint-2"), os.path.join(out, "checkpoint-10")]
    assert latest_complete_checkpoint(str(tmp_path / "missing")) is None


def test_interrupted_write_leaves_nothing_and_keeps_the_previous_checkpoint(tmp_path):
    out = str(tmp_path)
    write_checkpoint(out, 2)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(out, 4, fail=True)
    assert sorted(os.listdir(out)) == ["checkpoint-2"]
    assert latest_complete_checkpoint(out) == os.path.join(out, "checkpoint-2")


def test_rewriting_a_checkpoint_replaces_it_and_clears_stale_staging(tmp_path):
    out = str(tmp_path)
    write_checkpoint(out, 4)
    os.makedirs(os.path.join(out, ".staging-checkpoint-6", "checkpoint-6"))  # a write killed earlier
    write_checkpoint(out, 4)  # a resumed run reaches update 4 again
    assert sorted(os.listdir(out)) == ["checkpoint-4"]
    assert os.path.isfile(os.path.join(out, "checkpoint-4", PLAN_FILE))


def test_atomic_file_and_directory(tmp_path):
    target = tmp_path / "metrics.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(str(target)) as temporary:
            with open(temporary, "w") as handle:
                handle.write("half")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["metrics.json"]
    with atomic_file(str(target)) as temporary:
        with open(temporary, "w") as handle:
            handle.write("new")
    assert target.read_text() == "new"
    for content in ("first", "second"):  # the second write replaces the first directory whole
        with atomic_directory(str(tmp_path / "adapter")) as staged:
            with open(os.path.join(staged, content), "w") as handle:
                handle.write(content)
    assert sorted(os.listdir(tmp_path)) == ["adapter", "metrics.json"]
    assert os.listdir(tmp_path / "adapter") == ["second"]


def test_atomic_file_flushes_the_file_then_its_directory_after_the_rename(tmp_path, monkeypatch):
    """The rename is durable only once the directory holding it is flushed: the order is file fsync, rename,
    directory fsync (a directory fsync before the rename would not cover it)."""
    from hf_accum.checkpointing import checkpoint

    events = []
    real_fsync, real_replace, real_open = os.fsync, os.replace, os.open
    opened = {}

    def record_open(path, flags, *args, **kwargs):
        descriptor = real_open(path, flags, *args, **kwargs)
        opened[descriptor] = os.path.basename(os.fspath(path)) if os.path.isdir(path) else "file"
        return descriptor

    def record_fsync(descriptor):
        events.append(("fsync", opened.get(descriptor, "file")))
        return real_fsync(descriptor)

    def record_replace(source, destination):
        events.append(("replace", os.path.basename(destination)))
        return real_replace(source, destination)

    monkeypatch.setattr(checkpoint.os, "open", record_open)
    monkeypatch.setattr(checkpoint.os, "fsync", record_fsync)
    monkeypatch.setattr(checkpoint.os, "replace", record_replace)
    checkpoint.write_text_atomically(str(tmp_path / "metrics.json"), "{}")
    assert events == [("fsync", "file"), ("replace", "metrics.json"), ("fsync", tmp_path.name)]
    assert (tmp_path / "metrics.json").read_text() == "{}" and os.listdir(tmp_path) == ["metrics.json"]


def test_rotation_keeps_the_newest(tmp_path):
    out = str(tmp_path)
    for update in (2, 4, 6, 8):
        write_checkpoint(out, update)
    rotate_checkpoints(out, 2)
    assert sorted(os.listdir(out)) == ["checkpoint-6", "checkpoint-8"]


def test_resume_argument_errors_are_one_clear_line(tmp_path):
    out = str(tmp_path)
    with pytest.raises(ValueError, match="resume_from_checkpoint=True: no complete checkpoint-<n> in") as error:
        resolve_resume_checkpoint(True, out)
    assert "\n" not in str(error.value)
    os.makedirs(os.path.join(out, "checkpoint-3"))
    with pytest.raises(ValueError, match="checkpoint-3' is incomplete"):
        resolve_resume_checkpoint(os.path.join(out, "checkpoint-3"), out)
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        resolve_resume_checkpoint(os.path.join(out, "checkpoint-9"), out)
    assert resolve_resume_checkpoint(None, out) is None


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    with pytest.raises(ValueError, match="output_dir=.*a_file' is not a writable directory"):
        check_output_dir_writable(str(path))


def test_random_states_round_trip_through_weights_only_load():
    generator = torch.Generator().manual_seed(5)
    state = capture_random_states([generator])
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    expected = (random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=generator))
    restore_random_states(loaded, [generator])
    again = (random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=generator))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2]) and torch.equal(expected[3], again[3])


# -- stop signals -----------------------------------------------------------------------------------------


def test_stop_signals_turn_into_requests_and_are_restored():
    control = TrainingControl()
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(control):
        os.kill(os.getpid(), signal.SIGUSR1)
        assert control.stop_reason == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # already stopping: the first reason stays
        assert control.stop_reason == "SIGUSR1"
    assert signal.getsignal(signal.SIGTERM) is before


def test_second_interrupt_aborts_at_once():
    control = TrainingControl()
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with StopSignals(control):
            os.kill(os.getpid(), signal.SIGINT)
            assert control.stop_reason == "SIGINT"
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_exit_codes():
    assert TrainingStopped("SIGTERM", 3, None).code == EXIT_PREEMPTED == 75
    assert TrainingStopped("SIGUSR1", 3, None).code == EXIT_PREEMPTED
    assert TrainingStopped("SIGINT", 3, "out/checkpoint-3").code == EXIT_INTERRUPTED == 130
    assert str(TrainingStopped("SIGINT", 3, "out/checkpoint-3")) == (
        "training stopped after update 3 (SIGINT); checkpoint out/checkpoint-3; exit code 130"
    )


# -- the loop: requests, settings -------------------------------------------------------------------------


def tiny_loop(output_dir, control=None, on_update=None, resume_from_checkpoint=None, rows=12, **config):
    accelerator = fresh_accelerator(2)
    model = tiny_causal_lm(seed=0)
    loader = DataLoader(random_rows(rows, seed=3), batch_size=2, collate_fn=PaddingCollator(PAD))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    settings = dict(disable_tqdm=True, output_dir=output_dir, save_strategy="no")
    settings.update(config)
    return train(model, optimizer, loader, accelerator, LoopConfig(**settings), on_update=on_update, control=control,
                 resume_from_checkpoint=resume_from_checkpoint)


def test_loop_checkpoint_and_stop_requests(tmp_path):
    control = TrainingControl()

    def on_update(update):
        if update.step == 1:
            control.request_checkpoint()  # honoured at the end of the next update
        if update.step == 2:
            control.request_stop("stop requested")

    with pytest.raises(TrainingStopped) as stopped:
        tiny_loop(str(tmp_path), control, on_update)
    assert stopped.value.code == EXIT_PREEMPTED and stopped.value.update == 3
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-3"]


def test_loop_save_strategy_epoch(tmp_path):
    result = tiny_loop(str(tmp_path), save_strategy="epoch", num_train_epochs=2)
    assert len(result.updates) == 6
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-6"]


def test_resuming_a_finished_run_trains_nothing_more(tmp_path):
    """max_steps ends the run mid-epoch, at a checkpoint: resuming it must not run one more update."""
    first = tiny_loop(str(tmp_path), max_steps=2, save_strategy="steps", save_steps=2)
    seen = []
    again = tiny_loop(str(tmp_path), on_update=seen.append, resume_from_checkpoint=True, max_steps=2,
                      save_strategy="steps", save_steps=2)
    assert seen == [] and again.as_dicts() == first.as_dicts()


def test_resuming_on_other_data_is_refused(tmp_path):
    tiny_loop(str(tmp_path), max_steps=2, save_strategy="steps", save_steps=2)
    with pytest.raises(ResumeMismatchError, match="trained on 6 micro-batches per epoch and process, this run has 7"):
        tiny_loop(str(tmp_path), resume_from_checkpoint=True, rows=14, max_steps=3)


def test_a_deepspeed_checkpoint_resumed_without_deepspeed_is_refused(tmp_path):
    """Its weights and optimizer state are DeepSpeed's per-rank shards: loading nothing and training on
    from the initial weights would be silent. (The DeepSpeed side is tests/distributed/test_deepspeed_recipe.py.)"""
    tiny_loop(str(tmp_path), max_steps=2, save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "checkpoint-2"
    os.makedirs(checkpoint / DEEPSPEED_TAG)  # what engine.save_checkpoint leaves, beside the loop's own files
    with pytest.raises(ResumeMismatchError, match="without DeepSpeed: its weights and optimizer state are DeepSpeed's"):
        tiny_loop(str(tmp_path), resume_from_checkpoint=True, max_steps=3)


@pytest.mark.parametrize("deepspeed_folder", [DEEPSPEED_TAG, "global_step4", None])
def test_resume_engine_check_names_the_mismatch(tmp_path, deepspeed_folder):
    checkpoint = tmp_path / "checkpoint-4"
    os.makedirs(checkpoint)
    if deepspeed_folder:  # the loop's DeepSpeed files, or Trainer's
        os.makedirs(checkpoint / deepspeed_folder)
    written = deepspeed_folder is not None
    check_resume_engine(str(checkpoint), deepspeed=written)  # resuming the way it was written: accepted
    fragment = "without DeepSpeed: its weights" if written else "under DeepSpeed: it holds no DeepSpeed state files"
    with pytest.raises(ResumeMismatchError, match=fragment):
        check_resume_engine(str(checkpoint), deepspeed=not written)


@pytest.mark.parametrize(
    "setting, message",
    [({"save_strategy": "best"}, "LoopConfig.save_strategy='best'; allowed: 'no', 'steps', 'epoch'"),
     ({"save_strategy": "steps", "save_steps": 0}, "LoopConfig.save_steps=0 must be an integer >= 1"),
     ({"save_total_limit": 0}, "LoopConfig.save_total_limit=0 must be None or an integer >= 1"),
     ({"max_consecutive_nonfinite": 0}, "max_consecutive_nonfinite=0 must be an integer >= 1")],
)
def test_loop_refuses_bad_checkpoint_settings_before_training(tmp_path, setting, message):
    with pytest.raises(ValueError, match=message):
        tiny_loop(str(tmp_path), **setting)
