"""Checkpoints with torch.distributed.checkpoint: drafter, optimizer, scheduler, step.

Training is a pure function of (seed, step): the data order comes from the
seeded schedule and anchors from per-sample generators, so this state is all
that exact resume needs. Each checkpoint is written under a temporary name, with the
digests of its files written last, and renamed when complete; a crash or a failed
write leaves the previous one intact. A checkpoint is loaded only once its files
match their digests.

The drafter's state is the same on every rank of its group, so the group's first
rank alone writes it, as one process would (DCP loads it on any number of ranks).
While training, :class:`CheckpointWriter` copies the state to host memory at the
step boundary, which is all a step waits for, and a background thread writes the
copy to disk while the next steps train; the thread does file I/O only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_leaves, tree_map_only

from dflash.files import (
    DamagedFiles,
    publish,
    staging_dir,
    verify_digests,
    write_digests,
)

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")
ARCHITECTURE = "drafter.json"  # beside DCP's files: the drafter config the state belongs to
SINGLE_PROCESS_WARNING = ".*torch.distributed is disabled.*"  # DCP's note on colocated runs
PAGE = mmap.PAGESIZE


@contextmanager
def dcp_errors(error: Callable[[str], Exception]) -> Iterator[None]:
    """DCP without its note on single-process use, and its failure raised as
    ``error(the last line of each rank's error)``: a :class:`CheckpointException` is a
    BaseException, which would pass through ``except Exception``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        try:
            yield
        except CheckpointException as e:
            raise error("; ".join(sorted({str(f).strip().splitlines()[-1] for f in e.failures.values()}))) from None


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def checkpoints(root: Path) -> list[Path]:
    found = [p for p in root.glob("step_*") if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> dict:
    """What a checkpoint holds, as references to the live tensors."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": step}


def snapshot(state: dict, into: dict | None = None) -> dict:
    """``state`` copied to host memory, a copy training may run past. ``into`` holds
    buffers of the same layout (:class:`HostBuffers`) to copy into."""
    copied = _to_host(state, into)
    if any(t.is_cuda for t in tree_leaves(state) if isinstance(t, torch.Tensor)):
        torch.cuda.current_stream().synchronize()  # the copies were queued without a host wait
    return copied


class HostBuffers:
    """Host tensors in the layout of a state, carved from one allocation at page
    boundaries, those of GPU tensors page-locked so that a snapshot is one fast copy
    (12 GB in 0.24 s on the H200's host).

    The pages are locked one tensor at a time with ``cudaHostRegister``, after they
    were touched. Pinned allocations (``pin_memory=True``) hold a lock of the CUDA
    driver while their pages fault in: 12 GB took 9.5 s on the H200's host, during
    which the training thread could launch nothing, in a background thread too. Touched
    first and registered per tensor, the same 12 GB took 1.6 s, the other thread
    waiting 0.05 s of it. The caching host allocator would also round every tensor up
    to a power of two."""

    def __init__(self, state: dict):
        leaves = [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]
        sizes = [t.numel() * t.element_size() for t in leaves]
        starts, end = [], 0
        for size in sizes:
            starts.append(end)
            end += -(-size // PAGE) * PAGE
        memory = torch.empty(end + PAGE, dtype=torch.uint8)
        first = -memory.data_ptr() % PAGE  # the allocation itself is only 64-byte aligned
        spans = [memory[first + s:first + s + n] for s, n in zip(starts, sizes)]
        views = iter([span.view(t.dtype).view(t.shape) for span, t in zip(spans, leaves)])
        self.state = tree_map_only(torch.Tensor, lambda t: next(views), state)
        self.to_pin = [span for span, t in zip(spans, leaves) if t.is_cuda and span.numel()]
        self.device = next((t.device for t in leaves if t.is_cuda), None)  # the state's GPU, whose copies use the pages
        self.pinned: list[int] = []  # addresses registered with the driver

    def pin(self) -> HostBuffers:
        """Lock the pages of the GPU tensors' buffers. Called from the writer's thread, whose
        current device is not the rank's (CUDA keeps one per thread, and ``set_device`` set
        the main thread's): pages registered there would be locked for another GPU's
        context, and one process per GPU would each open a context on GPU 0."""
        if not self.to_pin:
            return self
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.device):
            for span in self.to_pin:
                span.fill_(0)  # fault the pages in here, not under the driver's lock
                error = cudart.cudaHostRegister(span.data_ptr(), span.numel(), 0)
                if error != cudart.cudaError.success:
                    log.warning("checkpoint buffers stay pageable, so each save waits for a slower copy: page-locking "
                                "%.1f GiB of host memory failed (%s; see `ulimit -l`)", span.numel() / 2**30,
                                cudart.cudaGetErrorString(error))
                    break
                self.pinned.append(span.data_ptr())
        return self

    def release(self) -> None:
        """Unlock the pages, before the memory is freed."""
        if not self.pinned:
            return
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.device):
            for address in self.pinned:
                cudart.cudaHostUnregister(address)
        self.pinned = []


def _to_host(state, into):
    """``state`` with every tensor copied to host memory, into the matching buffer of
    ``into`` where it has one of the same shape and dtype, else into a new pageable one."""
    if isinstance(state, torch.Tensor):
        fits = isinstance(into, torch.Tensor) and into.shape == state.shape and into.dtype == state.dtype
        if not fits:  # pageable: pinning costs more than one copy saves (a save before prepare())
            return state.detach().to("cpu", copy=True)
        # Queued where ``into`` is page-locked (``is_pinned`` knows only the caching host
        # allocator's blocks, not pages locked with cudaHostRegister), done before the call
        # returns where it is pageable; snapshot() waits for the stream either way.
        return into.copy_(state.detach(), non_blocking=True)
    if isinstance(state, dict):
        into = into if isinstance(into, dict) else {}
        return {k: _to_host(v, into.get(k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(state) else [None] * len(state)
        return type(state)(_to_host(v, b) for v, b in zip(state, into))
    return state


def architecture(model: torch.nn.Module) -> dict | None:
    """The drafter config as plain values, or ``None`` for a model without one."""
    config = getattr(model, "config", None)
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None


class CheckpointMismatch(ValueError):
    """A checkpoint of another drafter: same parameter names, another architecture."""


def check_architecture(path: Path, model: torch.nn.Module) -> None:
    """Refuse a checkpoint written for another drafter config. Parameters alone do not
    tell: a layer that turned from full to sliding attention keeps every weight."""
    written, mine = path / ARCHITECTURE, architecture(model)
    if mine is None or not written.is_file():
        return
    theirs = json.loads(written.read_text())
    differ = {k: (theirs.get(k), v) for k, v in json.loads(json.dumps(mine)).items() if theirs.get(k) != v}
    if differ:
        said = "; ".join(f"drafter {k}: {a} there, {b} here" for k, (a, b) in sorted(differ.items()))
        raise CheckpointMismatch(f"{path} is a checkpoint of another drafter ({said}); use the config it was "
                                 "trained with, or resume=never to start over")


def write_checkpoint(root: Path, state: dict, keep: int, drafter: dict | None = None) -> Path:
    """Write a host snapshot as ``step_<step>`` under ``root`` (temp name, then rename),
    with the ``drafter`` config it belongs to, then keep the newest ``keep``."""
    final = step_dir(root, state["step"])
    tmp = staging_dir(final)
    try:
        with dcp_errors(OSError):
            dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
        if drafter is not None:
            (tmp / ARCHITECTURE).write_text(json.dumps(drafter, indent=1, sort_keys=True))
        write_digests(tmp)
        publish(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)  # what was written of it takes the disk the next save needs
        raise OSError(f"writing the checkpoint {final} failed: {e}") from e
    for old in checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    log.info("saved checkpoint %s", final)
    return final


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds ``path``, or will once it is created."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(state) if isinstance(t, torch.Tensor))


def check_disk(root: Path, needed: int, keep: int, warn: bool = False) -> None:
    """Refuse a checkpoint the disk cannot hold before any of it is written, and with
    ``warn`` say when the ``keep`` newest (one more while the next is written) would not
    fit. A write that fills the disk would fail later, in the writer's thread, leaving
    a temp directory behind."""
    free, gib = free_bytes(root), 2**30
    if free < needed:
        raise OSError(f"a checkpoint of this drafter takes {needed / gib:.1f} GiB and {root} has {free / gib:.1f} GiB "
                      "free: free some space, then resume=auto continues from the newest checkpoint, or set output_dir "
                      "on a larger disk")
    if warn and keep > 0 and free < (keep + 1 - len(checkpoints(root))) * needed:
        log.warning("checkpoint.keep=%d keeps up to %d checkpoints of %.1f GiB on disk while the next is written; %s "
                    "has %.1f GiB free, so a later save will fail", keep, keep + 1, needed / gib, root, free / gib)


def writes(group) -> bool:
    """Whether this rank writes its group's checkpoints (the first rank, or the only one)."""
    return group is None or dist.get_rank(group) == 0


def barrier(group) -> None:
    # NCCL groups are created lazily without a bound device (dflash.distributed.protocol): name it
    devices = [torch.cuda.current_device()] if dist.get_backend(group) == "nccl" else None
    dist.barrier(group=group, device_ids=devices)


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    keep: int,
    group=None,
) -> Path:
    """Every rank of the drafter ``group`` calls this; the first writes, and all return
    once the checkpoint is on disk."""
    if writes(group):
        write_checkpoint(root, snapshot(state_of(model, optimizer, scheduler, step)), keep, architecture(model))
    if group is not None:
        barrier(group)
    return step_dir(root, step)


class CheckpointWriter:
    """Checkpoints that cost a step only their copy to host memory: the group's first rank
    snapshots at the step boundary and a background thread writes while training goes on.
    The host buffers are allocated once, in the background, as soon as the optimizer has
    state (:meth:`prepare`, after the first step). One write is in flight at a time; the
    next save and :meth:`wait` wait for it, and a write that failed raises there."""

    def __init__(self, root: Path, keep: int, group=None):
        self.root, self.keep, self.group = root, keep, group
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self.pending: Future | None = None  # the write in flight
        self.allocating: Future | None = None  # the host buffers being allocated
        self.host: HostBuffers | None = None
        self.buffers: dict | None = None

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        if writes(self.group) and self.buffers is None and self.allocating is None:
            state = state_of(model, optimizer, scheduler, 0)
            check_disk(self.root, state_bytes(state), self.keep, warn=True)
            self.allocating = self.pool.submit(lambda state: HostBuffers(state).pin(), state)

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        if not writes(self.group):
            return
        self.wait()  # the previous write reads the buffers this snapshot fills
        state = state_of(model, optimizer, scheduler, step)
        check_disk(self.root, state_bytes(state), self.keep)
        if self.allocating is not None:
            self.host, self.allocating = self.allocating.result(), None
            self.buffers = self.host.state
        self.buffers = snapshot(state, self.buffers)
        self.pending = self.pool.submit(write_checkpoint, self.root, self.buffers, self.keep, architecture(model))

    def wait(self) -> None:
        """Until the write in flight is on disk; re-raises its error."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the last write on every rank of the group, so that none exports,
        exits or is restarted before the checkpoint exists."""
        self.wait()
        if self.group is not None:
            barrier(self.group)

    def abandon(self) -> None:
        """On the way out, also after an error: let a write in flight finish (a half-written
        checkpoint would only be a temp directory), without waiting for other ranks."""
        self.pool.shutdown(wait=True)
        if self.allocating is not None and self.allocating.exception() is None:
            self.host, self.allocating = self.allocating.result(), None
        if self.host is not None:
            self.host.release()


class UnreadableCheckpoint(RuntimeError):
    """A checkpoint directory that cannot be loaded: its files differ from their digests,
    or DCP cannot read it (incomplete, truncated, or not one)."""


def verify_checkpoint(path: Path) -> None:
    """Refuse a checkpoint whose files are not those written, naming the file; one written
    before checkpoints kept digests loads with a warning that it cannot be verified."""
    try:
        verified = verify_digests(path)
    except DamagedFiles as e:
        raise UnreadableCheckpoint(f"{path} is damaged: {e}") from None
    if not verified:
        log.warning("checkpoint %s has no digests (written before they were kept), so its files cannot be verified",
                    path)


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    group=None,
) -> int:
    """Restore in place, once the files match their digests; returns the step the
    checkpoint was taken after."""
    verify_checkpoint(path)
    check_architecture(path, model)
    state = state_of(model, optimizer, scheduler, 0)
    with dcp_errors(lambda why: UnreadableCheckpoint(f"{path}: {why}")):
        dcp.load(state, checkpoint_id=str(path), process_group=group)
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
