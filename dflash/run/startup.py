"""Where the seconds to the first step go: each phase of a process's start, for the log.

A warm launch at Qwen3-8B shapes reached step 1 about 35 s after it started, 20 s of
them before the first log line; one line per process now names every phase, so a
slow start says where it was slow.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import torch

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
        line = f"start-up, {total:.1f} s to the end of the first step: {parts}"
        if imported_from_source():
            line += ("; every import was compiled from source (PYTHONDONTWRITEBYTECODE is set and no bytecode is "
                     "cached): unset it, or run `python -m compileall -q` over the environment once, and imports "
                     "take less than half as long")
        return line


def imported_from_source() -> bool:
    """Whether Python compiles every module it imports from source, at every start: it may
    not write bytecode (``PYTHONDONTWRITEBYTECODE``, which container images often set) and
    none is cached for torch. Importing :mod:`dflash.train` then took 12.5-13 s on a
    2-core machine against 5-6 s with bytecode, and 13-17 s on the H200 machines."""
    return sys.dont_write_bytecode and not os.path.exists(importlib.util.cache_from_source(torch.__file__))


phases = StartupPhases(dflash.STARTED)
