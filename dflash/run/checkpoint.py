"""Checkpoints with torch.distributed.checkpoint: drafter, optimizer, scheduler, step.

Training is a pure function of (seed, step): the data order comes from the
seeded schedule and anchors from per-sample generators, so this state is all
that exact resume needs. Each checkpoint is written under a temporary name and
renamed when complete; a crash mid-save leaves the previous one intact.
"""

from __future__ import annotations

import logging
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dflash.files import publish, staging_dir

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")


SINGLE_PROCESS_WARNING = ".*torch.distributed is disabled.*"  # DCP's note on colocated runs


def checkpoints(root: Path) -> list[Path]:
    found = [p for p in root.glob("step_*") if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    keep: int,
    group=None,
) -> Path:
    """Every drafter rank calls this with the drafter ``group`` (replicated state is
    written once); the first rank of the group renames and prunes."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": step}
    final = root / f"step_{step:08d}"
    tmp = staging_dir(final)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        dcp.save(state, checkpoint_id=str(tmp), process_group=group)
    if group is None or dist.get_rank(group) == 0:
        publish(tmp, final)
        for old in checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        log.info("saved checkpoint %s", final)
    if group is not None:
        # NCCL groups are created lazily without a bound device (dflash.distributed.protocol): name it
        devices = [torch.cuda.current_device()] if dist.get_backend(group) == "nccl" else None
        dist.barrier(group=group, device_ids=devices)
    return final


class UnreadableCheckpoint(RuntimeError):
    """A checkpoint directory that DCP cannot load (incomplete, truncated, or not one)."""


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    group=None,
) -> int:
    """Restore in place; returns the step the checkpoint was taken after."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": 0}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        try:
            dcp.load(state, checkpoint_id=str(path), process_group=group)
        except CheckpointException as e:  # a BaseException: would pass through `except Exception`
            reasons = {str(f).strip().splitlines()[-1] for f in e.failures.values()}
            raise UnreadableCheckpoint(f"{path}: {'; '.join(sorted(reasons))}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


def resume_candidates(resume: str, root: Path) -> list[Path]:
    """Checkpoints to try, in order: ``auto``: every one under ``root``, newest first
    (an unreadable one falls back to the one before); ``never``: none; or one path."""
    if resume == "never":
        return []
    if resume == "auto":
        return checkpoints(root)[::-1] if root.is_dir() else []
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"resume={resume!r} is not a checkpoint directory")
    return [path]
