"""Packed rows: every sample once per epoch, within the budget, the same on any split."""

import numpy as np
import pytest

from dflash.data.dataset import synthetic_lengths
from dflash.data.order import PackedOrder, SampleOrder, best_fit, bucket_length, buckets_met


def lognormal_lengths(n: int = 4000, budget: int = 32768, mean: int = 4500) -> np.ndarray:
    return synthetic_lengths(n, budget, mean, np.random.default_rng(0))


def test_best_fit_places_every_sample_once_within_the_budget():
    lengths = lognormal_lengths()
    rows = best_fit(lengths, np.random.default_rng(1).permutation(len(lengths)), 32768)
    placed = np.concatenate(rows)
    assert sorted(placed.tolist()) == list(range(len(lengths)))
    assert max(int(lengths[r].sum()) for r in rows) <= 32768
    padding = 1 - lengths.sum() / (len(rows) * 32768)
    assert padding < 0.03, padding


def test_each_epoch_packs_other_rows_of_the_same_count():
    order = PackedOrder(lognormal_lengths(), 32768, batch_size=4, micro_batch_size=1, seed=0)
    first, second = order.packs(0), order.packs(1)
    assert len(first) == len(second) == order.num_rows
    assert [r.tolist() for r in first] != [r.tolist() for r in second]
    assert order.padding() < 0.03


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_a_step_trains_the_same_rows_however_it_is_split(micro):
    """Packing depends on the seed and the lengths only; the micro-batch size splits a
    step's rows without changing them."""
    lengths = lognormal_lengths(600)
    whole = PackedOrder(lengths, 32768, batch_size=4, micro_batch_size=4, seed=5)
    split = PackedOrder(lengths, 32768, batch_size=4, micro_batch_size=micro, seed=5)
    for step in (0, 3, whole.steps_per_epoch + 1):
        epoch, rows = whole.rows(step)
        parts = [split.rows(step * (4 // micro) + m) for m in range(4 // micro)]
        assert all(e == epoch for e, _ in parts)
        assert [r.tolist() for r in rows] == [r.tolist() for _, part in parts for r in part]


def test_a_sample_longer_than_a_row_and_too_few_rows_are_refused():
    with pytest.raises(ValueError, match="does not fit a packed row of train.max_len=100"):
        PackedOrder([50, 101], 100, batch_size=1, micro_batch_size=1, seed=0)
    with pytest.raises(ValueError, match="fewer than one batch"):
        PackedOrder([60, 60, 60], 100, batch_size=4, micro_batch_size=1, seed=0)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("num_micro", [1, 3, 7, 40, 200])
def test_the_buckets_met_are_those_collation_pads_each_micro_batch_to(packed, num_micro):
    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(np.log(60), 0.9, 90).round().astype(np.int64), 4, 256)
    buckets = (32, 64, 96, 128, 192, 256)
    order = PackedOrder(lengths, 256, 8, 2, seed=1) if packed else SampleOrder(len(lengths), 8, 2, seed=1)
    by_hand = set()
    for m in range(num_micro):  # every micro-batch of the run, as collate pads it
        _, rows = order.rows(m)
        by_hand.add(bucket_length(max(int(lengths[row].sum()) for row in rows), list(buckets)))
    assert buckets_met(order, lengths, buckets, num_micro) == tuple(sorted(by_hand))
    if num_micro == 1:
        assert len(by_hand) == 1  # a short run meets fewer buckets than the plan has
