"""The order of training: which samples form each micro-batch, and their collation
into a bucket-wide :class:`~dflash.data.bundle.MicroBatch` with its anchors drawn.

Both are pure functions of the seed and the sample's place, so any split of the
ranks trains on the same data with the same anchors. A micro-batch is a list of
rows; a row holds one sample (:class:`SampleOrder`) or, with packing, the samples
of one fixed token budget side by side (:class:`PackedOrder`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from dflash.data.bundle import MicroBatch
from dflash.data.dataset import Dataset
from dflash.objective.anchors import (
    AnchorSpec,
    anchor_keys,
    choose_anchors,
    sample_generator,
)


def bucket_length(length: int, buckets: list[int]) -> int:
    """The smallest bucket that holds ``length`` tokens."""
    for b in sorted(buckets):
        if length <= b:
            return b
    raise ValueError(f"sequence of {length} tokens exceeds the largest bucket {max(buckets)}")


class EpochSteps:
    """Optimizer steps of ``batch_size`` consecutive units (samples, or packed rows) of each
    epoch's order, split into micro-batches of ``micro_batch_size``: where global
    micro-batch ``m`` starts. The units after the last whole step of an epoch wait for the
    next epoch."""

    def __init__(self, batch_size: int, micro_batch_size: int):
        if batch_size % micro_batch_size:
            raise ValueError(f"train.batch_size={batch_size} is not a multiple of train.micro_batch_size={micro_batch_size}")
        self.batch_size, self.micro_batch_size = batch_size, micro_batch_size
        self.micro_per_step = batch_size // micro_batch_size
        self.steps_per_epoch = 0

    def place(self, m: int) -> tuple[int, int]:
        """(epoch, index of its first unit in the epoch's order) of global micro-batch ``m``."""
        step, within = divmod(m, self.micro_per_step)
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        return epoch, step_in_epoch * self.batch_size + within * self.micro_batch_size


class SampleOrder(EpochSteps):
    """Which samples form global micro-batch ``m``: a pure function of seed and ``m``.

    Each epoch is a seeded permutation of the dataset; an optimizer step takes
    ``batch_size`` consecutive samples of it, split into micro-batches. Nothing
    depends on the number of ranks, so any split trains on the same data.
    """

    def __init__(self, num_samples: int, batch_size: int, micro_batch_size: int, seed: int):
        super().__init__(batch_size, micro_batch_size)
        if num_samples < batch_size:
            raise ValueError(f"{num_samples} samples are fewer than one batch (train.batch_size={batch_size})")
        self.num_samples, self.seed = num_samples, seed
        self.steps_per_epoch = num_samples // batch_size
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)}
        return self._perms[epoch]

    def micro_batch(self, m: int) -> tuple[int, np.ndarray]:
        """(epoch, sample indices) of global micro-batch ``m``."""
        epoch, start = self.place(m)
        return epoch, self.permutation(epoch)[start : start + self.micro_batch_size]

    def rows(self, m: int) -> tuple[int, list[np.ndarray]]:
        """(epoch, one single-sample row per sample) of global micro-batch ``m``."""
        epoch, indices = self.micro_batch(m)
        return epoch, [indices[r : r + 1] for r in range(len(indices))]


def best_fit(lengths: np.ndarray, order: np.ndarray, budget: int) -> list[np.ndarray]:
    """Rows of at most ``budget`` tokens holding every sample of ``order``: longest first,
    each into the fullest row it still fits (best-fit decreasing). Which row a sample
    lands in depends only on the lengths (``order`` breaks ties), so every epoch packs
    the same row lengths and the same number of rows."""
    by_length = order[np.argsort(-lengths[order], kind="stable")]
    rows: list[list[int]] = []
    open_rows: dict[int, list[int]] = {}  # tokens left -> the rows with that much room
    room: list[int] = []  # the keys of open_rows, ascending (at most budget of them)
    for i in by_length.tolist():
        n = int(lengths[i])
        at = bisect.bisect_left(room, n)
        if at == len(room):
            rows.append([i])
            row, left = len(rows) - 1, budget - n
        else:
            left = room[at]
            row = open_rows[left].pop()
            if not open_rows[left]:
                del open_rows[left], room[at]
            rows[row].append(i)
            left -= n
        if left not in open_rows:
            open_rows[left] = []
            bisect.insort(room, left)
        open_rows[left].append(row)
    return [np.asarray(r) for r in rows]


