"""Batch bundles over point-to-point: a fixed-size header, then the tensors.

The header carries the bundle's dimensions (batch, length, anchors, feature
width and dtype, top-k, block size), its micro-batch index and flags (end of
data, abort). The receiver checks the header against what it expects (a
mismatch is a clear error, never a hang on a wrongly sized receive), then
receives into buffers of exactly the shapes that :data:`dflash.bundle.FIELDS`
gives for those dimensions.

Each (target, drafter) pair has its own process group (see ``dflash.distributed.protocol``),
so messages of one pair never match those of another. Within a bundle each
tensor has its own tag (its index), so a receive can only match the tensor it
was sized for (gloo honours tags; NCCL orders by issue). gloo (CPU) sends CPU
tensors; NCCL (GPU) sends device tensors; dtypes that either lacks travel as
``uint8`` views.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, fields

import torch
import torch.distributed as dist

from dflash.data.bundle import MicroBatch, flatten, shapes, to_device, unflatten
from dflash.model.target import PrefillOutput

MAGIC = 0x0DF1A5
FLAG_END, FLAG_ABORT = 1, 2
FEATURE_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
FEATURE_DTYPES = {v: k for k, v in FEATURE_DTYPE_CODES.items()}


class BundleError(RuntimeError):
    """A header that does not describe the bundle this drafter expects."""


@dataclass
class Header:
    micro_batch: int
    flags: int = 0
    batch: int = 0
    seq_len: int = 0
    num_anchors: int = 0
    feature_dim: int = 0
    feature_dtype: int = 0
    topk: int = 0
    block_size: int = 0
    epoch: int = 0
    send_wait_us: int = 0  # the target's cumulative time blocked on sends, for pipeline metrics

    def tensor(self) -> torch.Tensor:
        return torch.tensor([MAGIC, *astuple(self)], dtype=torch.int64)

    @classmethod
    def parse(cls, t: torch.Tensor) -> Header:
        v = t.tolist()
        if v[0] != MAGIC:
            raise BundleError(f"bad bundle header (magic {v[0]:#x}): the ranks disagree on the message order")
        return cls(*v[1:])

    def shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each payload tensor, in field order."""
        sizes = {"b": self.batch, "S": self.seq_len, "n": self.num_anchors, "F": self.feature_dim, "k": self.topk}
        return shapes(sizes, FEATURE_DTYPES[self.feature_dtype])


HEADER_LEN = 1 + len(fields(Header))  # the magic number, then every field


def _wire(t: torch.Tensor) -> torch.Tensor:
    """NCCL has no bf16 on some builds and gloo none at all, and neither takes every
    bool: send such tensors as bytes."""
    if t.dtype in (torch.bfloat16, torch.float16, torch.bool):
        return t.contiguous().view(torch.uint8)
    return t.contiguous()


def _complete(works: list, idle: Callable[[], bool] | None = None) -> None:
    """Block the host until ``works`` are done, polling: on NCCL ``wait()`` only orders
    the current stream behind the transfer and returns at once, which would neither
    bound the bundles in flight nor measure the time a target is blocked on its
    drafters. Before that, ``idle`` (NCCL only) may do slices of other work while the
    transfer runs; it returns False when it has none. Gloo's point-to-point works
    report completion only after ``wait()``, and a second ``wait()`` never returns,
    so each work is waited on exactly once."""
    while idle is not None and not all(w.is_completed() for w in works):
        if not idle():
            time.sleep(50e-6)
    for w in works:
        w.wait()
    while not all(w.is_completed() for w in works):
        time.sleep(50e-6)


