"""A per-process deadline on every cross-rank wait, so no rank hangs silently.

torch bounds most waits itself (store and gloo timeouts raise, the NCCL
watchdog aborts a timed-out collective), but not all: a communicator that is
being created, a split that some ranks never join, or a CUDA sync behind a
receive that never completes can block forever, and when it does the message
names neither the phase nor the ranks involved. Every wait in dflash therefore
runs inside :meth:`Watchdog.phase`, which states what the rank is doing and
which ranks it waits for. If the phase outlives its deadline, the watchdog logs
that, dumps every thread's stack and ends the process with
:data:`EXIT_CODE`; torchrun (or the test harness) then ends the other ranks.

The watchdog thread only reads a deadline: it does no model or collective
work. A second, C-level timer (``faulthandler.dump_traceback_later``) fires
shortly after, for the case where a native call holds the GIL and the Python
thread cannot run.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

EXIT_CODE = 75  # distinct from Python's 1, so a timeout is recognisable in torchrun's summary
# torch's own timeouts raise an exception with a traceback, which is better than ending the
# process, so the watchdog fires this long after a phase's bound; the C-level backstop later still.
GRACE_S = 5.0
HARD_GRACE_S = 30.0


@dataclass(frozen=True)
class Phase:
    what: str
    peers: tuple[int, ...]
    timeout_s: float
    deadline: float


def describe(rank: int, what: str, timeout_s: float, peers: Iterable[int]) -> str:
    """The one format of a timeout message: rank, phase, bound, the ranks waited for."""
    peers = sorted(peers)
    waited = f"; waiting for rank{'s' if len(peers) != 1 else ''} {', '.join(map(str, peers))}" if peers else ""
    return f"rank {rank}: {what} did not complete within {timeout_s:g} s{waited}"


class Watchdog:
    """Deadlines for the phases of one rank; at most one phase is open at a time."""

    def __init__(self, rank: int):
        self.rank = rank
        self._phase: Phase | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._watch, name="dflash-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def phase(self, what: str, timeout_s: float, peers: Iterable[int] = ()) -> Iterator[None]:
        """Bound the enclosed wait by ``timeout_s``; nested phases restore the outer one
        with a fresh deadline."""
        outer = self._phase
        self._set(what, tuple(peers), timeout_s)
        try:
            yield
        finally:
            if outer is None:
                self._clear()
            else:
                self._set(outer.what, outer.peers, outer.timeout_s)

    def _set(self, what: str, peers: tuple[int, ...], timeout_s: float) -> None:
        with self._changed:
            self._phase = Phase(what, peers, timeout_s, time.monotonic() + timeout_s + GRACE_S)
            self._changed.notify()
        faulthandler.dump_traceback_later(timeout_s + GRACE_S + HARD_GRACE_S, exit=True)

    def _clear(self) -> None:
        with self._changed:
            self._phase = None
            self._changed.notify()
        faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        with self._changed:
            while True:
                phase = self._phase
                if phase is None:
                    self._changed.wait()
                    continue
                left = phase.deadline - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
                self._expire(phase)

    def _expire(self, phase: Phase) -> None:
        # stderr, not logging: Hydra may route the log to a file only, and this is the last word
        print(describe(self.rank, phase.what, phase.timeout_s, phase.peers), file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(EXIT_CODE)
