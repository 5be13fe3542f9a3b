"""The recipe kit: what ``recipes/finetune_llama.py`` needs around the library.

* :mod:`~hf_accum.recipe.config` -- the typed config (layers, coercion, validation hooks, the saved copy);
* :mod:`~hf_accum.recipe.data` -- the user's rows: reading, formats, splits, encoding, the exact-match metric;
* :mod:`~hf_accum.recipe.modeling` -- loading the model and tokenizer, LoRA/QLoRA, checkpointing;
* :mod:`~hf_accum.recipe.outputs` -- the output directory, per-update records, the final files, the process edge.

The library (``hf_accum`` outside this package) never imports from here: the kit is one way to
drive the library, and a user's own script can replace it.
"""
