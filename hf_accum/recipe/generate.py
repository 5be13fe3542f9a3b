"""``hf-accum generate --run <output_dir> "prompt"``: use a trained recipe run, as it was trained.

A run's output directory holds everything needed: ``resolved_config.yaml`` (which base model, its dtype,
quantization and config overrides, the seed), and ``adapter/`` (LoRA/QLoRA; ``model/`` for full fine-tuning)
with the tokenizer and its chat template. The base model is loaded again the way the recipe loaded it --
the embedded ``hf_accum:tiny-llama`` is rebuilt in-process from the same seed, so its adapter (which names
no ``base_model_name_or_path`` on disk) fits it exactly -- the adapter goes on top, and the prompt is
rendered as a one-turn user conversation through the chat template and decoded greedily, up to the end of
the assistant's turn (the held-out metric's stop tokens: :func:`hf_accum.recipe.data.stop_token_ids`).
Prompted the way the run trained: the chat template is the one saved with the run's tokenizer, and the run's
``data.system_prompt`` comes first unless ``--system`` overrides it (``--system ''``: none).
"""

from __future__ import annotations

import os
from typing import Any

from hf_accum.errors import InputError
from hf_accum.recipe.config import RESOLVED_CONFIG_NAME, RecipeConfig, build_config, load_yaml

# The trained model (a transformers model, maybe under a PEFT adapter) and its tokenizer are Any: generate()
# and the tokenizer's calls are typed as unions that their arguments decide.


class RunDirError(InputError):
    """The directory is not a finished recipe run."""


def trained_model_dir(run_dir: str) -> tuple[str, bool]:
    """``(directory of the trained weights, whether it is a LoRA adapter)``, or :class:`RunDirError`."""
    from hf_accum.recipe.outputs import ADAPTER_DIR, MODEL_DIR

    if not os.path.isdir(run_dir):
        raise RunDirError(f"--run {run_dir!r}: no such directory")
    if not os.path.isfile(os.path.join(run_dir, RESOLVED_CONFIG_NAME)):
        raise RunDirError(f"--run {run_dir!r} holds no {RESOLVED_CONFIG_NAME}: not a recipe run's output directory "
                          "(give the training.output_dir of a run of recipes/finetune_llama.py)")
    for name, is_adapter in ((ADAPTER_DIR, True), (MODEL_DIR, False)):
        if os.path.isdir(os.path.join(run_dir, name)):
            return os.path.join(run_dir, name), is_adapter
    raise RunDirError(f"--run {run_dir!r} holds no {ADAPTER_DIR}/ or {MODEL_DIR}/: the run has not finished; "
                      "finish it with the same command and training.resume_from_checkpoint=true")


def load_trained(run_dir: str) -> tuple[Any, Any, RecipeConfig]:
    """``(model, tokenizer, config)`` of a finished run: its base rebuilt or loaded, its adapter on top."""
    from transformers import AutoTokenizer

    from hf_accum.recipe import modeling

    weights, is_adapter = trained_model_dir(run_dir)
    config = build_config(load_yaml(os.path.join(run_dir, RESOLVED_CONFIG_NAME)))
    tokenizer = AutoTokenizer.from_pretrained(weights)  # saved with the run: the tiny one's data vocabulary too
    m = config.model
    if not is_adapter:
        model = modeling.load_model(weights, tokenizer, m.dtype, config.bnb_config(),
                                    attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code)
        return model.eval(), tokenizer, config
    from peft import PeftModel

    base = modeling.load_model(
        m.name_or_path, tokenizer, m.dtype, config.bnb_config(), seed=int(config.training.get("seed", 42)),
        config_overrides=m.config_overrides, attn_implementation=m.attn_implementation,
        trust_remote_code=m.trust_remote_code, gguf_file=m.gguf_file,
    )
    return PeftModel.from_pretrained(base, weights).eval(), tokenizer, config


def trained_system_prompt(config: RecipeConfig, given: str | None = None) -> str | None:
    """The system message to prompt with: ``given`` (``--system``; ``""``: none) when given, else the run's own
    ``data.system_prompt`` -- the data loader put it before every training row that had none, so prompting without
    it asks the model something it was not trained on."""
    return config.data.system_prompt if given is None else given


def messages_of(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """A one-turn user conversation, with ``system`` first when it is a non-empty text."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def complete(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, system: str | None = None) -> str:
    """The greedy completion of ``prompt`` as a one-turn user conversation (through the chat template), after the
    system message ``system`` (None or ``""``: none; a run's own: :func:`trained_system_prompt`)."""
    import torch

    from hf_accum.recipe.data.encoding import cut_at_stop, prompt_ids, stop_token_ids

    ids = torch.tensor([prompt_ids(tokenizer, messages_of(prompt, system))])
    stops = stop_token_ids(tokenizer, model)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=stops)
    return tokenizer.decode(cut_at_stop(out[0, ids.shape[1]:].tolist(), stops), skip_special_tokens=True)
