"""The schedulers alone (no tensors): admission, bucket fairness, memory cap, static batches."""

from __future__ import annotations

import pytest
from omnirl_plugin_diffusers.scheduler import Slot, StaticScheduler, StepScheduler

from omnirl_core.contracts import GenRequest, RolloutPlan


def slot(uid: int, key: str, steps: int = 4, arrival: float = 0.0, nbytes: int = 100) -> Slot:
    plan = RolloutPlan(step_kinds=("ode",) * steps, train_steps=())
    request = GenRequest(uid=uid, prompt="p", prompt_index=0, group=0, seed=uid, height=32, width=32, plan=plan)
    return Slot(request=request, key=key, nbytes=nbytes, num_steps=steps, arrival=arrival)


def drive(scheduler, slots, now=0.0, max_iters=1000):
    """Run the scheduler as the engine does; returns (batches as (key, uids), finish order of uids)."""
    for s in slots:
        scheduler.add(s)
    batches, finished = [], []
    for _ in range(max_iters):
        if scheduler.idle:
            return batches, finished
        scheduler.admit(now)
        batch = scheduler.next_batch()
        assert batch is not None, "nothing to run although requests have arrived"
        for s in batch.rows:
            s.step += 1
        batches.append((batch.key, [s.request.uid for s in batch.rows], len(batch.padding)))
        finished += [s.request.uid for s in scheduler.finish(batch)]
    raise AssertionError("scheduler did not drain")


def test_step_admission_skips_full_buckets_without_blocking_others():
    sched = StepScheduler(max_num_seqs=2)
    for s in [slot(0, "a"), slot(1, "a"), slot(2, "a"), slot(3, "b"), slot(4, "a", arrival=5.0)]:
        sched.add(s)
    admitted = sched.admit(now=0.0)
    # the third 'a' waits for a free 'a' slot, the 'b' behind it is not held up; uid 4 has not arrived
    assert [s.request.uid for s in admitted] == [0, 1, 3]
    assert [s.request.uid for s in sched.waiting] == [2, 4]
    assert sched.next_arrival(0.0) == 5.0


def test_step_round_robin_serves_a_lone_shape_alongside_a_crowded_one():
    batches, finished = drive(StepScheduler(max_num_seqs=2),
                              [slot(i, "big") for i in range(8)] + [slot(100, "small")])
    keys = [k for k, _, _ in batches]
    # buckets alternate while both are active: the lone request is never stalled behind the crowd
    assert keys[:8] == ["big", "small"] * 4
    assert finished.index(100) < finished.index(2)
    # every row is useful, and each call of the crowded bucket is full
    assert all(pad == 0 for _, _, pad in batches)
    assert all(len(uids) == 2 for k, uids, _ in batches if k == "big")


def test_step_freed_slots_are_refilled_at_once():
    slots = [slot(0, "a", steps=2), slot(1, "a", steps=5), slot(2, "a", steps=3)]
    batches, finished = drive(StepScheduler(max_num_seqs=2), slots)
    assert [uids for _, uids, _ in batches] == [[0, 1], [0, 1], [1, 2], [1, 2], [1, 2]]
    assert finished == [0, 1, 2]


def test_step_finished_requests_stream_out_of_order():
    _, finished = drive(StepScheduler(max_num_seqs=4), [slot(0, "a", 6), slot(1, "a", 2), slot(2, "b", 4)])
    assert finished == [1, 2, 0]


def test_memory_cap_limits_requests_in_flight_first_come_first_served():
    sched = StepScheduler(max_num_seqs=8, max_latent_bytes=250)
    for s in [slot(0, "a"), slot(1, "b", nbytes=200), slot(2, "a")]:
        sched.add(s)
    # uid 1 does not fit next to uid 0; uid 2 would fit but must not overtake it
    assert [s.request.uid for s in sched.admit(0.0)] == [0]
    with pytest.raises(ValueError, match="more than the 250"):
        sched.add(slot(9, "a", nbytes=251))


def test_static_batches_pad_short_requests_and_return_together():
    batches, finished = drive(StaticScheduler(max_num_seqs=3),
                              [slot(0, "a", 2), slot(1, "b", 1), slot(2, "a", 4), slot(3, "a", 1)])
    # the head request picks the bucket; the 'b' request waits for the whole 'a' batch (head-of-line)
    assert batches[0][0] == "a" and batches[-1][0] == "b"
    assert [pad for _, _, pad in batches[:4]] == [0, 1, 2, 2]
    assert finished == [0, 2, 3, 1]


def test_single_mode_is_a_static_batch_of_one():
    batches, finished = drive(StaticScheduler(max_num_seqs=1), [slot(0, "a", 2), slot(1, "a", 1)])
    assert [uids for _, uids, _ in batches] == [[0], [0], [1]]
    assert finished == [0, 1]
