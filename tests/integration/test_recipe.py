"""The real recipe script end to end (short runs of the embedded default), both engines, one and
two CPU processes; and every bad input failing cleanly before anything is written."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile

import pytest
import yaml

from hf_accum.checkpointing.checkpoint import write_text_atomically
from hf_accum.recipe import checks
from hf_accum.recipe import config as recipe_config
from hf_accum.recipe import outputs as run_outputs
from hf_accum.recipe.testing import (
    BAD_INPUT,
    PYTHON,
    ROOT,
    SMALL,
    TORCHRUN_2,
    check_outputs,
    fails_cleanly,
    load_script,
    read_metrics,
    run_main,
    run_script,
    start_script,
    write,
)


@pytest.mark.slow
def test_loop_engine_one_process_end_to_end(tmp_path):
    out = tmp_path / "loop1"
    # In the pytest process: nothing here needs a process of its own (the recipe under accelerate launch as a
    # process: test_interrupted_runs.py; the loop engine's own process: the SIGTERM test below; its first line).
    proc = run_main(*SMALL, f"training.output_dir={out}", "training.max_steps=16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(out)
    check_outputs(out, metrics)
    assert (metrics["engine"], metrics["world_size"]) == ("loop", 1)
    assert (metrics["micro_batch_size"], metrics["accumulation_steps"], metrics["global_batch_size"]) == (8, 4, 32)
    updates = metrics["updates"]
    assert [u["step"] for u in updates] == list(range(1, 17))
    # 240 examples / 8 = 30 micro-batches per epoch: 7 windows of 4 and a short last window of 2,
    # which is still one update (not dropped); 16 updates = 2 epochs.
    assert [u["micro_batches"] for u in updates] == ([4] * 7 + [2]) * 2
    assert [u["sequences"] for u in updates] == [8 * u["micro_batches"] for u in updates]
    assert all(u["applied"] for u in updates)
    # Uneven micro-batches: the target count per update really varies.
    assert len({u["targets"] for u in updates}) > 3
    # Cosine with warmup ceil(0.05 * 16) = 1 update: 0 at update 1, the peak at update 2, then decay.
    lrs = [u["learning_rate"] for u in updates]
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(2e-3) and lrs == [lrs[0], lrs[1], *sorted(lrs[2:], reverse=True)]
    assert lrs[-1] == pytest.approx(2e-3 * 0.5 * (1 + math.cos(math.pi * 14 / 15)), rel=1e-6)
    # It learns: mean loss of the last 4 updates clearly below the first 4.
    first, last = (sum(u["loss"] for u in part) / 4 for part in (updates[:4], updates[-4:]))
    assert last < first - 0.5, (first, last)
    stdout = proc.stdout
    assert "[hf_accum] effective batch 32 = 8 per device x 4 accumulation x 1 process" in proc.stderr
    assert "held-out exact match before training:" in stdout and "held-out exact match: before" in stdout
    assert stdout.count("resolved config:") == 1
    assert "update 16 | epoch" in stdout
    assert "wall time" in stdout and "(from process start)" in stdout
    assert re.search(r"model FLOPs \S+/update, [\d.,]+ GFLOP/s, MFU \d+\.\d%", stdout)  # the end line
    assert re.search(r"update 16 \|.* \| MFU \d+\.\d%", stdout)  # each logged update
    assert "updates: 100%" in proc.stderr  # the tqdm progress bar
    # Every long phase shows progress (issue 40): the held-out evaluation before and after (rows done, rate, time
    # left), the final files; a line before the data and the model load; the end line says what was trained.
    for phase in ("held-out exact match before training: 100%", "held-out exact match after training: 100%"):
        assert re.search(re.escape(phase) + r".*\| 8/8 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+row/s\]", proc.stderr), phase
    assert re.search(r"writing adapter/, plot and metrics\.json: 100%.*\| 4/4", proc.stderr)
    assert "reading hf_accum:synthetic-tasks with the tokenizer of hf_accum:tiny-llama ..." in stdout
    assert stdout.index("loading model hf_accum:tiny-llama ...") < stdout.index("trainable: ")
    tokens = sum(u["targets"] for u in updates)
    assert f"trained 16 updates, {tokens:,} tokens in " in stdout and "(16 in all)" not in stdout
    assert (metrics["resumed_after_update"], metrics["trained_updates"], metrics["trained_targets"]) == (0, 16, tokens)
    saved = json.loads((out / run_outputs.EVAL_BEFORE_NAME).read_text())  # read back by a resumed run
    assert saved["result"] == metrics["eval_before"]


@pytest.mark.slow
def test_trainer_engine_one_process_end_to_end(tmp_path):
    core = os.path.join(ROOT, "hf_accum", "trainer", "core.py")
    assert os.path.isfile(core), "AccumTrainer (hf_accum/trainer/core.py) is missing"
    out = tmp_path / "trainer1"
    temp_before = set(os.listdir(tempfile.gettempdir()))
    # In the pytest process (the trainer engine as a process of its own: test_trainer_engine_on_two_cpu_processes_end_to_end).
    proc = run_main(*SMALL, f"training.output_dir={out}", "engine=trainer", "training.max_steps=6",
                    "training.logging_steps=5")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(out)
    assert re.search(r"model FLOPs \S+/update, [\d.,]+ GFLOP/s, MFU \d+\.\d%", proc.stdout)  # the end line
    assert "'mfu':" in proc.stdout  # Trainer's log line every logging_steps
    check_outputs(out, metrics)
    assert (metrics["engine"], metrics["world_size"], metrics["accumulation_steps"]) == ("trainer", 1, 4)
    # Every update is in metrics.json, not only the logged ones (logging_steps=5).
    assert [u["step"] for u in metrics["updates"]] == list(range(1, 7))
    # Loss on the answers only: an answer is at most 10 words + the end token, so 32 sequences hold at
    # most 32 x 11 targets (with the prompts too, an update holds ~640).
    assert all(0 < u["targets"] <= 32 * 11 for u in metrics["updates"])
    assert not [d for d in set(os.listdir(tempfile.gettempdir())) - temp_before if d.startswith("hf_accum")]
    assert metrics["updates"][0]["learning_rate"] == 0.0
    assert metrics["updates"][1]["learning_rate"] == pytest.approx(2e-3)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_packing_trains_the_same_targets_without_padding(engine, tmp_path, monkeypatch):
    """``data.packing=true``: same sequences and answer-only targets per update as padding, no pad
    positions, and (same weights, same data order) the same first-update loss."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = load_script().main
    runs = {}
    for packing in (False, True):
        out = tmp_path / f"{engine}-packing-{packing}"
        runs[packing] = run([*SMALL, f"training.output_dir={out}", f"engine={engine}", "training.max_steps=3",
                             f"data.packing={str(packing).lower()}", "data.num_eval_examples=2"])
        assert read_metrics(out)["updates"] == json.loads(json.dumps(runs[packing]["updates"], default=str))
    padded, packed = runs[False]["updates"], runs[True]["updates"]
    assert len(padded) == len(packed) == 3
    seqs, targets = "sequences", "targets"
    assert [u[seqs] for u in packed] == [u[seqs] for u in padded] == [32, 32, 32]
    assert [u[targets] for u in packed] == [u[targets] for u in padded]  # answers only, nothing lost or added
    assert all(u["padding_fraction"] == 0.0 for u in packed)
    assert all(u["padding_fraction"] > 0.1 for u in padded)  # strongly varying lengths: padding is real
    assert packed[0]["loss"] == pytest.approx(padded[0]["loss"], rel=1e-5)


