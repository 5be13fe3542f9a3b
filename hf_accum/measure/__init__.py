"""Measuring a run and its hardware: peak FLOP/s and MFU, peak memory and the micro-batch a budget allows, and the
gradient noise scale.

``peak_flops.py`` (a device's peak for a dtype, cached per machine), ``utilization.py`` (model FLOPs per update, MFU),
``peak_memory.py`` (a run's peak memory as reported), ``memory.py`` (peak tensor memory measured; the micro-batch a
budget allows), ``noise_scale.py`` (the gradient noise scale's arithmetic), ``noise_probe.py`` (its norms measured
inside a run).
"""
