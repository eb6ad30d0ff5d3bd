"""The batch bundle: what one micro-batch carries from the target side to the drafter.

A bundle is a :class:`MicroBatch` (tokens, loss mask, lengths and the anchors the
data pipeline drew) plus a :class:`PrefillOutput` (the context features and,
for the KL loss, the target's top-k logits). :data:`FIELDS` lists every tensor
once, with its shape in terms of the header's dimensions; the transport derives
the header, the receive buffers, the packing and the unpacking from it. Adding
a tensor to the bundle is a row here, plus its producer and its consumer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from dflash.model.target import PrefillOutput
from dflash.objective.anchors import AnchorSpec, sample_anchors


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, queued without making the host wait.

    A copy from pageable host memory to CUDA waits for the GPU to finish its queue,
    and the GPU then idles while the host collates the next micro-batch and launches
    its first kernels. From pinned memory the copy is queued like a kernel."""
    if t.device.type == "cpu" and torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


@dataclass
class MicroBatch:
    """One micro-batch, padded to a length bucket, with its anchors already drawn.

    Anchors are drawn on the host where the data is produced: the drafter step
    then needs no host sync, and a target rank can ship them in the bundle.

    A row holds one sample, or with packing several side by side; ``position_ids``
    restart at 0 where each sample starts (the sample boundaries), and the padding
    after the last sample continues its count.
    """

    input_ids: torch.Tensor  # [b, S]
    loss_mask: torch.Tensor  # [b, S]
    lengths: torch.Tensor  # [b] real tokens of each row
    anchors: torch.Tensor  # [b, num_anchors]
    keep: torch.Tensor  # [b, num_anchors] bool: False for slots that could not be filled
    epoch: int
    position_ids: torch.Tensor | None = None  # [b, S]; None: one sample per row, 0..S-1

    def __post_init__(self) -> None:
        if self.position_ids is None:
            rows, width = self.input_ids.shape
            self.position_ids = torch.arange(width, device=self.input_ids.device).repeat(rows, 1)

    def to(self, device: torch.device) -> MicroBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved.update({k: to_device(v, device) for k, v in moved.items() if isinstance(v, torch.Tensor)})
        return MicroBatch(**moved)


@dataclass(frozen=True)
class Field:
    """One tensor of a bundle: where it lives, its shape as header dimensions
    (``b`` batch, ``S`` length, ``n`` anchors, ``F`` feature width, ``k`` top-k) and
    its dtype (``None``: the header's feature dtype)."""

    name: str
    part: str  # "batch" (MicroBatch) or "prefill" (PrefillOutput)
    dims: tuple[str, ...]
    dtype: torch.dtype | None
    only_with_topk: bool = False


FIELDS = (
    Field("lengths", "batch", ("b",), torch.int64),
    Field("input_ids", "batch", ("b", "S"), torch.int64),
    Field("position_ids", "batch", ("b", "S"), torch.int64),
    Field("loss_mask", "batch", ("b", "S"), torch.int64),
    Field("anchors", "batch", ("b", "n"), torch.int64),
    Field("keep", "batch", ("b", "n"), torch.bool),
    Field("features", "prefill", ("b", "S", "F"), None),
    Field("topk_values", "prefill", ("b", "S", "k"), torch.float32, only_with_topk=True),
    Field("topk_indices", "prefill", ("b", "S", "k"), torch.int64, only_with_topk=True),
)


def present(topk: int) -> list[Field]:
    """The fields a bundle carries: the top-k logits only when the KL loss needs them."""
    return [f for f in FIELDS if topk or not f.only_with_topk]


def shapes(sizes: dict[str, int], feature_dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each tensor a bundle of these dimensions carries, in field order."""
    return [(tuple(sizes[d] for d in f.dims), f.dtype or feature_dtype) for f in present(sizes["k"])]


def flatten(batch: MicroBatch, prefill: PrefillOutput) -> list[torch.Tensor]:
    """The bundle's tensors in :data:`FIELDS` order."""
    parts = {"batch": batch, "prefill": prefill}
    topk = 0 if prefill.topk_values is None else prefill.topk_values.shape[-1]
    tensors = [getattr(parts[f.part], f.name) for f in present(topk)]
    return [t.to(f.dtype) if f.dtype is not None else t for f, t in zip(present(topk), tensors)]


def unflatten(tensors: list[torch.Tensor], topk: int, epoch: int) -> tuple[MicroBatch, PrefillOutput]:
    values = {f.name: t for f, t in zip(present(topk), tensors)}
    batch = MicroBatch(**{f.name: values[f.name] for f in FIELDS if f.part == "batch"}, epoch=epoch)
    prefill = PrefillOutput(**{f.name: values.get(f.name) for f in FIELDS if f.part == "prefill"})
    return batch, prefill


def random_batch(batch: int, seq_len: int, vocab_size: int, spec: AnchorSpec, seed: int = 0,
                 samples_per_row: int = 1) -> MicroBatch:
    """Random tokens at full length, every token a response token: the shapes of
    real micro-batches without any data (compile warmup, benchmarks). With
    ``samples_per_row`` > 1, each row is that many samples packed side by side."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=g)
    mask = torch.ones_like(ids)
    drawn = [sample_anchors(mask[r], spec.num_anchors, g) for r in range(batch)]
    anchors = torch.stack([a for a, _ in drawn])
    keep = torch.stack([k for _, k in drawn])
    width = -(-seq_len // samples_per_row)
    positions = (torch.arange(seq_len) % width).repeat(batch, 1)
    return MicroBatch(ids, mask, torch.full((batch,), seq_len), anchors, keep, 0, positions)


def random_prefill(
    batch: int, seq_len: int, feature_dim: int, dtype: torch.dtype, topk: int, vocab_size: int, device: torch.device
) -> PrefillOutput:
    """What a prefill returns, filled with noise: drafter warmup and benchmarks. The top-k
    token ids of a position are distinct, as ``topk`` gives them: the loss writes each
    teacher column's gradient once, and repeated ids made the compiled step's gradients
    differ from the eager step's on the H200 (whichever repeat's write lands last wins)."""
    features = torch.randn(batch, seq_len, feature_dim, device=device).to(dtype)
    if not topk:
        return PrefillOutput(features)
    values = torch.randn(batch, seq_len, topk, device=device).sort(-1, descending=True).values
    # k sorted draws from [0, V - k] plus 0..k-1: distinct ids, uniform over the k-subsets' sorted forms
    draws = torch.randint(0, vocab_size - topk + 1, (batch, seq_len, topk), device=device).sort(-1).values
    return PrefillOutput(features, values, draws + torch.arange(topk, device=device))
