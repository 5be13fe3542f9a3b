"""Evaluation during training in the loop: the exact per-token held-out loss, at the updates asked for."""

from __future__ import annotations

import torch

from hf_accum import LoopConfig, train
from hf_accum.batching import PaddingCollator
from hf_accum.testing import PAD, fresh_accelerator, independent_mean_loss, random_rows, tiny_causal_lm


def test_held_out_loss_is_the_exact_per_token_mean_at_the_asked_updates():
    train_rows = random_rows(24, seed=3, prompt_masking=True)
    held_out = random_rows(11, seed=4, prompt_masking=True, max_len=40)  # uneven batches of 4, 4, 3
    accelerator = fresh_accelerator(2)
    model = tiny_causal_lm()
    collator = PaddingCollator(PAD)
    loader = torch.utils.data.DataLoader(train_rows, batch_size=2, collate_fn=collator)
    eval_loader = torch.utils.data.DataLoader(held_out, batch_size=4, collate_fn=collator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen = {}

    def on_update(update):
        if update.eval_loss is not None:  # the weights right after this update are the evaluated ones
            seen[update.step] = (update.eval_loss, independent_mean_loss(model, held_out))

    config = LoopConfig(max_steps=5, eval_strategy="steps", eval_steps=2, disable_tqdm=True)
    result = train(model, optimizer, loader, accelerator, config, on_update=on_update, eval_dataloader=eval_loader)
    assert sorted(seen) == [2, 4, 5]  # every 2 updates, and after the last
    assert [u.step for u in result.updates if u.eval_loss is not None] == [2, 4, 5]
    for ours, reference in seen.values():
        assert abs(ours - reference) <= 1e-12 * abs(reference)
    # A mean of per-batch means would differ (uneven batches): the check above can fail.
    assert model.training


def test_eval_strategy_without_a_dataloader_is_refused():
    accelerator = fresh_accelerator(1)
    model = tiny_causal_lm()
    loader = torch.utils.data.DataLoader(random_rows(4), batch_size=2, collate_fn=PaddingCollator(PAD))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = LoopConfig(max_steps=1, eval_strategy="steps", eval_steps=1, disable_tqdm=True)
    try:
        train(model, optimizer, loader, accelerator, config)
    except ValueError as error:
        assert "eval_dataloader" in str(error)
    else:
        raise AssertionError("eval_strategy without eval_dataloader must be refused")
