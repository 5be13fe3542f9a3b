"""One ``hf-accum plan --auto`` probe, in its own process: build the recipe's model, run one measured training
step at a given micro-batch, print the result as one JSON line.

Run by :mod:`hf_accum.recipe.plan_auto` as ``python -m hf_accum.recipe.plan_probe '<json spec>'`` so that the
planner itself never holds a model: the parent watches this process's memory and stops it before the two
together cross ``--memory-budget``. Spec keys: ``argv`` (the recipe's ``--config``/overrides argv),
``micro_batch``, ``max_length``, ``device``, ``precision``.
"""

from __future__ import annotations

import json
import resource
import sys

import torch

from hf_accum.memory import training_step_peak


def probe(spec: dict) -> dict:
    from hf_accum.recipe import config as recipe_config
    from hf_accum.recipe import modeling

    path, overrides = recipe_config.parse_overrides(spec["argv"])
    config = recipe_config.load_config(path, overrides)
    tokenizer = modeling.load_tokenizer(config.model.name_or_path, config.model.chat_template,
                                        config.model.trust_remote_code)
    device = torch.device(spec["device"])
    model = modeling.build_model(config, tokenizer, seed=0).to(device)
    tensor_peak = training_step_peak(model, device, spec["micro_batch"], spec["max_length"], spec["precision"])
    # ru_maxrss is KiB on Linux: the whole process, libraries and allocator caches included.
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tensor_peak": tensor_peak, "rss_peak": rss_peak}


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))), flush=True)