def test_packing_must_be_a_bool(tmp_path, capsys):
    assert "data.packing: expected bool" in fails_cleanly(["data.packing=often"], tmp_path / "out", capsys)


@pytest.mark.slow
def test_trainer_engine_on_two_cpu_processes_end_to_end(tmp_path):
    """The loop engine's 2-process run end to end: test_runs.py::test_sigterm_to_torchrun_... (its two launches)."""
    out = tmp_path / "trainer2"
    proc = run_script(TORCHRUN_2, out, "engine=trainer", "training.max_steps=4")
    metrics = read_metrics(out)
    check_outputs(out, metrics)
    assert metrics["world_size"] == 2
    # Same global batch as one process: the accumulation halves.
    assert (metrics["micro_batch_size"], metrics["accumulation_steps"], metrics["global_batch_size"]) == (8, 2, 32)
    assert len(metrics["updates"]) == 4
    # Sequences are counted over both ranks: 8 x 2 x 2.
    assert all(u["sequences"] == 32 for u in metrics["updates"])
    assert "x 2 processes" in proc.stderr  # the effective-batch line ([hf_accum] logger)
    assert proc.stdout.count("resolved config:") == 1  # printed by the main process only
    assert proc.stdout.count("importing torch, transformers") == 1
    assert proc.stdout.count("held-out exact match before training: ") == 1
    assert "held-out exact match after training: 100%" in proc.stderr  # the main process scores all 8 rows


