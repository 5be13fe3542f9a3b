"""The embedded default (``hf_accum:tiny-llama`` on ``hf_accum:synthetic-tasks``): everything the
recipe needs to train with no download and no file, in one place.

* the **synthetic tasks** (copy, reverse, table lookup, last word): rows generated from a seed, a
  training split and a held-out split with no row seen in training; as **preference pairs** too (the
  right answer chosen, the same answer with one word replaced by a word absent from the prompt rejected) for
  ``objective: dpo``;
* the **tokenizer**: word-level (:func:`hf_accum.tiny.build_tiny_tokenizer`), over the tasks' words,
  or over the most frequent words of the user's own data when the tiny model trains on it;
* the **model**: a tiny ``LlamaForCausalLM`` (:func:`hf_accum.tiny.tiny_llama_config`) of that
  vocabulary, randomly initialised from a seed;
* the **default run's config**: ``recipes/configs/cpu_default.yaml``, the one source of what a run
  with no ``--config`` does, shipped inside the package (:func:`default_config_path`).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from importlib import resources
from typing import TYPE_CHECKING, Any, Iterable

from hf_accum.tiny import SPECIAL_TOKENS, build_tiny_tokenizer, tiny_llama_config, word_splitter

if TYPE_CHECKING:  # transformers is imported where used
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase, PreTrainedTokenizerFast

TINY_MODEL = "hf_accum:tiny-llama"
EMBEDDED_DATASET = "hf_accum:synthetic-tasks"
# Words in a tiny tokenizer built from user data: the most frequent ones (embedding and LM head
# rows of the tiny model grow with it; rarer words become <unk>, counted and reported).
TINY_VOCAB_LIMIT = 8192
# The packaged name of recipes/configs/cpu_default.yaml (a link to it in the source tree, a copy in a wheel).
DEFAULT_CONFIG_FILE = "cpu_default.yaml"
# The embedded default of each objective other than sft (`objective=dpo` with no --config): its own sizes and LR.
OBJECTIVE_CONFIG_FILES = {"dpo": "cpu_dpo.yaml", "grpo": "cpu_grpo.yaml"}


def default_config_path(objective: str = "sft") -> str:
    """Path of the CPU default run's YAML (``recipes/configs/cpu_default.yaml``; for ``objective=dpo``
    ``recipes/configs/cpu_dpo.yaml``), as installed."""
    path = resources.files("hf_accum.recipe") / OBJECTIVE_CONFIG_FILES.get(objective, DEFAULT_CONFIG_FILE)
    return str(path)


# ----------------------------------------------------------------------------------------------
# The synthetic instruction dataset
# ----------------------------------------------------------------------------------------------

# Plain words for copy/reverse/last-word tasks; made-up countries and cities for lookups
# (made up so that no "world knowledge" is needed: the answer is always in the prompt).
WORDS = (
    "apple river stone cloud green seven lamp tiger paper window music orange silver forest "
    "bread candle mirror rocket garden winter honey planet button dragon pencil ocean castle "
    "violet thunder marble yellow basket feather jungle anchor lemon shadow copper whistle"
).split()
_SYLLABLES = "zor bel kan tri vo mur sel dun pa ri lo fen gar ti nu qua".split()
TASKS = ("copy", "reverse", "lookup", "last")


def _made_up_names(rng: random.Random, count: int, suffix: str) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        names.add("".join(rng.sample(_SYLLABLES, 2)) + suffix)
    return sorted(names)


COUNTRIES = _made_up_names(random.Random(1), 24, "ia")
CITIES = _made_up_names(random.Random(2), 24, "burg")


def synthetic_example(rng: random.Random, task: str) -> dict[str, str]:
    """One example of ``task``. Tokens are space separated so a word-level tokenizer round-trips them."""
    if task == "copy":
        words = rng.choices(WORDS, k=rng.randint(1, 10))
        return {"task": task, "prompt": "repeat the words : " + " ".join(words), "answer": " ".join(words)}
    if task == "reverse":
        words = rng.choices(WORDS, k=rng.randint(1, 6))
        return {"task": task, "prompt": "reverse the words : " + " ".join(words), "answer": " ".join(words[::-1])}
    if task == "lookup":
        countries = rng.sample(COUNTRIES, rng.randint(2, 8))
        cities = rng.sample(CITIES, len(countries))
        table = " ; ".join(f"{c} = {t}" for c, t in zip(countries, cities))
        asked = rng.randrange(len(countries))
        prompt = f"capitals : {table} . what is the capital of {countries[asked]} ?"
        return {"task": task, "prompt": prompt, "answer": cities[asked]}
    if task == "last":
        words = rng.choices(WORDS, k=rng.randint(2, 14))
        return {"task": task, "prompt": "last word of : " + " ".join(words), "answer": words[-1]}
    raise ValueError(f"unknown synthetic task {task!r}; known: {TASKS}")


def synthetic_rows(num_examples: int, seed: int) -> list[dict[str, str]]:
    """``num_examples`` rows cycling through the tasks, fully determined by ``seed``."""
    rng = random.Random(seed)
    return [synthetic_example(rng, TASKS[i % len(TASKS)]) for i in range(num_examples)]


def synthetic_splits(num_train: int, num_eval: int, seed: int) -> dict[str, list[dict[str, str]]]:
    """Train and held-out splits; held-out rows that also occur in train are replaced, so the
    metric measures generalisation, not memorisation."""
    train = synthetic_rows(num_train, seed)
    seen = {(r["prompt"], r["answer"]) for r in train}
    rng = random.Random(seed + 10_007)
    held_out: list[dict[str, str]] = []
    while len(held_out) < num_eval:
        row = synthetic_example(rng, TASKS[len(held_out) % len(TASKS)])
        if (row["prompt"], row["answer"]) not in seen:
            held_out.append(row)
    return {"train": train, "test": held_out}


def corrupted_answer(rng: random.Random, row: dict[str, str]) -> str:
    """A wrong answer to ``row``: the right one with one word replaced by a word the prompt does not hold (a city of
    no row of the table for lookup, a word of no position of the list for the others). As many words as the right
    answer, so that preferring it is not preferring shorter answers."""
    answer, present = row["answer"].split(), set(row["prompt"].split())
    pool = CITIES if row["task"] == "lookup" else WORDS
    wrong = list(answer)
    wrong[rng.randrange(len(wrong))] = rng.choice([word for word in pool if word not in present])
    return " ".join(wrong)


def synthetic_preference_splits(num_train: int, num_eval: int, seed: int) -> dict[str, list[dict[str, str]]]:
    """The synthetic splits as preference pairs ``{"task", "prompt", "chosen", "rejected"}``: the right answer
    chosen, :func:`corrupted_answer` rejected (drawn from its own seeded stream)."""
    rng = random.Random(seed + 20_011)
    return {
        split: [{"task": row["task"], "prompt": row["prompt"], "chosen": row["answer"],
                 "rejected": corrupted_answer(rng, row)} for row in rows]
        for split, rows in synthetic_splits(num_train, num_eval, seed).items()
    }


def synthetic_corpus() -> list[str]:
    """Every word the synthetic tasks can produce (the default tokenizer's vocabulary source)."""
    fixed = "repeat reverse the words : capitals ; = . what is capital of ? last word".split()
    return fixed + WORDS + COUNTRIES + CITIES


# ----------------------------------------------------------------------------------------------
# The tokenizer
# ----------------------------------------------------------------------------------------------


def tiny_vocabulary(texts: Iterable[str], limit: int) -> list[str]:
    """The ``limit`` most frequent words of ``texts`` (ties: first seen first), split exactly as the
    tiny tokenizer splits them. Rarer words will be ``<unk>``; the data loader counts them."""
    splitter = word_splitter()
    # The tokenizer matches its special tokens before splitting words; so does the count.
    specials = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))
    counts: Counter[str] = Counter()
    for text in texts:
        for part in specials.split(text):
            counts.update(word for word, _ in splitter.pre_tokenize_str(part))
    return [word for word, _ in counts.most_common(limit)]


def tiny_tokenizer(corpus: Iterable[str] | None = None, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """The embedded model's tokenizer: over the words of ``corpus`` (the user's texts, the
    :data:`TINY_VOCAB_LIMIT` most frequent) when given, else over the synthetic tasks' words."""
    words = tiny_vocabulary(corpus, TINY_VOCAB_LIMIT) if corpus is not None else synthetic_corpus()
    tokenizer = build_tiny_tokenizer(words)
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


def recipe_tiny_config(tokenizer: PreTrainedTokenizerBase, overrides: dict[str, Any] | None = None) -> LlamaConfig:
    """The embedded default model's config: the tokenizer's vocabulary and special ids, plus
    ``model.config_overrides``."""
    return tiny_llama_config(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, **(overrides or {}),
    )


def build_tiny_llama(tokenizer: PreTrainedTokenizerBase, seed: int = 0,
                     overrides: dict[str, Any] | None = None) -> LlamaForCausalLM:
    """A randomly initialised tiny Llama; the same ``seed`` gives the same weights."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(recipe_tiny_config(tokenizer, overrides))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
