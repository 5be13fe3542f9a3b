"""Batch-size ramp-up plans: Megatron's formula, epochs, max_steps, and the refusals."""

import pytest

from hf_accum.errors import InputError
from hf_accum.planning.rampup import RampUp, RampUpError, describe_stages, plan_windows, total_updates


def megatron_global_batch(consumed: int, start: int, increment: int, samples: int, global_batch: int) -> int:
    """An independent transcription of Megatron-LM's RampupBatchsizeNumMicroBatches.update."""
    num_increments = (global_batch - start) // increment
    per_increment = samples / num_increments
    if consumed > samples:
        return global_batch
    return start + int(consumed / per_increment) * increment


def sequences_per_update(plan, per_round):
    return [window * per_round for epoch in plan for window in epoch]


def test_every_update_takes_megatrons_batch_for_the_samples_consumed_before_it():
    ramp = RampUp.from_list([8, 8, 800], global_batch_size=32, micro_batch_size=8)
    plan = plan_windows(micro_batches_per_epoch=10_000, ramp=ramp, max_steps=120)
    consumed = 0
    for sequences in sequences_per_update(plan, ramp.per_round):
        assert sequences == megatron_global_batch(consumed, 8, 8, 800, 32)
        consumed += sequences
    assert sorted(set(sequences_per_update(plan, ramp.per_round))) == [8, 16, 24, 32]
    assert total_updates(plan) == 120


def test_two_processes_ramp_the_global_batch_not_the_per_rank_one():
    ramp = RampUp.from_list([16, 16, 200], global_batch_size=64, micro_batch_size=4, num_processes=2)
    plan = plan_windows(micro_batches_per_epoch=5_000, ramp=ramp, max_steps=40)
    consumed = 0
    for window in (w for epoch in plan for w in epoch):
        assert window * 8 == megatron_global_batch(consumed, 16, 16, 200, 64)  # K per rank x micro x 2 ranks
        consumed += window * 8


def test_an_epochs_last_window_is_short_and_the_ramp_continues_into_the_next_epoch():
    ramp = RampUp.from_list([8, 8, 800], global_batch_size=32, micro_batch_size=8)
    plan = plan_windows(micro_batches_per_epoch=50, ramp=ramp, num_epochs=3)
    assert len(plan) == 3 and all(sum(epoch) == 50 for epoch in plan)
    consumed = 0
    for epoch in plan:
        for index, window in enumerate(epoch):
            wanted = megatron_global_batch(consumed, 8, 8, 800, 32) // 8
            assert window == wanted or (index == len(epoch) - 1 and window < wanted)
            consumed += window * 8
    assert plan[-1][0] == 4  # the ramp ended during epoch 2: full global batches


def test_a_fractional_epoch_keeps_its_share_of_the_updates():
    ramp = RampUp.from_list([8, 8, 80], global_batch_size=32, micro_batch_size=8)
    whole = plan_windows(micro_batches_per_epoch=40, ramp=ramp, num_epochs=2)
    half = plan_windows(micro_batches_per_epoch=40, ramp=ramp, num_epochs=1.5)
    assert half[0] == whole[0] and len(half[1]) == -(-len(whole[1]) // 2)


@pytest.mark.parametrize("values,micro,processes,fragment", [
    ([6, 8, 800], 8, 1, "nearest valid start: 8"),
    ([8, 12, 800], 4, 2, "nearest valid increment: 8 or 16"),
    ([8, 16, 800], 8, 1, "not a multiple of increment 16"),
    ([32, 8, 800], 8, 1, "start must be below"),
    ([8, 8], 8, 1, "three integers"),
    ([8, 8, 0], 8, 1, ">= 1"),
])
def test_ramps_that_cannot_run_are_refused_with_the_nearest_valid_values(values, micro, processes, fragment):
    with pytest.raises(RampUpError, match=fragment) as raised:
        RampUp.from_list(values, global_batch_size=32, micro_batch_size=micro, num_processes=processes)
    assert isinstance(raised.value, InputError)


def test_the_stages_line_counts_updates_per_batch_size():
    ramp = RampUp.from_list([8, 8, 800], global_batch_size=32, micro_batch_size=8)
    line = describe_stages(plan_windows(10_000, ramp, max_steps=100), ramp)
    assert line.startswith("batch ramp-up [8, 8, 800]: 8 seqs x 34 updates -> 16 seqs x 17 updates")
    assert "32 seqs x" in line
