"""The recipe kit: what ``recipes/finetune_llama.py`` needs around the library.

* :mod:`~hf_accum.recipe.config` -- the typed config: sections, schema (one section registry), layers with
  sources; it imports none of the modules below and no torch (they import it);
* :mod:`~hf_accum.recipe.checks` -- one validation pass before anything loads (each section's own check lives with
  the module that owns it; the engine and objective names are the recipe's tables, passed in);
* :mod:`~hf_accum.recipe.preflight` -- the run's objects built from the config on toy inputs, before loading;
* :mod:`~hf_accum.recipe.data` -- the user's rows: reading, formats, splits, encoding, the exact-match metric;
* :mod:`~hf_accum.recipe.modeling` -- loading the model and tokenizer, LoRA/QLoRA, checkpointing;
* :mod:`~hf_accum.recipe.embedded` -- the embedded default: synthetic tasks, tiny tokenizer and Llama,
  the CPU default config (``cpu_default.yaml``);
* :mod:`~hf_accum.recipe.launch` -- launch policy: what was asked vs what would run, DeepSpeed configs;
* :mod:`~hf_accum.recipe.outputs` -- the output directory, per-update records, the final files, the process edge.

The library (``hf_accum`` outside this package) never imports from here (``tests/unit/test_layout.py``):
the kit is one way to drive the library, and a user's own script can replace it. Every error the kit
raises for bad input derives from :class:`hf_accum.errors.InputError`.
"""
