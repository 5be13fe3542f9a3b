"""The recipe script itself under DeepSpeed ZeRO-3, 2 CPU processes (torchrun, gloo), both engines:

* its adapter equals the adapter of the same command on ONE process (the big batch itself: the same global batch,
  so the same rows in each update), fp32, 10 updates, max abs diff <= 1e-4, and every update's loss, LR and
  target count equal that run's;
* the held-out exact match is scored after training although every rank holds only a shard;
* the loop's held-out loss during training (7 rows: uneven shards) equals the one-process run's;
* a ZeRO-3 run cut after its checkpoint at update 5 (what a kill right after it leaves: no metrics,
  no adapter, no later checkpoint) and resumed with ``training.resume_from_checkpoint=true`` ends with
  the uninterrupted run's updates and adapter; its checkpoints hold DeepSpeed's own state files;
* the trainer's ZeRO-3 run loads the same tiny Llama from a directory, which transformers partitions as it loads
  (no rank holds all of it): all of the above for such a model, and its held-out score waits for training;
* QLoRA (4-bit base) under ZeRO-3 trains the adapter of the same command on one process, both engines.

The one-process references run in the pytest process (``run_main``, conftest.py), not as launches of their own:
each would cost a launch's start-up for a run whose numbers do not depend on being a process of its own. The
loop's ZeRO-3 run is the same command plus a ZeRO-3 config that releases every gathered parameter at once (see
``test_loop_held_out_loss_under_zero3_with_uneven_shards``); the trainer runs use the ready
recipes/deepspeed/zero3.json, as the QLoRA runs of both engines do. The trainer's model from disk rides on its
ZeRO-3 run rather than a launch of its own: the built-in model's path under ZeRO-3 (whole in memory, partitioned
at prepare) stays covered by the QLoRA runs and, with exact SGD deltas, by tests/distributed/test_deepspeed.py.

The library-level exactness under ZeRO-2/3 (weight deltas of SGD against the big batch) is
tests/distributed/test_deepspeed.py."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from hf_accum.recipe.testing import (
    ROOT,
    TORCHRUN_2,
    cut_after_checkpoint,
    held_out_losses,
    load_adapter,
    max_abs_diff,
    read_metrics,
    run_script,
)
from hf_accum.testing.cases.recipe_runs_case import engine_run, held_out_rows

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="pip install 'hf_accum[deepspeed]'"),
]

ZERO3 = "training.deepspeed=recipes/deepspeed/zero3.json"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference_recipe_run):
    """engine -> {"reference": dir, "zero3": dir, "command": the ZeRO-3 run's arguments, "stdout": what it
    printed}, made on first use (each ZeRO-3 run ~25 CPU-s; the one-process reference is shared with the FSDP recipe
    tests, see conftest.py). The trainer's run loads its model from a directory (:func:`tiny_llama_on_disk`)."""
    made: dict[str, dict] = {}

    def get(engine: str) -> dict:
        if engine not in made:
            root = tmp_path_factory.mktemp(engine)
            command = [*engine_run(engine), *zero3_settings(engine, root)]
            proc = run_script(TORCHRUN_2, root / "zero3", *command, timeout=600)
            made[engine] = {"reference": reference_recipe_run(engine), "zero3": root / "zero3", "command": command,
                            "stdout": proc.stdout}
        return made[engine]

    return get


def zero3_settings(engine: str, directory) -> list[str]:
    """What ``engine``'s ZeRO-3 run adds to the one-process command: the loop's a ZeRO-3 config releasing every
    gathered parameter (:func:`releasing_zero3`); the trainer's the ready config and the same tiny Llama loaded
    from a directory, which transformers partitions as it loads (test_trainer_zero3_partitions_a_model_from_disk_as
    _it_loads reads that run instead of a launch of its own)."""
    if engine == "loop":
        return [releasing_zero3(directory)]
    return [ZERO3, f"model.name_or_path={tiny_llama_on_disk(directory / 'model')}"]