@pytest.mark.slow
def test_qlora_runs_on_cpu_with_the_tiny_model(tmp_path):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "qlora"
    proc = run_script(
        PYTHON, out, "--config", "recipes/configs/llama3_8b_qlora.yaml", "model.name_or_path=hf_accum:tiny-llama",
        "model.dtype=float32", "training.bf16=false", "quantization.bnb_4bit_compute_dtype=float32",
        "data.dataset=hf_accum:synthetic-tasks", "data.eval_split=test", "data.max_length=128", "training.max_steps=2",
        "global_batch_size=8", "data.eval_before=false",
    )
    metrics = read_metrics(out)
    assert metrics["trainable"]["quantized_linear_layers"] > 0
    assert len(metrics["updates"]) == 2 and metrics["accumulation_steps"] == 4
    # data.eval_before=false: the base model is not scored (no bar, nothing kept to read back); after training is
    assert "held-out exact match before training: skipped (data.eval_before=false)" in proc.stdout
    assert "held-out exact match before training:" not in proc.stderr and "after training: 100%" in proc.stderr
    assert metrics["eval_before"] is None and metrics["eval_after"]["examples"] > 0
    assert not (out / run_outputs.EVAL_BEFORE_NAME).exists()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_qlora_on_two_cpu_processes_trains_one_run_not_two(engine, tmp_path):
    """A quantized load (device_map) used to set up Accelerate's shared state first, as ONE process on a
    machine without GPU: each rank then trained alone on a global batch half the size, silently."""
    pytest.importorskip("bitsandbytes")
    out = tmp_path / f"qlora2_{engine}"
    run_script(
        TORCHRUN_2, out, "--config", "recipes/configs/llama3_8b_qlora.yaml", "model.name_or_path=hf_accum:tiny-llama",
        "model.dtype=float32", "training.bf16=false", "quantization.bnb_4bit_compute_dtype=float32",
        "data.dataset=hf_accum:synthetic-tasks", "data.eval_split=test", "data.max_length=128", "training.max_steps=2",
        "global_batch_size=16", "training.use_cpu=true", f"engine={engine}", timeout=600,
    )
    metrics = read_metrics(out)
    assert metrics["trainable"]["quantized_linear_layers"] > 0
    assert metrics["world_size"] == 2 and metrics["accumulation_steps"] == 4
    assert all(update["sequences"] == 16 for update in metrics["updates"])  # 2 per device x 4 x 2 ranks


@pytest.mark.slow
def test_two_processes_without_use_cpu_on_a_cpu_machine_stop_before_loading(tmp_path):
    from hf_accum.recipe.launch import gpu_like_device_available

    if gpu_like_device_available():
        pytest.skip("a GPU is present: Accelerate counts the processes without use_cpu")
    out = tmp_path / "no_use_cpu"
    proc = run_script(TORCHRUN_2, out, "training.use_cpu=false", timeout=300, check=False)
    assert proc.returncode != 0
    assert "the launcher started 2 processes but the process group holds 1" in proc.stderr
    assert "training.use_cpu=true" in proc.stderr
    assert not os.path.exists(out)


