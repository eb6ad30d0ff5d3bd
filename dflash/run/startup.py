"""Where the seconds to the first step go: each phase of a process's start, for the log.

A warm launch at Qwen3-8B shapes reached step 1 about 35 s after it started, 20 s of
them before the first log line; one line per process now names every phase, so a
slow start says where it was slow.
"""

from __future__ import annotations

import time

import dflash


class StartupPhases:
    """Phases marked in the order they end, each timed from the end of the one before
    (the first from the import of :mod:`dflash`)."""

    def __init__(self, began: float):
        self.last = began
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases.append((phase, now - self.last))
        self.last = now

    def report(self) -> str:
        total = sum(s for _, s in self.phases)
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.phases)
        return f"start-up, {total:.1f} s to the end of the first step: {parts}"


phases = StartupPhases(dflash.STARTED)
