"""The held-out metric: exact match of the greedy answer, overall and per task.

Generation stops where the chat template ends a turn (:func:`~hf_accum.recipe.data.encoding.stop_token_ids`:
the model's ``generation_config`` EOS ids, the tokenizer's EOS and the template's end-of-turn token), and the
answer scored is the text before the first stop."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from hf_accum.recipe.data.encoding import cut_at_stop, prompt_ids, stop_token_ids
from hf_accum.recipe.data.formats import Example

# The model (a causal LM, maybe PEFT-wrapped) and the tokenizer are Any: generate() and the tokenizer's calls
# are typed as unions that their arguments decide.


def normalize_answer(text: str) -> str:
    return " ".join(text.split())


def as_decoded(tokenizer: Any, text: str) -> str:
    """``text`` as the tokenizer gives it back (the tiny word-level one spaces out punctuation), so a
    generated answer is compared with what the model could have produced."""
    return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"], skip_special_tokens=True)


@torch.no_grad()
def exact_match(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    max_new_tokens: int = 16,
    batch_size: int = 32,
    on_rows: Callable[[int], Any] = lambda rows: None,
    synced_gpus: bool = False,
) -> dict[str, Any]:
    """Greedy-decode each conversation's prompt; score 1 when the answer matches the last assistant
    message exactly (whitespace-normalised). Returns the overall score and the score per ``task``.

    ``synced_gpus``: every rank calls this with the same examples and keeps running forwards until
    all ranks are done (``generate(synced_gpus=True)``), as a ZeRO-3-partitioned model needs: each
    forward gathers parameters from all ranks. ``on_rows(n)``: called as each batch of ``n`` rows is scored (a
    progress bar's advance: :func:`hf_accum.recipe.progress.phase_bar`)."""
    was_training = model.training
    model.eval()
    hits: list[tuple[str, bool]] = []
    samples: list[dict[str, str]] = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        answers = _generate(model, tokenizer, chunk, max_new_tokens, synced_gpus)
        on_rows(len(chunk))
        for example, text in zip(chunk, answers):
            expected = example.conversation()[-1]["content"]
            ok = normalize_answer(text) == normalize_answer(as_decoded(tokenizer, expected))
            hits.append((example.task, ok))
            if len(samples) < 4:
                samples.append({"prompt": example.conversation()[-2]["content"], "expected": expected,
                                "generated": text})
    model.train(was_training)
    per_task: dict[str, list[bool]] = {}
    for task, ok in hits:
        per_task.setdefault(task, []).append(ok)
    return {
        "exact_match": sum(ok for _, ok in hits) / max(1, len(hits)),
        "per_task": {t: sum(v) / len(v) for t, v in sorted(per_task.items())},
        "examples": len(hits),
        "samples": samples,
    }


def _generate(
    model: Any, tokenizer: Any, examples: Sequence[Example], max_new_tokens: int, synced_gpus: bool = False
) -> list[str]:
    """Batched greedy decoding with left padding (so every prompt ends where generation starts)."""
    prompts = [prompt_ids(tokenizer, example.conversation()[:-1]) for example in examples]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    device = next(model.parameters()).device
    stops = stop_token_ids(tokenizer, model)
    out = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=stops,
        synced_gpus=synced_gpus,  # explicit: left None, generate syncs whenever a ZeRO-3 config is alive
    )
    answers = [cut_at_stop(row, stops) for row in out[:, width:].tolist()]
    return tokenizer.batch_decode(answers, skip_special_tokens=True)
