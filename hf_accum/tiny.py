"""The tiny Llama shape and the word-level tokenizer: models and tokenizers built from code, nothing
downloaded.

Used by :mod:`hf_accum.testing` (exactness checks, ``hf-accum check``), the benchmarks, and the
recipe kit's embedded default (:mod:`hf_accum.recipe.embedded`, which adds its vocabulary, its
synthetic tasks and its seeded model on top).
"""

from __future__ import annotations

from typing import Any

SPECIAL_TOKENS = ["<pad>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Small enough to train in about a minute on 2 CPU cores, large enough to learn the embedded tasks.
TINY_LLAMA = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def tiny_llama_config(**values: Any) -> Any:  # a transformers.LlamaConfig
    """A ``LlamaConfig`` of the tiny shape (:data:`TINY_LLAMA`), ``values`` on top. The one place a tiny
    Llama config is built: the recipe's default model, the tests and the benchmarks pass their sizes."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **values})


def word_splitter() -> Any:  # a tokenizers pre-tokenizer
    """Runs of word characters, and runs of punctuation, each a token: ``"Paris."`` -> ``Paris``, ``.``."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Whitespace()


def build_tiny_tokenizer(words: list[str]) -> Any:  # a tokenizers.Tokenizer
    """A word-level tokenizer over ``words`` (ids in that order, after the chat special tokens)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for word in words:
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = word_splitter()
    # WordPiece's decoder joins tokens with single spaces: the embedded data round-trips exactly
    # (it is space separated); other text comes back with spaces around punctuation.
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|end|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
