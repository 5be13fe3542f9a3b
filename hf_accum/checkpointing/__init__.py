"""Checkpoints for exact resumption, for both front-ends.

``checkpoint.py`` (what a checkpoint holds, atomic writes, the latest complete one), ``loop_checkpoint.py`` (the
loop engine's checkpointer and random state), ``fsdp_checkpoint.py`` (an FSDP2 model's sharded state),
``manifest.py`` (each checkpoint's manifest and its verification), ``run_lock.py`` (one run per output directory).
"""
