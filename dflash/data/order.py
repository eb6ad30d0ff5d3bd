"""The order of training: which samples form each micro-batch, and their collation
into a bucket-wide :class:`~dflash.data.bundle.MicroBatch` with its anchors drawn.

Both are pure functions of the seed and the sample's place, so any split of the
ranks trains on the same data with the same anchors.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash.data.bundle import MicroBatch
from dflash.data.dataset import Dataset
from dflash.objective.anchors import AnchorSpec, sample_anchors, sample_generator


def bucket_length(length: int, buckets: list[int]) -> int:
    """The smallest bucket that holds ``length`` tokens."""
    for b in sorted(buckets):
        if length <= b:
            return b
    raise ValueError(f"sequence of {length} tokens exceeds the largest bucket {max(buckets)}")


class SampleOrder:
    """Which samples form global micro-batch ``m``: a pure function of seed and ``m``.

    Each epoch is a seeded permutation of the dataset; an optimizer step takes
    ``batch_size`` consecutive samples of it, split into micro-batches. Nothing
    depends on the number of ranks, so any split trains on the same data.
    """

    def __init__(self, num_samples: int, batch_size: int, micro_batch_size: int, seed: int):
        if batch_size % micro_batch_size:
            raise ValueError(f"train.batch_size={batch_size} is not a multiple of train.micro_batch_size={micro_batch_size}")
        if num_samples < batch_size:
            raise ValueError(f"{num_samples} samples are fewer than one batch (train.batch_size={batch_size})")
        self.num_samples, self.batch_size, self.micro_batch_size, self.seed = num_samples, batch_size, micro_batch_size, seed
        self.steps_per_epoch = num_samples // batch_size
        self.micro_per_step = batch_size // micro_batch_size
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)}
        return self._perms[epoch]

    def micro_batch(self, m: int) -> tuple[int, np.ndarray]:
        """(epoch, sample indices) of global micro-batch ``m``."""
        step, within = divmod(m, self.micro_per_step)
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        start = step_in_epoch * self.batch_size + within * self.micro_batch_size
        return epoch, self.permutation(epoch)[start : start + self.micro_batch_size]


def collate(
    dataset: Dataset, epoch: int, indices: np.ndarray, buckets: list[int], *, pad_id: int, spec: AnchorSpec
) -> MicroBatch:
    """Samples ``indices`` padded with ``pad_id`` to their bucket, each with its anchors
    drawn from its own generator (seed, epoch, sample index)."""
    rows = [dataset.samples[i] for i in indices]
    lengths = [len(r.input_ids) for r in rows]
    width = bucket_length(max(lengths), buckets)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    anchors, keep = [], []
    for r, (i, row) in enumerate(zip(indices, rows)):
        n = len(row.input_ids)
        ids[r, :n] = torch.as_tensor(row.input_ids)
        mask[r, :n] = torch.as_tensor(row.loss_mask)
        a, k = sample_anchors(mask[r, :n], spec.num_anchors, sample_generator(spec.seed, epoch, int(i)))
        anchors.append(a)
        keep.append(k)
    return MicroBatch(ids, mask, torch.tensor(lengths), torch.stack(anchors), torch.stack(keep), epoch)
