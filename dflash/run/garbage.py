"""Python's cyclic garbage collector, run at step boundaries instead of at random.

Left alone, Python collects whenever its allocation counters cross a threshold, and a
full (generation 2) collection walks every live object: millions once Dynamo and
Inductor have loaded and compiled. Measured: a cold start on the H200 spent about 8 s
in 15 full collections of 0.2-0.9 s while compiling; on 2 CPU cores the four that fell
after the imports of a 12-14 s start took 1.3 s, each slower than the one before. In a
step, one rank's pause holds every other rank at the next collective. So while training,
automatic collection is off; once the warmup is over, everything alive is collected once
and frozen (never walked again: the models, the compiled graphs, the modules), and a
full collection of what came after runs every ``train.gc_every`` steps, between steps.
``train.gc_every=0`` leaves Python's collector as it is.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_every = 0  # train.gc_every of the run in progress; 0 outside one


@contextmanager
def collected_between_steps(every: int) -> Iterator[None]:
    """Automatic collection off for the run (with ``every`` > 0); on the way out, the
    collector is as it was and nothing stays frozen."""
    global _every
    if every < 0:
        raise ValueError(f"train.gc_every must be >= 0 (0: Python's automatic collection), got {every}")
    if not every:
        yield
        return
    enabled, _every = gc.isenabled(), every
    gc.disable()
    try:
        yield
    finally:
        _every = 0
        gc.unfreeze()
        if enabled:
            gc.enable()


def settle() -> None:
    """After the compile warmup: collect once and freeze what is alive."""
    if _every:
        gc.collect()
        gc.freeze()


class StepCollector:
    """Collects when a rank reaches the start of every ``gc_every``-th step after
    ``start`` (the step training begins at, which :func:`settle` has just collected
    for); a target rank reaches a step once per micro-batch it produces, so a step
    collects once."""

    def __init__(self, start: int):
        self.last = start

    def before(self, step: int) -> None:
        if _every and step % _every == 0 and step != self.last:
            self.last = step
            gc.collect()
