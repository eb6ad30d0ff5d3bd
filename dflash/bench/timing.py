"""How the bench modes time and profile a call, and the job they share."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from dflash.compile import (
    compile_counts,
)
from dflash.device import synchronize
from dflash.model.target import RANDOM
from dflash.run.build import (
    Job,
    build_job,
)
from dflash.run.config import compose_config


def bench_job(overrides: list[str]) -> Job:
    """The job of these overrides with random weights either way: at the preset's
    ``shape``, or at the shipped model's config.json."""
    cfg = compose_config(overrides)
    if cfg.target.get("shape"):
        cfg.target.path = RANDOM
    return build_job(cfg)


def timed(fn: Callable[[], None], steps: int, device: torch.device) -> float:
    """Seconds per call, over ``steps`` calls after the caller's warmup."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def timed_step(step: Callable[[], None], steps: int, device: torch.device) -> tuple[float, int]:
    """:func:`timed` for a training step: seconds per call, and the CUDA graphs recorded
    during the timed calls (after warmup, each is a re-recording that stalls the step)."""
    recorded = compile_counts()["cudagraph_recordings"]
    seconds = timed(step, steps, device)
    return seconds, compile_counts()["cudagraph_recordings"] - recorded


def profile_table(fn: Callable[[], None], device: torch.device, calls: int = 3) -> str:
    """Where the time of ``fn`` goes: the torch profiler's top operators by device time,
    under a line that says how much of the device's time ran kernels (the rest, gaps
    between them, is time the host or a wait left the device idle)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
    kernels = [e.time_range for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return table
    busy = sum(r.elapsed_us() for r in kernels) / 1e3
    span = (max(r.end for r in kernels) - min(r.start for r in kernels)) / 1e3
    return f"kernels ran {busy:.1f} ms of the device's {span:.1f} ms from the first to the last ({100 * busy / span:.1f}%)\n{table}"


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
