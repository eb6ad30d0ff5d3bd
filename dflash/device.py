"""The device a process computes on: which one, in which dtype, waiting for it, its peak memory.

Shared by training, evaluation, regeneration and the benchmarks, so that every
command picks its GPU by ``LOCAL_RANK`` the same way.
"""

from __future__ import annotations

import os

import torch


def pick_device() -> tuple[torch.device, torch.dtype]:
    """CUDA in bf16 when present (each rank sees its GPU as ``cuda:0`` or by
    LOCAL_RANK), else the CPU in fp32."""
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index), torch.bfloat16
    return torch.device("cpu"), torch.float32


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queue: timings read the host clock, and CUDA returns before the work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device) -> float | None:
    """The most memory the CUDA allocator held on ``device`` so far; ``None`` on the CPU."""
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
