"""torch.compile keeps exact accumulation: the loop (``LoopConfig(compile=True)``) and AccumTrainer
(``TrainingArguments(torch_compile=True)``) apply the float64 big-batch gradient (1e-10) with the model's blocks
compiled, on uneven micro-batches with a short last window, within a bounded number of graphs.

Inductor costs tens of seconds per graph on 2 shared cores, so the front-ends are checked with ``aot_eager``
(Dynamo's capture and AOTAutograd's joint forward/backward graph, the parts that could change which function is
differentiated) and inductor's generated float64 kernels once, on the loop (slow: one static graph, its C++ built
at ``-O0`` through ``TORCHINDUCTOR_DEBUG_COMPILE``: the same kernels, the same arithmetic)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from hf_accum.batching import PaddingCollator
from hf_accum.compile import CompileError, compile_blocks, compiled_blocks, repeated_blocks
from hf_accum.loop import LoopConfig
from hf_accum.loop.config import LoopConfigError
from hf_accum.testing import PAD, Scenario, random_rows, run_exact, run_trainer, tiny_causal_lm

EXACT = 1e-10
# The first length compiles a static graph, the second one dynamic-length graph that serves every later length.
MAX_GRAPHS = 2


@pytest.fixture
def fresh_dynamo(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_DEBUG_COMPILE", "1")  # -O0: the C++ builds in a fraction of the time
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def _uneven_scenario(**changes) -> Scenario:
    # 14 rows of 9-40 tokens, micro-batch 2, K=3: windows of 3, 3 and a short 1 micro-batch, every length different.
    values = dict(name="compiled", model_factory=tiny_causal_lm, examples=random_rows(14, seed=21, prompt_masking=True),
                  collator=PaddingCollator(PAD), micro_batch=2, accumulation=3)
    values.update(changes)
    return Scenario(**values)


def _compiled_model_factory(captured: dict, build=tiny_causal_lm):
    def factory():
        captured["model"] = build()
        return captured["model"]

    return factory


def _run_compiled_loop(backend: str, model_factory=tiny_causal_lm, **changes):
    captured: dict = {}
    loop = {"compile": True, "compile_backend": backend}
    result, auditor = run_exact(_uneven_scenario(model_factory=_compiled_model_factory(captured, model_factory),
                                                 loop_kwargs=loop, **changes))
    assert [u.micro_batches for u in result.updates] == [3, 3, 1]
    assert auditor.max_relative_error < EXACT, [r.relative_error for r in auditor.records]
    assert compiled_blocks(captured["model"]) == 2  # both decoder layers, in place
    assert compiled_blocks(auditor._reference) == 0  # the big-batch reference ran eager (copied before compiling)
    return auditor


def test_loop_compiled_gradient_equals_big_batch(fresh_dynamo):
    _run_compiled_loop("aot_eager")
    assert not fresh_dynamo["graph_break"], dict(fresh_dynamo["graph_break"])
    assert 1 <= fresh_dynamo["stats"]["unique_graphs"] <= MAX_GRAPHS, dict(fresh_dynamo["stats"])


def test_loop_replaces_accelerates_whole_model_compile(fresh_dynamo):
    """``Accelerator(dynamo_backend=...)`` compiles the whole model in ``prepare``: the loop compiles its blocks
    instead, with the Accelerator's backend (a whole-model graph breaks at the fused head every micro-batch)."""
    captured: dict = {}
    scenario = _uneven_scenario(model_factory=_compiled_model_factory(captured),
                                accelerator_kwargs={"dynamo_backend": "eager"})
    result, auditor = run_exact(scenario, on_model=lambda model: captured.update(prepared=model))
    assert isinstance(captured["prepared"], torch._dynamo.eval_frame.OptimizedModule)
    assert auditor.max_relative_error < EXACT, [r.relative_error for r in auditor.records]
    assert compiled_blocks(captured["model"]) == 2
    assert not fresh_dynamo["graph_break"], dict(fresh_dynamo["graph_break"])
    assert 1 <= fresh_dynamo["stats"]["unique_graphs"] <= MAX_GRAPHS, dict(fresh_dynamo["stats"])


def _checkpointed_lora_model():
    from peft import LoraConfig, get_peft_model

    model = tiny_causal_lm()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(model, lora).to(torch.float64)


def test_loop_compiled_lora_with_gradient_checkpointing_is_exact(fresh_dynamo):
    """LoRA adapters inside the compiled blocks, each block recomputed (compiled) in backward."""
    _run_compiled_loop("aot_eager", model_factory=_checkpointed_lora_model)
    assert not fresh_dynamo["graph_break"], dict(fresh_dynamo["graph_break"])
    assert 1 <= fresh_dynamo["stats"]["unique_graphs"] <= MAX_GRAPHS, dict(fresh_dynamo["stats"])


