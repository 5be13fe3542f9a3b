"""Where a turn ends, on the chat templates real models ship: ChatML, Llama 3, Gemma, Phi-3 and Mistral.

Each tokenizer is built in-process (nothing downloaded): a character-level byte tokenizer carrying the
template's special tokens, with the template as its ``chat_template``. The metric is driven by a real
``LlamaForCausalLM`` whose weights make it a bigram model (the next token a fixed function of the current
one), so ``generate`` really runs and really has to stop: it answers ``ok`` and then, like a model that
learned the template, keeps writing turns (``ok<end_of_turn>\\nok<end_of_turn>\\n...``) unless stopped.
"""

from __future__ import annotations

import pytest
import torch

from hf_accum.losses.token_loss import IGNORE_INDEX
from hf_accum.recipe.data.encoding import encode_examples, end_of_turn_id, prompt_ids, stop_token_ids
from hf_accum.recipe.data.formats import Example
from hf_accum.recipe.data.metric import exact_match
from hf_accum.recipe.generate import complete

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else "
    "message['role'] %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
# name: (template, bos, eos, other special tokens, the expected end-of-turn token)
TEMPLATES = {
    # ChatML as a base model's tokenizer has it (Qwen-style): EOS <|endoftext|>, not the end of turn.
    "chatml": (CHATML, None, "<|endoftext|>", ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    # Llama 3 with the base model's tokenizer: EOS <|end_of_text|>, turns end with <|eot_id|>.
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|end_of_text|>", ["<|start_header_id|>", "<|end_header_id|>",
                                                                "<|eot_id|>"], "<|eot_id|>"),
    "gemma": (GEMMA, "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    "phi3": (PHI3, None, "<|endoftext|>", ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"], "<|end|>"),
    "mistral": (MISTRAL, "<s>", "</s>", [], "</s>"),
}


def template_tokenizer(name: str):
    """A character-level tokenizer (every byte one token, no merges) with ``name``'s special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    template, bos, eos, specials, _ = TEMPLATES[name]
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    named = {"eos_token": eos, "pad_token": "<pad>", **({"bos_token": bos} if bos else {})}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, additional_special_tokens=specials, **named)
    tokenizer.chat_template = template
    return tokenizer


def bigram_llama(tokenizer, successor: dict[int, int]):
    """A real ``LlamaForCausalLM`` whose greedy next token is ``successor[current token]``.

    Attention and MLP outputs are zeroed, so the residual stream is the current token's embedding, a one-hot
    vector; the LM head maps it to the successor's logit alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    size = len(tokenizer)
    config = LlamaConfig(vocab_size=size, hidden_size=size + (-size % 4), intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(size, config.hidden_size))
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for current, following in successor.items():
            model.lm_head.weight[following, current] = 1.0
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def looping_answerer(tokenizer, answer: str, question: str):
    """The bigram model that answers ``answer`` after ``question``'s prompt, then writes the end of turn and
    a new answer again: ``answer <eot> answer <eot> ...`` -- never the EOS unless it ends the turn."""
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": question}])
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    cycle = [prompt[-1], *answer_ids, end_of_turn_id(tokenizer)]
    assert len(set(cycle)) == len(cycle), cycle
    return bigram_llama(tokenizer, {cycle[i]: cycle[(i + 1) % len(cycle)] for i in range(len(cycle))})


@pytest.fixture(params=sorted(TEMPLATES))
def template(request):
    """``(tokenizer, expected end-of-turn token)``."""
    return template_tokenizer(request.param), TEMPLATES[request.param][4]


def test_end_of_turn_is_the_token_after_the_answer(template):
    tokenizer, expected = template
    assert tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer)) == expected
    stops = stop_token_ids(tokenizer)
    assert tokenizer.convert_tokens_to_ids(expected) in stops and tokenizer.eos_token_id in stops


def test_stop_ids_keep_the_models_generation_config_ids(template):
    """Llama 3 Instruct's generation_config lists <|eot_id|> beside <|end_of_text|>: passing only the
    tokenizer's EOS to generate would drop it."""
    tokenizer, _ = template
    model = bigram_llama(tokenizer, {})
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 7]
    assert 7 in stop_token_ids(tokenizer, model)


def test_labels_are_the_answer_and_the_end_of_turn_not_the_separator(template):
    """Both turns' targets: each answer and its end-of-turn token; never the newline the template writes
    after it (ChatML, Gemma, Phi-3), nor Phi-3's closing EOS."""
    tokenizer, turn_end = template
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "yes"}]
    split = encode_examples(tokenizer, [Example(messages=messages)], max_length=512)
    labels = [label for label in split.examples[0]["labels"] if label != IGNORE_INDEX]
    trained = tokenizer.decode(labels, skip_special_tokens=False)
    assert trained == f"ok{turn_end}yes{turn_end}"


def test_exact_match_stops_at_the_end_of_turn(template):
    """The model answers ``ok``, ends the turn, and would go on writing turns: scored as exactly ``ok``."""
    tokenizer, _ = template
    model = looping_answerer(tokenizer, "ok", "hi")
    examples = [Example(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])]
    result = exact_match(model, tokenizer, examples, max_new_tokens=12)
    assert result["exact_match"] == 1.0, result["samples"]
    assert complete(model, tokenizer, "hi", max_new_tokens=12) == "ok"


def test_gemma_end_of_turn_is_not_eos_and_is_stopped_at():
    """The issue's case: Gemma ends turns with <end_of_turn> (not its EOS <eos>). Stopping only at the
    tokenizer's EOS (the code before) scored this model's right answers 0%: 'ok\\nok\\nok...'."""
    gemma = template_tokenizer("gemma")
    model = looping_answerer(gemma, "ok", "hi")
    assert end_of_turn_id(gemma) != gemma.eos_token_id
    examples = [Example(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])] * 3
    result = exact_match(model, gemma, examples, max_new_tokens=12)
    assert result["exact_match"] == 1.0, result["samples"]


def test_without_a_chat_template_only_the_eos_stops():
    tokenizer = template_tokenizer("chatml")
    tokenizer.chat_template = None
    assert end_of_turn_id(tokenizer) is None and stop_token_ids(tokenizer) == [tokenizer.eos_token_id]