def tiny_llama_on_disk(model_dir) -> str:
    """The embedded tiny Llama (seed 0, the recipe's default) and its tokenizer saved in ``model_dir``."""
    from hf_accum.recipe.embedded import build_tiny_llama
    from hf_accum.recipe.modeling import load_tokenizer

    tokenizer = load_tokenizer("hf_accum:tiny-llama")
    build_tiny_llama(tokenizer, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return str(model_dir)


def releasing_zero3(directory) -> str:
    """recipes/deepspeed/zero3.json releasing every gathered parameter at once (as a model too big to keep them
    would): with the ready file's generous limits the tiny model keeps them gathered, and a rank that skipped a
    forward the other runs would not make it wait. The ``training.deepspeed`` setting of a copy in ``directory``."""
    with open(os.path.join(ROOT, "recipes", "deepspeed", "zero3.json")) as handle:
        releasing = json.load(handle)
    releasing["zero_optimization"].update(stage3_max_live_parameters=1, stage3_max_reuse_distance=0,
                                          stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0)
    config_path = directory / "zero3_releasing.json"
    config_path.write_text(json.dumps(releasing))
    return f"training.deepspeed={config_path}"


@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_zero3_recipe_saves_the_adapter_of_the_one_process_run(runs, engine):
    one_process, zero3 = runs(engine)["reference"], runs(engine)["zero3"]
    reference = load_adapter(one_process)
    assert max_abs_diff(load_adapter(zero3), reference) <= 1e-4
    # The comparison can fail: training moved the adapter 10x beyond the tolerance (LoRA B starts at 0).
    assert max(float(reference[key].abs().max()) for key in reference if "lora_B" in key) > 1e-3
    ours, theirs = read_metrics(zero3), read_metrics(one_process)
    assert (ours["world_size"], theirs["world_size"]) == (2, 1)
    assert [u["step"] for u in ours["updates"]] == list(range(1, 11))
    for mine, other in zip(ours["updates"], theirs["updates"]):
        assert mine["loss"] == pytest.approx(other["loss"], rel=1e-5)
        assert mine["learning_rate"] == pytest.approx(other["learning_rate"], rel=1e-12, abs=1e-15)
        assert mine["targets"] == other["targets"]


@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_zero3_recipe_scores_the_held_out_set_after_training(runs, engine):
    metrics = read_metrics(runs(engine)["zero3"])
    assert metrics["eval_after"] is not None and metrics["eval_after"]["examples"] == held_out_rows(engine)


def test_trainer_zero3_partitions_a_model_from_disk_as_it_loads(runs):
    """A model directory (not the built-in tiny one) under the trainer engine is loaded inside
    deepspeed.zero.Init: no rank ever holds all of it. It cannot be scored before training (no
    DeepSpeed hooks yet: the recipe says why), is scored after, and trains to the one-process run's adapter
    (the directory holds the same tiny Llama and tokenizer; the one-process run builds it in memory)."""
    run = runs("trainer")
    assert any(setting.startswith("model.name_or_path=") for setting in run["command"])
    assert "partitioned the model as it loaded" in run["stdout"]
    metrics = read_metrics(run["zero3"])
    assert metrics["eval_before"] is None and metrics["eval_after"]["examples"] == held_out_rows("trainer")
    # Parameters counted whole although each rank holds a shard (ds_numel), as in the one-process run.
    assert metrics["trainable"] == read_metrics(run["reference"])["trainable"]
    assert max_abs_diff(load_adapter(run["zero3"]), load_adapter(run["reference"])) <= 1e-4


@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_zero3_recipe_resumes_exactly_from_deepspeed_state_files(runs, engine, tmp_path):
    finished = runs(engine)["zero3"]
    checkpoint = os.path.join(finished, "checkpoint-5")
    deepspeed_files = [name for _, _, names in os.walk(checkpoint) for name in names if "optim_states" in name]
    assert len(deepspeed_files) == 2  # one ZeRO shard of the optimizer state per rank
    cut = tmp_path / "cut"
    cut_after_checkpoint(finished, cut, 5)
    proc = run_script(TORCHRUN_2, cut, *runs(engine)["command"], "training.resume_from_checkpoint=true", timeout=600)
    assert "checkpoint-5" in proc.stdout + proc.stderr
    resumed, uninterrupted = read_metrics(cut)["updates"], read_metrics(finished)["updates"]
    assert [u["step"] for u in resumed] == list(range(1, 11))  # the updates before the checkpoint included
    for mine, other in zip(resumed, uninterrupted):
        assert mine["loss"] == pytest.approx(other["loss"], rel=1e-9, abs=0)
        assert mine["learning_rate"] == other["learning_rate"]
    assert max_abs_diff(load_adapter(cut), load_adapter(finished)) <= 1e-6


# No LoRA dropout: each process draws its masks from its own random stream, so with dropout a 2-process run could
# only be compared with another 2-process run (DDP), which shares the normalization under test; without it the
# 2-process run must equal the big batch itself, the same command on one process.
QLORA_ON_CPU = [
    "--config", "recipes/configs/llama3_8b_qlora.yaml", "model.name_or_path=hf_accum:tiny-llama", "model.dtype=float32",
    "training.bf16=false", "quantization.bnb_4bit_compute_dtype=float32", "data.dataset=hf_accum:synthetic-tasks",
    "data.eval_split=test", "data.max_length=128", "data.num_train_examples=200", "training.max_steps=3",
    "global_batch_size=16", "training.use_cpu=true", "lora.lora_dropout=0",
]


@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_qlora_under_zero3_trains_the_adapter_of_the_one_process_run(engine, tmp_path, one_process_run):
    """QLoRA (nf4 base, LoRA adapters) under ZeRO-3 on 2 processes trains the adapter of the same command on ONE
    process (the big batch itself: 2 x 4 x 2 there, 2 x 8 here; a rank that normalized by its own targets would
    differ). (The trainer engine loads the 4-bit base without a device_map: transformers refuses one while a
    ZeRO-3 config is alive; the loop engine loads it on every rank and DeepSpeed partitions it at prepare.) The
    reference runs in the pytest process (``one_process_run``, conftest.py), bitsandbytes' 4-bit layers too."""
    pytest.importorskip("bitsandbytes")
    zero3 = tmp_path / "zero3"
    one_process = one_process_run(tmp_path / "one_process", *QLORA_ON_CPU, f"engine={engine}")
    run_script(TORCHRUN_2, zero3, *QLORA_ON_CPU, f"engine={engine}", ZERO3, timeout=600)
    ours, theirs = read_metrics(zero3), read_metrics(one_process)
    assert (ours["world_size"], theirs["world_size"]) == (2, 1)
    assert ours["trainable"]["quantized_linear_layers"] > 0
    assert ours["trainable"] == theirs["trainable"]  # 4-bit and sharded weights counted whole
    assert [u["targets"] for u in ours["updates"]] == [u["targets"] for u in theirs["updates"]]
    assert [u["loss"] for u in ours["updates"]] == pytest.approx([u["loss"] for u in theirs["updates"]], rel=1e-5)
    reference = load_adapter(one_process)
    moved = max(float(reference[key].abs().max()) for key in reference if "lora_B" in key)
    assert max_abs_diff(load_adapter(zero3), reference) <= moved / 100  # measured ~1e-8 of ~3e-4


def test_loop_held_out_loss_under_zero3_with_uneven_shards(runs):
    """Held-out loss during training under ZeRO-3 (the loop's run scores it at updates 5 and 10): 7 held-out rows
    in batches of 3 give rank 0 two batches and rank 1 one. Every forward gathers parameters from all ranks, so
    rank 1 must run a forward more (counting nothing) or both wait forever; the loss equals the one-process run's
    (all 7 rows in one process: a rank's extra forward counted, or a mean of the ranks' means, would differ). The
    run's ZeRO-3 config releases every gathered parameter at once (:func:`releasing_zero3`), so the wait is real."""
    measured, expected = (held_out_losses(runs("loop")[run]) for run in ("zero3", "reference"))
    assert read_metrics(runs("loop")["zero3"])["world_size"] == 2
    assert sorted(measured) == sorted(expected) == [5, 10]
    assert [measured[step] for step in (5, 10)] == pytest.approx([expected[step] for step in (5, 10)], rel=1e-5)