@pytest.mark.slow
def test_loop_inductor_gradient_equals_big_batch(fresh_dynamo):
    """Inductor's own float64 kernels (fused elementwise ops, reductions, their backward): still exact."""
    _run_compiled_loop("inductor", collator=PaddingCollator(PAD, pad_to_multiple_of=64))
    assert fresh_dynamo["stats"]["unique_graphs"] == 1  # every micro-batch padded to 64: one static graph


def test_trainer_compiled_gradient_equals_big_batch(fresh_dynamo, tmp_path):
    from hf_accum import AccumTrainer

    run = run_trainer(_uneven_scenario(), str(tmp_path), AccumTrainer, torch_compile=True,
                      torch_compile_backend="aot_eager")
    assert len(run.errors) == 3 and run.max_error < EXACT, run.errors
    model = run.trainer.model
    assert not isinstance(model, torch._dynamo.eval_frame.OptimizedModule)  # not compiled whole by Accelerate
    assert compiled_blocks(model) == 2
    assert not fresh_dynamo["graph_break"], dict(fresh_dynamo["graph_break"])
    assert 1 <= fresh_dynamo["stats"]["unique_graphs"] <= MAX_GRAPHS, dict(fresh_dynamo["stats"])


def test_evaluation_and_probes_run_eager(fresh_dynamo):
    """No-grad forwards (held-out loss, the first micro-batch's probes, generation) compile nothing."""
    model = tiny_causal_lm()
    compile_blocks(model, backend="eager")
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5, 6]]), use_cache=True)
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    assert fresh_dynamo["stats"]["unique_graphs"] == 0
    model(input_ids=torch.tensor([[3, 4, 5, 6]]), use_cache=False)
    assert fresh_dynamo["stats"]["unique_graphs"] == 1


def test_blocks_are_found_through_peft_and_compiled_once():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_causal_lm(), LoraConfig(r=2, target_modules=["q_proj"]))
    (layers,) = repeated_blocks(model)
    assert len(layers) == 2 and type(layers[0]).__name__ == "LlamaDecoderLayer"
    assert compile_blocks(model, backend="eager") == 2
    first = layers[0]._compiled_call_impl
    compile_blocks(model, backend="eager")
    assert layers[0]._compiled_call_impl is first  # idempotent
    assert compiled_blocks(model) == 2
    assert not any(name.startswith("_orig_mod") or "._orig_mod" in name for name in model.state_dict())


def test_model_without_repeated_blocks_is_refused():
    with pytest.raises(CompileError, match="Linear has no repeated blocks"):
        compile_blocks(torch.nn.Linear(2, 2))


def test_training_arguments_map_to_loop_config(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(str(tmp_path), torch_compile=True, torch_compile_mode="max-autotune-no-cudagraphs",
                             use_cpu=True, report_to="none")
    config = LoopConfig.from_training_arguments(args)
    assert (config.compile, config.compile_backend, config.compile_mode) == (True, "inductor",
                                                                            "max-autotune-no-cudagraphs")
    assert LoopConfig.from_training_arguments(TrainingArguments(str(tmp_path), use_cpu=True)).compile is False
    assert {"torch_compile", "torch_compile_backend", "torch_compile_mode"} <= LoopConfig.training_argument_names()


def test_recipe_key_reaches_both_engines(tmp_path):
    """``training.torch_compile=true``: a TrainingArguments key (the trainer engine's), which the loop engine reads
    into LoopConfig (the recipe's LOOP_READS is LoopConfig.training_argument_names(): no "ignores" note)."""
    from hf_accum.recipe.checks import load_recipe_config

    config = load_recipe_config(["training.torch_compile=true", f"training.output_dir={tmp_path}"],
                                engines=["loop", "trainer"], objectives=["sft"])
    args = config.training_arguments()
    assert args.torch_compile is True
    assert LoopConfig.from_training_arguments(args, accumulation=config.accumulation).compile is True


@pytest.mark.parametrize("field, value, message", [
    ("compile", "yes", "LoopConfig.compile='yes' must be True or False"),
    ("compile_dynamic", 1, "LoopConfig.compile_dynamic=1 must be None, True or False"),
    ("compile_mode", "fast", "LoopConfig.compile_mode='fast'; allowed: None, 'default'"),
])
def test_bad_compile_settings_are_refused(field, value, message):
    with pytest.raises(LoopConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LoopConfig(**{field: value})


def test_unknown_backend_is_refused():
    with pytest.raises(LoopConfigError, match="LoopConfig.compile_backend='nope'; allowed: .*'inductor'"):
        LoopConfig(compile=True, compile_backend="nope")
