"""The fused loss head: a causal LM's token losses and log-probabilities from its last hidden states and its
output layer, in chunks, without the ``[tokens, vocab]`` logits.

``loss.py`` (the fused linear cross-entropy, ``linear_cross_entropy_sum``), ``gradients.py`` (its chunk buffers,
softmax and gradient sums), ``head.py`` (which output layers it can take, proven on the model, and running a model
with its head replaced), ``logprobs.py`` (per-token log-probs and entropies for the preference and RL losses).
"""
