"""The schedule as a pure function: every send has one receive, and no order deadlocks."""

import itertools

import pytest

from dflash.distributed.topology import (
    Topology,
    TopologyError,
    auto_target_ranks,
    nearest_allowed_split,
)


def topo(t, d, a, rank=0, micro=1):
    return Topology(world_size=t + d, rank=rank, num_targets=t, micro_batch_size=micro, batch_size=a * d * micro)


CASES = [(t, d, a) for t, d, a in itertools.product((1, 2, 3, 5), (1, 2, 3, 7), (1, 2, 4))]


@pytest.mark.parametrize("t,d,a", CASES)
def test_every_send_has_exactly_one_receive(t, d, a):
    tp = topo(t, d, a)
    first, last = 2 * (tp.accumulation * tp.num_drafters), 7 * (tp.accumulation * tp.num_drafters)
    sent = sorted(m for target in range(t) for m in tp.produced_by(target, first, last))
    received = sorted(m for drafter in tp.drafter_ranks for m in tp.consumed_by(drafter, first, last))
    assert sent == received == list(range(first, last))
    for drafter in tp.drafter_ranks:
        per_step = [m // (tp.accumulation * tp.num_drafters) for m in tp.consumed_by(drafter, first, last)]
        assert all(per_step.count(s) == a for s in set(per_step)), "each drafter runs A micro-batches per step"


def simulate(tp: Topology, steps: int, in_flight: int) -> None:
    """Targets send in order with at most ``in_flight`` unreceived sends; drafters receive
    in order and all-reduce after every step. Raises on a state where nobody can move."""
    last = steps * (tp.accumulation * tp.num_drafters)
    todo_send = {t: tp.produced_by(t, 0, last) for t in range(tp.num_targets)}
    todo_recv = {d: tp.consumed_by(d, 0, last) for d in tp.drafter_ranks}
    queues = {(t, d): [] for t in range(tp.num_targets) for d in tp.drafter_ranks}
    outstanding = {t: 0 for t in range(tp.num_targets)}
    done_steps = {d: 0 for d in tp.drafter_ranks}
    while any(todo_send.values()) or any(todo_recv.values()):
        moved = False
        for t, todo in todo_send.items():
            if todo and outstanding[t] < in_flight:
                m = todo.pop(0)
                queues[(t, tp.consumer(m))].append(m)
                outstanding[t] += 1
                moved = True
        for d, todo in todo_recv.items():
            if not todo:
                continue
            m = todo[0]
            step = m // (tp.accumulation * tp.num_drafters)
            queue = queues[(tp.producer(m), d)]
            if min(done_steps.values()) >= step and queue:
                assert queue[0] == m, "messages on a pair arrive in the order the drafter needs them"
                queue.pop(0)
                todo.pop(0)
                outstanding[tp.producer(m)] -= 1
                if not todo or todo[0] // (tp.accumulation * tp.num_drafters) != step:
                    done_steps[d] = step + 1
                moved = True
        if not moved:
            raise AssertionError(f"deadlock: {todo_send} {todo_recv} {queues}")


@pytest.mark.parametrize("t,d,a", CASES)
@pytest.mark.parametrize("in_flight", [1, 2])
def test_schedule_cannot_deadlock(t, d, a, in_flight):
    simulate(topo(t, d, a), steps=4, in_flight=in_flight)


def test_invalid_splits_fail_with_advice():
    with pytest.raises(TopologyError, match="at least one target and one drafter"):
        Topology(world_size=2, rank=0, num_targets=2, micro_batch_size=1, batch_size=2)
    with pytest.raises(TopologyError, match="multiple of train.micro_batch_size x drafter ranks"):
        Topology(world_size=4, rank=0, num_targets=1, micro_batch_size=2, batch_size=8)


def test_auto_split_is_at_least_one_of_each():
    assert auto_target_ranks(2, 8e9, 1e9, 512, 3072) == 1
    assert 1 <= auto_target_ranks(8, 8e9, 1.7e9, 512, 3072) <= 7
    assert auto_target_ranks(8, 70e9, 1e8, 16, 4096) == 7


def test_the_split_moves_to_the_nearest_one_the_batch_divides_over():
    assert nearest_allowed_split(3, 8, 1, 30) == 3  # 5 drafters take 30
    assert nearest_allowed_split(3, 8, 1, 32) == 4  # 5 do not, 4 do (6 do not either)
    assert nearest_allowed_split(10, 16, 1, 32) == 8  # 8 and 12 both 2 away: the fewer targets
    assert nearest_allowed_split(4, 9, 1, 6, tensor_parallel=2) == 6  # 3 (6 drafters) is no whole groups of 2
    assert nearest_allowed_split(2, 4, 2, 7) == 2  # none divides: kept, for Topology to name the key
