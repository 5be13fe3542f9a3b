"""Planning the batch before and during training: the global batch and the LR horizon in true optimizer updates,
batch-size ramp-up (fixed and measured), and which engine can change the window from update to update.

``schedule.py`` (data plan -> updates -> LR scheduler horizon; global-batch planning), ``rampup.py`` (Megatron's
ramp-up planned in windows), ``auto_ramp.py`` (``rampup_batch_size='auto'`` from the measured noise scale),
``planned_windows.py`` (the refusal shared by AccumTrainer and the recipe).
"""