# -- bad input: exit code 2, a clear message, nothing written ----------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["training.learnig_rate=1e-4"], "Did you mean 'learning_rate'"),
        (["training.learning_rate=fast"], "training.learning_rate: expected float"),
        (["data.eval_before=maybe"], "data.eval_before: expected bool"),
        (["data.max_eval_examples=-1"], "data.max_eval_examples=-1 must be >= 0"),
        (["global_batch_size=null", "training.gradient_accumulation_steps=0"], "must be >= 1"),
        (["training.per_device_train_batch_size=0"], "per_device_train_batch_size=0 (command line) must be >= 1"),
        (["global_batch_size=30"], "nearest valid global_batch_size: 24 or 32"),
        (["data.dataset=/nonexistent/train.jsonl", "data.eval_split=null"], "data file not found"),
        (["lora.target_modules=[q_proj, qkv_proj]"], "'qkv_proj'"),
        (["lora.modules_to_save=[embed_token]"], "did you mean 'embed_tokens'"),
        (["lora.r=big"], "lora.r: expected int"),
        (["quantization={load_in_4bit: true}", "lora=null"], "quantization needs lora"),
        (["training.num_train_epochs=-1"], "num_train_epochs=-1.0 (command line) must be > 0"),
        (["training.max_steps=0"], "training.max_steps=0"),
        (["engine=trainr"], "Did you mean 'trainer'"),
        (["trainig.seed=1"], "unknown section 'trainig'"),
        (["model.dtype=float8"], "model.dtype='float8'"),
        (["data.max_length=1"], "data.max_length=1 must be >= 2"),
        (["accumulation.peak_flops=-5"], "accumulation.peak_flops=-5"),
        (["model.name_or_path=/nonexistent/model"], "no such directory"),
        (["training.resume_from_checkpoint=/nonexistent/checkpoint-9"], "no such checkpoint directory"),
        (["--config", "/nonexistent/config.yaml"], "config file not found"),
    ],
)
def test_bad_input_fails_before_writing(argv, message, tmp_path, capsys):
    assert message in fails_cleanly(argv, tmp_path / "out", capsys)


def test_a_yaml_that_is_not_a_mapping_fails_before_writing(tmp_path, capsys):
    path = write(tmp_path / "list.yaml", "- a\n- b\n")
    assert "the top level must be a mapping" in fails_cleanly(["--config", path], tmp_path / "out", capsys)


def test_global_batch_and_accumulation_disagreeing_in_one_yaml_name_the_file(tmp_path, capsys):
    path = write(tmp_path / "c.yaml", "global_batch_size: 32\ntraining: {per_device_train_batch_size: 8, "
                                      "gradient_accumulation_steps: 3}\n")
    err = fails_cleanly(["--config", path], tmp_path / "out", capsys)
    assert "needs gradient_accumulation_steps=4" in err and path in err


