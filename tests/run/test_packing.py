"""Packing: a row of several samples trains exactly as the samples one by one.

The reference is the unpacked path, already held to a float64 loss over every block slot
(tests/run/test_step.py): a packed micro-batch of samples A, B, C with the anchors the
row drew gives the same loss sums and the same gradients as A, B and C each alone in its
row, with the same anchors moved to its own positions.
"""

import copy

import numpy as np
import pytest
import torch
from helpers import flat_grads, tiny_drafter, tiny_target
from test_step import BS, make_trainer

from dflash.data.bundle import MicroBatch
from dflash.data.dataset import Dataset, Sample
from dflash.data.order import collate
from dflash.model.drafter import FULL, SLIDING
from dflash.model.target import PrefillOutput, Target
from dflash.objective.anchors import AnchorSpec
from dflash.run.build import check_packing

LENGTHS = (20, 9, 27)
WIDTH = 64
FEATURES = 3 * 64


def samples(seed: int = 0) -> Dataset:
    """Three samples with a one-token prompt (no loss) and a reply, each its own length: a
    block past one sample's end would reach the next one's reply tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(LENGTHS):
        mask = [0] + [1] * (n - 1)
        out.append(Sample(torch.randint(0, 90, (n,), generator=g).tolist(), mask, f"s{i}"))
    return Dataset(out)


def packed_and_alone(num_anchors: int):
    """The packed row of all three samples, and each sample alone with the anchors the
    row gave it (unfilled slots padded with ``keep=False``), with matching features."""
    dataset = samples()
    spec = AnchorSpec(num_anchors, seed=3)
    packed = collate(dataset, 0, [np.arange(3)], [WIDTH], pad_id=0, spec=spec)
    features = torch.randn(1, WIDTH, FEATURES, generator=torch.Generator().manual_seed(1))
    alone, start = [], 0
    for i, n in enumerate(LENGTHS):
        mine = packed.keep[0] & (packed.anchors[0] >= start) & (packed.anchors[0] < start + n)
        anchors = torch.zeros(num_anchors, dtype=torch.long)
        anchors[: int(mine.sum())] = packed.anchors[0][mine] - start
        keep = torch.arange(num_anchors) < int(mine.sum())
        ids = torch.zeros(1, WIDTH, dtype=torch.long)
        ids[0, :n] = packed.input_ids[0, start : start + n]
        mask = torch.zeros(1, WIDTH, dtype=torch.long)
        mask[0, :n] = packed.loss_mask[0, start : start + n]
        feats = torch.zeros(1, WIDTH, FEATURES)
        feats[0, :n] = features[0, start : start + n]
        alone.append((MicroBatch(ids, mask, torch.tensor([n]), anchors[None], keep[None], 0), PrefillOutput(feats)))
        start += n
    return (packed, PrefillOutput(features)), alone


def test_collate_packs_samples_side_by_side_with_restarting_positions():
    (packed, _), alone = packed_and_alone(num_anchors=12)
    total = sum(LENGTHS)
    assert packed.lengths.tolist() == [total]
    expected = torch.cat([torch.arange(n) for n in LENGTHS] + [torch.arange(WIDTH - total) + LENGTHS[-1]])
    assert torch.equal(packed.position_ids[0], expected)
    # every sample got anchors, none on a sample's last token (its next token is another sample's)
    ends = np.cumsum(LENGTHS) - 1
    chosen = packed.anchors[0][packed.keep[0]]
    assert not set(chosen.tolist()) & set(ends.tolist())
    assert all(bool(b.keep.any()) for b, _ in alone)


@pytest.mark.parametrize("attention", [{}, {"layer_types": [SLIDING, FULL], "sliding_window": 5}],
                         ids=["full", "sliding"])
def test_a_packed_row_trains_as_its_samples_one_by_one(attention):
    """Same loss sum, weight sum, per-slot counts and gradients, to fp32 rounding; a block
    running past its sample's end has no loss there, and no query sees another sample.
    With more anchor slots than valid positions, every position anchors, the last ones
    before each sample's end included."""
    (packed, features), alone = packed_and_alone(num_anchors=60)
    base = tiny_drafter(block_size=BS, **attention)
    one = make_trainer(copy.deepcopy(base), packed=True)
    one.micro_step(packed, features)
    each = make_trainer(copy.deepcopy(base))
    for batch, prefill in alone:
        each.micro_step(batch, prefill)
    a, b = one.stats, each.stats
    torch.testing.assert_close(a.loss_sum, b.loss_sum, rtol=1e-5, atol=0)
    torch.testing.assert_close(a.weight_sum, b.weight_sum, rtol=1e-6, atol=0)
    assert torch.equal(a.counted, b.counted)
    assert torch.equal(a.correct, b.correct) and a.samples == b.samples == len(LENGTHS)
    torch.testing.assert_close(flat_grads(one), flat_grads(each), rtol=1e-4, atol=1e-6)


def test_position_ids_that_are_no_sample_boundaries_stop_the_step():
    (packed, features), _ = packed_and_alone(num_anchors=12)
    packed.position_ids[0, 5] = 7
    trainer = make_trainer(tiny_drafter(block_size=BS))
    trainer.micro_step(packed, features)
    with pytest.raises(ValueError, match="no sample boundaries"):
        trainer.finish()


def test_the_packed_prefill_gives_each_sample_its_own_features():
    """HF's packed-sequence masks keep the samples apart: each sample's features in the
    packed row equal its prefill alone."""
    target = Target(tiny_target(num_layers=4), [0, 2])
    assert target.packing_error() < 1e-5
    check_packing(target, torch.float32)


class SeesAcross(Target):
    """A target that drops the position ids: its packed samples see each other."""

    def prefill(self, input_ids, topk=0, position_ids=None):
        return super().prefill(input_ids, topk)


def test_a_target_whose_packed_samples_see_each_other_is_refused():
    target = SeesAcross(tiny_target(num_layers=4), [0, 2])
    assert target.packing_error() > 0.1
    with pytest.raises(ValueError, match="does not keep packed samples apart"):
        check_packing(target, torch.float32)
