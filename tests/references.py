"""Independent references for the tests: what the big-batch run would do, written out plainly."""

from __future__ import annotations

import torch
from transformers import get_scheduler


def big_batch_learning_rates(lr: float, total_updates: int, warmup: int = 0, name: str = "linear") -> list[float]:
    """LR applied at updates 1..total of a big-batch run (one update per big batch): a transformers
    scheduler over exactly that many updates, stepped once per update."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_updates)
    rates = []
    for _ in range(total_updates):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates
