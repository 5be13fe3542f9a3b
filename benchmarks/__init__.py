"""Benchmarks of hf_accum: speed and memory of exact gradient accumulation, measured side by side.

Not part of the installed library. Run them from a checkout of the repository::

    python -m benchmarks --help        # or, with hf_accum installed editable from the checkout: hf-accum bench

One module per section (:mod:`~benchmarks.sweep`, :mod:`~benchmarks.overhead`, :mod:`~benchmarks.memory`,
:mod:`~benchmarks.padding`, :mod:`~benchmarks.loss`, :mod:`~benchmarks.vocab`, :mod:`~benchmarks.sft`,
:mod:`~benchmarks.softcap`), the options and the table of sections in :mod:`~benchmarks.options`, what they
measure with in :mod:`~benchmarks.harness`, one process per run in :mod:`~benchmarks.workers`, how they
report in :mod:`~benchmarks.report`, and the run itself in :mod:`~benchmarks.run`. ``benchmarks/README.md``
explains every number.
"""
