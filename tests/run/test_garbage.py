"""The garbage collector's timing: off for a run, once after warmup, then between steps."""

import gc
import weakref

import pytest
from runs import run_colocated

from dflash.run import garbage


class Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture
def collections():
    """Generation-2 collections from now on, one entry each as they run: ``True`` for
    one inside a run (:func:`garbage.collected_between_steps`)."""
    seen: list[bool] = []

    def count(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            seen.append(bool(garbage._every))

    gc.callbacks.append(count)
    yield seen
    gc.callbacks.remove(count)


def test_a_run_turns_automatic_collection_off_and_restores_it(collections):
    assert gc.isenabled()
    with garbage.collected_between_steps(5):
        assert not gc.isenabled()
        before = len(collections)
        garbage.settle()
        assert gc.get_freeze_count() > 0 and len(collections) == before + 1
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_cycles_are_collected_at_every_nth_step_once(collections):
    collector = garbage.StepCollector(0)
    with garbage.collected_between_steps(3):
        garbage.settle()
        before = len(collections)
        ref = weakref.ref(Cycle())
        for step in (0, 1, 2):  # step 0 is where training begins, just after the settle
            collector.before(step)
        assert ref() is not None and len(collections) == before, "collected before its step"
        collector.before(3)
        collector.before(3)  # a target rank's second micro-batch of step 3
        assert ref() is None and len(collections) == before + 1


def test_zero_leaves_python_in_charge():
    with garbage.collected_between_steps(0):
        assert gc.isenabled()
        garbage.settle()
        assert gc.get_freeze_count() == 0


def test_outside_a_run_nothing_is_frozen_or_collected():
    garbage.settle()
    assert gc.get_freeze_count() == 0


def test_a_negative_interval_is_refused():
    with pytest.raises(ValueError, match="train.gc_every"):
        with garbage.collected_between_steps(-1):
            pass


def test_a_run_collects_after_its_warmup_and_before_every_nth_step(tmp_path, collections):
    """In one process: once when the warmup ends, then before steps 2 and 4 of 4; Python's
    automatic collection is back afterwards."""
    run_colocated(tmp_path, ["train.max_steps=4", "train.gc_every=2"])
    assert collections.count(True) == 3
    assert gc.isenabled() and gc.get_freeze_count() == 0