class BundleSender:
    """Non-blocking sends from one target rank, at most ``max_in_flight`` bundles outstanding."""

    def __init__(self, groups: dict[int, dist.ProcessGroup], device: torch.device, block_size: int, max_in_flight: int = 2,
                 idle: Callable[[], bool] | None = None):
        self.groups, self.device, self.block_size, self.max_in_flight = groups, device, block_size, max_in_flight
        self.idle = idle  # work for the time this rank waits on its drafters (dflash.decode.live)
        self.in_flight: list[tuple[list, list[torch.Tensor]]] = []
        self.wait_s = 0.0
        self.bytes_sent = 0

    def _post(self, peer: int, tensors: list[torch.Tensor], bounded: bool = True) -> None:
        while bounded and len(self.in_flight) >= self.max_in_flight:
            start = time.perf_counter()
            works, _ = self.in_flight.pop(0)
            _complete(works, self.idle)
            self.wait_s += time.perf_counter() - start
        ops = [dist.P2POp(dist.isend, t, peer, group=self.groups[peer], tag=tag) for tag, t in enumerate(tensors)]
        self.in_flight.append((dist.batch_isend_irecv(ops), tensors))
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)

    def send(self, peer: int, m: int, batch: MicroBatch, prefill: PrefillOutput) -> None:
        f = prefill.features
        header = Header(
            micro_batch=m, batch=f.shape[0], seq_len=f.shape[1], num_anchors=batch.anchors.shape[1],
            feature_dim=f.shape[2], feature_dtype=FEATURE_DTYPE_CODES[f.dtype],
            topk=0 if prefill.topk_values is None else prefill.topk_values.shape[-1],
            block_size=self.block_size, epoch=batch.epoch, send_wait_us=int(self.wait_s * 1e6),
        )
        payload = [_wire(to_device(t, self.device)) for t in flatten(batch, prefill)]
        self._post(peer, [to_device(header.tensor(), self.device), *payload])

    def send_flag(self, peer: int, m: int, flags: int) -> None:
        """A header alone; never blocks, so an abort goes out even when peers are stuck."""
        header = Header(micro_batch=m, flags=flags, send_wait_us=int(self.wait_s * 1e6))
        self._post(peer, [to_device(header.tensor(), self.device)], bounded=False)

    def drain(self) -> None:
        for works, _ in self.in_flight:
            _complete(works)
        self.in_flight.clear()

    def deliver(self, timeout_s: float) -> bool:
        """Give the sends in flight up to ``timeout_s`` to reach their drafters: an abort
        flag, before this rank aborts its communicators and with them anything still
        queued. False if some did not arrive (a drafter that is stuck). Only NCCL needs
        it: gloo's orderly shutdown, which a failing rank still uses, delivers them."""
        if self.device.type != "cuda":
            return True
        deadline = time.monotonic() + timeout_s
        works = [w for pending, _ in self.in_flight for w in pending]
        while not all(w.is_completed() for w in works):
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-3)
        return True


@dataclass
class Expected:
    """What a drafter accepts: anything else in a header is a configuration mismatch."""

    max_batch: int
    num_anchors: int
    feature_dim: int
    feature_dtype: torch.dtype
    topk: int
    buckets: list[int]
    block_size: int