class PackedOrder(EpochSteps):
    """Which packed rows form global micro-batch ``m`` (``train.packing``): a pure
    function of the seed, ``m`` and the sample lengths.

    Each epoch packs a seeded permutation of the dataset into rows of ``budget`` tokens
    (:func:`best_fit`), then shuffles the rows with the seed; an optimizer step takes
    ``batch_size`` consecutive rows, split into micro-batches of ``micro_batch_size``
    (:class:`EpochSteps`)."""

    def __init__(self, lengths: Sequence[int], budget: int, batch_size: int, micro_batch_size: int, seed: int):
        super().__init__(batch_size, micro_batch_size)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if len(self.lengths) and self.lengths.max() > budget:
            raise ValueError(f"a sample of {self.lengths.max()} tokens does not fit a packed row of train.max_len={budget}")
        self.budget, self.seed = budget, seed
        self._packs: dict[int, list[np.ndarray]] = {}
        self.num_rows = len(self.packs(0))
        if self.num_rows < batch_size:
            raise ValueError(f"{len(self.lengths)} samples pack into {self.num_rows} rows of {budget} tokens, fewer "
                             f"than one batch (train.batch_size={batch_size} rows)")
        self.steps_per_epoch = self.num_rows // batch_size

    def packs(self, epoch: int) -> list[np.ndarray]:
        """The rows of ``epoch`` in training order."""
        if epoch not in self._packs:
            samples = np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))
            rows = best_fit(self.lengths, samples, self.budget)
            shuffle = np.random.default_rng([self.seed, epoch, 1]).permutation(len(rows))
            self._packs = {epoch: [rows[r] for r in shuffle]}
        return self._packs[epoch]

    def padding(self) -> float:
        """The fraction of an epoch's row tokens that are padding."""
        return 1 - float(self.lengths.sum()) / (self.num_rows * self.budget)

    def rows(self, m: int) -> tuple[int, list[np.ndarray]]:
        """(epoch, the packed rows) of global micro-batch ``m``."""
        epoch, start = self.place(m)
        return epoch, self.packs(epoch)[start : start + self.micro_batch_size]


def collate(
    dataset: Dataset, epoch: int, rows: list[np.ndarray], buckets: list[int], *, pad_id: int, spec: AnchorSpec
) -> MicroBatch:
    """The samples of each row side by side, padded with ``pad_id`` to the bucket of the
    longest row. Every sample keys its positions from its own generator (seed, epoch,
    sample index) and a row takes the ``spec.num_anchors`` smallest keys
    (:func:`~dflash.objective.anchors.choose_anchors`); position ids restart at each
    sample."""
    samples = [[dataset.samples[i] for i in row] for row in rows]
    lengths = [sum(len(s.input_ids) for s in row) for row in samples]
    width = bucket_length(max(lengths), buckets)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    anchors, keep = [], []
    for r, (indices, row) in enumerate(zip(rows, samples)):
        keys, at = [], 0
        for i, sample in zip(indices, row):
            n = len(sample.input_ids)
            ids[r, at : at + n] = torch.as_tensor(sample.input_ids)
            mask[r, at : at + n] = torch.as_tensor(sample.loss_mask)
            positions[r, at : at + n] = torch.arange(n)
            keys.append(anchor_keys(mask[r, at : at + n], sample_generator(spec.seed, epoch, int(i))))
            at += n
        positions[r, at:] = torch.arange(width - at) + (positions[r, at - 1] + 1)
        a, k = choose_anchors(torch.cat(keys), spec.num_anchors)
        anchors.append(a)
        keep.append(k)
    return MicroBatch(ids, mask, torch.tensor(lengths), torch.stack(anchors), torch.stack(keep), epoch, positions)


def buckets_met(order: SampleOrder | PackedOrder, lengths: np.ndarray, buckets: Sequence[int],
                num_micro: int) -> tuple[int, ...]:
    """The buckets global micro-batches ``0 .. num_micro - 1`` are padded to (as
    :func:`collate` pads them), ascending: the only shapes a run of ``num_micro``
    micro-batches meets, so the only ones worth compiling before it starts. Computed
    epoch by epoch from the lengths alone; stops once every bucket is met."""
    edges = np.asarray(sorted(buckets))
    met: set[int] = set()
    per_epoch = order.steps_per_epoch * order.batch_size // order.micro_batch_size
    epoch = 0
    while epoch * per_epoch < num_micro and len(met) < len(edges):
        count = min(per_epoch, num_micro - epoch * per_epoch)
        if isinstance(order, PackedOrder):
            rows = order.packs(epoch)[: count * order.micro_batch_size]
            widths = np.fromiter((lengths[r].sum() for r in rows), dtype=np.int64, count=len(rows))
        else:
            widths = lengths[order.permutation(epoch)[: count * order.micro_batch_size]]
        longest = widths.reshape(count, order.micro_batch_size).max(axis=1)
        met.update(edges[np.searchsorted(edges, np.unique(longest))].tolist())
        epoch += 1
    return tuple(sorted(met))
