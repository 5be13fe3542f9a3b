"""What a micro-batch's loss is, as a token- (or sequence-, or pair-) summed ``(sum, count)``: the pieces both
front-ends call before the one normalization (:mod:`hf_accum.accumulation`).

``token_loss.py`` (token-summed losses from logits), ``model_loss.py`` (the model's own loss: its target layout, extra
terms, the probe), ``micro_batch.py`` (the forward and the summed loss per micro-batch), ``sequence_norm.py``
(per-sequence normalization), ``preference.py`` (DPO and its pairwise variants per pair).
"""