class BundleReceiver:
    """Receives bundles on one drafter rank; the next header is posted while a bundle trains."""

    def __init__(self, groups: dict[int, dist.ProcessGroup], device: torch.device, expected: Expected):
        self.groups, self.device, self.expected = groups, device, expected
        self._pending: tuple[int, torch.Tensor, list] | None = None
        self.bytes_received = 0
        self.wait_s = 0.0
        self.target_send_wait_us: dict[int, int] = {}

    def post_header(self, peer: int) -> None:
        buf = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, peer, group=self.groups[peer])])
        self._pending = (peer, buf, works)

    def _check(self, h: Header, peer: int, m: int | None) -> None:
        e = self.expected
        problems = []
        if m is not None and h.micro_batch != m:
            problems.append(f"micro-batch {h.micro_batch}, expected {m}")
        if not 1 <= h.batch <= e.max_batch:
            problems.append(f"batch {h.batch} (train.micro_batch_size={e.max_batch})")
        if h.seq_len not in e.buckets:
            problems.append(f"length {h.seq_len} not a bucket of {e.buckets}")
        if h.num_anchors != e.num_anchors:
            problems.append(f"{h.num_anchors} anchors, expected train.num_anchors={e.num_anchors}")
        if h.feature_dim != e.feature_dim:
            problems.append(f"feature dim {h.feature_dim}, the drafter's fc takes {e.feature_dim}")
        if FEATURE_DTYPES.get(h.feature_dtype) != e.feature_dtype:
            problems.append(f"feature dtype {FEATURE_DTYPES.get(h.feature_dtype, h.feature_dtype)}, expected {e.feature_dtype}")
        if h.topk != e.topk:
            problems.append(f"top-k {h.topk}, expected loss.kl_topk={e.topk}")
        if h.block_size != e.block_size:
            problems.append(f"block size {h.block_size}, expected drafter.block_size={e.block_size}")
        if problems:
            raise BundleError(f"bundle from rank {peer} does not match this drafter: " + "; ".join(problems))

    def drain(self, peer: int) -> int:
        """Receive from ``peer`` up to its end-of-data flag; returns how many bundles
        were discarded (after an early stop, those the target had already sent)."""
        discarded = 0
        while self.receive(peer, None)[1] is not None:
            discarded += 1
        return discarded

    def receive(self, peer: int, m: int | None) -> tuple[Header, MicroBatch | None, PrefillOutput | None]:
        """The bundle for micro-batch ``m`` from ``peer`` (any, if ``m`` is None);
        (header, None, None) at end of data."""
        if self.device.type == "cuda":
            # Reading the header syncs this stream anyway; syncing first keeps the
            # drafter's own queued compute out of the time counted as waiting on targets.
            torch.cuda.current_stream(self.device).synchronize()
        start = time.perf_counter()
        if self._pending is None or self._pending[0] != peer:
            self.post_header(peer)
        _, buf, works = self._pending
        self._pending = None
        for w in works:
            w.wait()
        h = Header.parse(buf.cpu())
        self.target_send_wait_us[peer] = h.send_wait_us
        if h.flags & FLAG_ABORT:
            raise BundleError(f"target rank {peer} aborted the run at micro-batch {h.micro_batch}")
        if h.flags & FLAG_END:
            self.wait_s += time.perf_counter() - start
            return h, None, None
        self._check(h, peer, m)
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in h.shapes()]
        wire = [_wire(t) for t in bufs]
        ops = [dist.P2POp(dist.irecv, t, peer, group=self.groups[peer], tag=tag) for tag, t in enumerate(wire, start=1)]
        works = dist.batch_isend_irecv(ops)
        for w in works:
            w.wait()
        self.wait_s += time.perf_counter() - start
        self.bytes_received += sum(t.numel() * t.element_size() for t in wire) + HEADER_LEN * 8
        batch, prefill = unflatten(bufs, h.topk, h.epoch)
        return h, batch, prefill


class PipelineCounters:
    """Per-step pipeline figures on the drafter ranks: drafter time blocked on receives
    (mean over drafters), target time blocked on sends (mean over the sending target
    ranks, one per tensor-parallel group, read from the headers), bytes moved. Reduced
    over the drafter group once per step."""

    def __init__(self, receiver: BundleReceiver, senders: list[int], group: dist.ProcessGroup, device: torch.device):
        self.receiver, self.group, self.device = receiver, group, device
        self.senders = {rank: i for i, rank in enumerate(senders)}
        self.num_drafters = dist.get_world_size(group)
        self.last = torch.zeros(3, dtype=torch.float64)

    def step(self) -> dict:
        target_wait = torch.zeros(len(self.senders), dtype=torch.float64)
        for peer, us in self.receiver.target_send_wait_us.items():
            target_wait[self.senders[peer]] = us / 1e6
        totals = torch.tensor([self.receiver.wait_s, self.receiver.bytes_received, 0.0], dtype=torch.float64)
        both = torch.cat([totals, target_wait]).to(self.device)
        dist.all_reduce(both[:3], group=self.group)
        dist.all_reduce(both[3:], op=dist.ReduceOp.MAX, group=self.group)
        both = both.cpu()
        both[2] = both[3:].sum()
        delta = both[:3] - self.last
        self.last.copy_(both[:3])
        return {
            "drafter_wait_s": float(delta[0]) / self.num_drafters,
            "target_wait_s": float(delta[2]) / len(self.senders),
            "bytes_per_step": int(delta[1]),
        }