def test_a_model_directory_without_config_fails_before_writing(tmp_path, capsys):
    (tmp_path / "empty_model").mkdir()
    err = fails_cleanly([f"model.name_or_path={tmp_path / 'empty_model'}"], tmp_path / "out", capsys)
    assert "holds no config.json" in err


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_an_output_dir_that_cannot_be_written_is_found_before_training(where, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker if where == "file" else blocker / "run"
    err = fails_cleanly([], out, capsys, must_not_exist=False)
    assert "output_dir" in err and ("is a file" in err or "not writable" in err)
    assert sorted(os.listdir(tmp_path)) == ["blocker"]


GOOD_ROW = '{"prompt": "say yes", "answer": "yes"}\n'
DATA_FILE_CASES = {
    # name: (file bytes, extra overrides, fragments the message must hold)
    "missing_answer": ((GOOD_ROW * 3 + '{"prompt": "say no"}\n' + '{"prompt": "x", "answer": null}\n').encode(),
                       [], ["2 of 5 rows", "line 4"]),
    "malformed_json_line": ((GOOD_ROW * 2 + '{"prompt": "a", "answer": }\n').encode(), [], ["line 3"]),
    "invalid_utf8": (GOOD_ROW.encode() * 2 + b'{"prompt": "caf\xe9", "answer": "yes"}\n', [], ["UTF-8", "line 3"]),
    "every_example_truncated": ((('{"prompt": "' + "word " * 60 + '", "answer": "yes"}\n') * 4).encode(),
                                ["data.max_length=20"], ["data.max_length=20"]),
    "forced_format_that_does_not_fit": (GOOD_ROW.encode() * 3, ["data.format=chat"], ["data.format"]),
}


@pytest.mark.parametrize("case", sorted(DATA_FILE_CASES))
def test_bad_data_files_fail_before_writing(case, tmp_path, capsys):
    content, overrides, fragments = DATA_FILE_CASES[case]
    path = tmp_path / f"{case}.jsonl"
    path.write_bytes(content)
    err = fails_cleanly([f"data.dataset={path}", *overrides], tmp_path / "out", capsys)
    assert f"{case}.jsonl" in err or "data." in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.mark.parametrize("override, fragment", [("data.num_train_examples=0", "data.num_train_examples"),
                                                ("data.eval_fraction=1", "data.eval_fraction")])
def test_bad_data_sizes_fail_before_writing(override, fragment, tmp_path, capsys):
    assert fragment in fails_cleanly([override], tmp_path / "out", capsys)


def test_empty_dataset_fails_before_writing(tmp_path, capsys):
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    err = fails_cleanly([f"data.dataset={blank}", "data.eval_split=null"], tmp_path / "out", capsys)
    assert "blank.jsonl" in err


def test_bf16_where_unsupported_fails_before_writing(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine supports bf16")
    err = fails_cleanly(["training.use_cpu=false", "training.bf16=true"], tmp_path / "out", capsys)
    assert "bf16 requested" in err


def test_qlora_without_bitsandbytes_fails_before_writing(tmp_path, capsys, monkeypatch):
    from hf_accum.recipe import modeling

    monkeypatch.setattr(modeling, "bnb_available", lambda: False)
    err = fails_cleanly(["quantization={load_in_4bit: true}"], tmp_path / "out", capsys)
    assert "needs bitsandbytes" in err


def test_output_dir_of_a_different_run_is_left_alone(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    previous = checks.resolve(recipe_config.load_config(None, {"training.output_dir": str(out), "training.learning_rate": 1e-4}),
                              ("loop", "trainer"), ("sft", "dpo"))
    write_text_atomically(str(out / recipe_config.RESOLVED_CONFIG_NAME), previous.to_yaml())
    before = sorted(os.listdir(out))
    code = run_outputs.run_cli(load_script().main, [*SMALL, f"training.output_dir={out}"], bad_input=BAD_INPUT)
    err = capsys.readouterr().err
    assert code == 2 and "holds a different run" in err and "learning_rate" in err
    assert sorted(os.listdir(out)) == before
    assert yaml.safe_load(open(out / recipe_config.RESOLVED_CONFIG_NAME))["training"]["learning_rate"] == 1e-4


def tensorboard_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the TensorBoard event files under ``directory``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, list[tuple[int, float]]] = {}
    for root, _, files in os.walk(directory):
        if any(name.startswith("events.out.tfevents") for name in files):
            events = EventAccumulator(root)
            events.Reload()
            for tag in events.Tags()["scalars"]:
                series.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(tag))
    return series


@pytest.mark.slow
@pytest.mark.parametrize("engine, loss_tag", [("loop", "train/loss"), ("trainer", "train/loss")])
def test_tensorboard_gets_every_update_and_the_held_out_loss(engine, loss_tag, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / engine
    load_script().main([*SMALL, f"training.output_dir={out}", f"engine={engine}", "training.max_steps=3",
                        "training.report_to=tensorboard", "training.eval_strategy=steps", "training.eval_steps=2",
                        "data.num_eval_examples=4"])
    updates = read_metrics(out)["updates"]
    scalars = tensorboard_scalars(out)
    losses = dict(scalars[loss_tag])
    assert sorted(losses) == [1, 2, 3]  # one point per update (logging_steps=1 in SMALL)
    for update in updates:  # the exact per-token loss of each update, as metrics.json has it
        assert losses[update["step"]] == pytest.approx(update["loss"], rel=1e-6)
    evaluated = {u["step"]: u["eval_loss"] for u in updates if u["eval_loss"] is not None}
    assert sorted(evaluated) == [2, 3]  # every eval_steps updates, and after the last
    eval_points = dict(scalars["eval/loss"])
    for step, value in evaluated.items():
        assert eval_points[step] == pytest.approx(value, rel=1e-6)


@pytest.mark.slow
def test_sigterm_then_the_same_command_with_resume_reproduces_the_uninterrupted_run(tmp_path):
    """The recipe (loop engine) stopped by SIGTERM after a checkpoint exits 75 with checkpoint-N written;
    the same command plus training.resume_from_checkpoint=true finishes the run, and every update's loss
    and LR equal those of a run that was never interrupted."""
    import signal
    import time

    from hf_accum.control import EXIT_PREEMPTED

    overrides = ["training.max_steps=6", "training.save_steps=2", "data.num_eval_examples=2"]
    reference = tmp_path / "uninterrupted"  # never interrupted: run in this process (one thread, as the runs below)
    ran = run_main(*SMALL, f"training.output_dir={reference}", *overrides)
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = tmp_path / "interrupted"
    process = start_script(PYTHON, out, *overrides)
    deadline = time.time() + 240
    while not (out / "checkpoint-2").is_dir() and process.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
    # A process of its own: its first line comes before the heavy imports (in-process they are already done).
    assert stdout.startswith("importing torch, transformers, accelerate and PEFT ...\n")
    assert "stopped:" in stderr and not (out / run_outputs.METRICS_NAME).exists()
    proc = run_main(*SMALL, f"training.output_dir={out}", *overrides, "training.resume_from_checkpoint=true")
    assert proc.returncode == 0, proc.stderr[-3000:]  # the resume: nothing kills it, so it runs here too
    metrics = read_metrics(out)
    resumed, expected = metrics["updates"], read_metrics(reference)["updates"]
    # The resumed process reports what IT trained beside the run's total, and reads the before metric back.
    start = metrics["resumed_after_update"]
    assert start >= 2 and f"resuming from {out / f'checkpoint-{start}'}" in proc.stdout
    here = [u for u in resumed if u["step"] > start]
    assert (metrics["trained_updates"], metrics["trained_targets"]) == (6 - start, sum(u["targets"] for u in here))
    total = sum(u["targets"] for u in resumed)
    assert (f"trained {6 - start} update{'' if 6 - start == 1 else 's'} (6 in all), "
            f"{metrics['trained_targets']:,} tokens ({total:,} in all) in ") in proc.stdout
    assert "held-out exact match before training: " in proc.stdout and "(scored at this run's first start" in proc.stdout
    assert "held-out exact match before training:" not in proc.stderr  # no bar: not scored again
    assert metrics["eval_before"] == read_metrics(reference)["eval_before"]
    assert [u["step"] for u in resumed] == list(range(1, 7))
    for ours, theirs in zip(resumed, expected):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-9, abs=0)
        assert ours["learning_rate"] == theirs["learning_rate"]


def test_keys_lists_what_an_unknown_keys_message_points_to(capsys):
    """``--keys SECTION`` prints the section's valid keys, one a line (the unknown-key message names it instead
    of listing ~120 TrainingArguments fields); ``--keys`` alone the top-level keys and sections."""
    script = load_script()
    assert run_outputs.run_cli(script.main, ["--keys", "training"]) == 0
    keys = capsys.readouterr().out.split()
    assert "learning_rate" in keys and "gradient_accumulation_steps" in keys and len(keys) > 100
    assert keys == recipe_config.valid_keys("training")
    assert run_outputs.run_cli(script.main, ["--keys"]) == 0
    assert {"engine", "training", "lora"} <= set(capsys.readouterr().out.split())
    assert run_outputs.run_cli(script.main, ["--keys", "trainig"]) == 2
    assert "Did you mean 'training'?" in capsys.readouterr().err
