"""Regression pins of the buckets a run meets (dflash.data.order.buckets_met) on orders small
enough to work out by hand: a length on a bucket's edge, buckets given out of order, an
epoch's left-over samples, several epochs, and packed rows."""

from __future__ import annotations

import numpy as np

from dflash.data.order import PackedOrder, SampleOrder, best_fit, bucket_length, buckets_met


def test_every_sample_of_an_epoch_meets_its_own_bucket_whatever_the_order():
    """One sample a micro-batch over a whole epoch: each length's bucket, 64 itself on its edge."""
    lengths = np.array([16, 64, 65, 100])
    order = SampleOrder(4, batch_size=2, micro_batch_size=1, seed=3)
    assert buckets_met(order, lengths, (128, 16, 64, 256), 4) == (16, 64, 128)
    assert buckets_met(order, lengths, (128, 16, 64, 256), 40) == (16, 64, 128)  # more epochs meet no other
    assert buckets_met(order, lengths, (16, 64, 128), 0) == ()
    assert [bucket_length(n, [128, 16, 64]) for n in (1, 16, 17, 64, 65, 128)] == [16, 16, 64, 64, 128, 128]


def test_a_micro_batch_is_padded_to_its_longest_sample():
    """Four samples in one micro-batch: only the longest one's bucket."""
    order = SampleOrder(4, batch_size=4, micro_batch_size=4, seed=0)
    assert buckets_met(order, np.array([3, 70, 5, 9]), (16, 64, 128), 1) == (128,)


def test_the_samples_after_an_epochs_last_step_wait_for_the_next_epoch():
    """Five samples in steps of two: four train in each epoch, the fifth left over is the
    one its permutation puts last, and it is met only in an epoch that reaches it."""
    order = SampleOrder(5, batch_size=2, micro_batch_size=1, seed=0)
    first, second = order.permutation(0), order.permutation(1)
    lengths = np.full(5, 10)
    lengths[first[4]] = 100  # left over in epoch 0
    assert second[4] != first[4]  # (with seed 0 it trains in epoch 1)
    buckets = (16, 128)
    assert buckets_met(order, lengths, buckets, 4) == (16,)
    position = int(np.flatnonzero(second == first[4])[0])  # micro-batch 4 + position of the run
    assert buckets_met(order, lengths, buckets, 4 + position) == (16,)
    assert buckets_met(order, lengths, buckets, 4 + position + 1) == (16, 128)


def test_packed_rows_meet_the_bucket_of_their_summed_length():
    """50 and 10 share a row, 30 and 30 the other (best fit, longest first): both rows hold
    60 tokens, so only the 64 bucket, though no sample is longer than 50."""
    lengths = np.array([30, 30, 50, 10])
    assert sorted(sorted(lengths[r].tolist()) for r in best_fit(lengths, np.arange(4), 64)) == [[10, 50], [30, 30]]
    order = PackedOrder(lengths, 64, batch_size=1, micro_batch_size=1, seed=0)
    assert order.num_rows == 2
    assert buckets_met(order, lengths, (32, 50, 64), 1) == (64,)
    assert buckets_met(order, lengths, (32, 50, 64), 6) == (64,)
