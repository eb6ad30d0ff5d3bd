"""Anchors and blocks: same-position labels, no loss on the anchor, batch independence."""

import torch

from dflash.data.dataset import Dataset, Sample
from dflash.data.order import collate
from dflash.objective.anchors import (
    AnchorSpec,
    make_blocks,
    sample_anchors,
    sample_generator,
)
from dflash.objective.loss import decay_weights

B = 4
MASK = 99


def batch_anchors(loss_mask, lengths, sample_index, epoch, seed, num_anchors):
    """Anchors exactly as the data pipeline draws them, through ``collate``."""
    samples = [Sample([1] * int(n), loss_mask[r, : int(n)].tolist(), "t") for r, n in enumerate(lengths)]
    index = {int(i): s for i, s in zip(sample_index, samples)}
    dataset = Dataset([index.get(i, samples[0]) for i in range(max(index) + 1)])
    mb = collate(dataset, epoch, [[i] for i in sample_index.numpy()], [loss_mask.shape[1]], pad_id=0,
                 spec=AnchorSpec(num_anchors, seed))
    return mb.anchors, mb.keep


def one_batch(lengths, seq_len=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 90, (len(lengths), seq_len), generator=g)
    loss_mask = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for r, n in enumerate(lengths):
        loss_mask[r, 5:n] = 1
    return ids, loss_mask, torch.tensor(lengths)


def test_anchor_positions_are_valid_and_sorted():
    _, loss_mask, lengths = one_batch([20])
    anchors, keep = sample_anchors(loss_mask[0, :20], 6, sample_generator(0, 0, 7))
    kept = anchors[keep]
    assert keep.all() and len(kept) == 6
    assert (kept >= 5).all() and (kept + 1 < 20).all(), "anchors: response tokens whose next token is one too"
    assert torch.equal(kept, kept.sort().values)


def test_short_sequence_pads_with_keep_false():
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 1, 1])  # valid anchors: 2..5 (the next token is supervised)
    anchors, keep = sample_anchors(loss_mask, 6, sample_generator(0, 0, 0))
    assert keep.tolist() == [True, True, True, True, False, False]
    assert anchors[:4].tolist() == [2, 3, 4, 5] and (anchors[4:] == 0).all()


def test_a_short_reply_at_the_end_of_the_sequence_gets_anchors_and_its_end_early_slots():
    """A reply shorter than a block, ending the sequence: anchored anywhere but on its last
    token, and the end-of-turn token is a label of slot 1 as well as of later slots."""
    ids = torch.arange(100, 112)[None]
    loss_mask = torch.zeros(1, 12, dtype=torch.long)
    loss_mask[0, 8:] = 1  # a 4-token reply: positions 8..11, 11 the end-of-turn token
    anchors, keep = sample_anchors(loss_mask[0], 8, sample_generator(0, 0, 0))
    assert sorted(anchors[keep].tolist()) == [8, 9, 10]
    blocks = make_blocks(ids, loss_mask, torch.tensor([12]), anchors[None], keep[None], B, 0, 7.0)
    labels, weights = blocks.labels.view(-1, B), blocks.weights.view(-1, B)
    slot_of_end = [int((labels[j] == 111).nonzero()[0]) for j in range(3) if weights[j].any()]
    assert 1 in slot_of_end, "the end-of-turn token is taught in slot 1 from the anchor just before it"
    past_end = blocks.positions.view(-1, B) >= 12
    assert not weights[past_end].any(), "slots past the sequence end carry no loss"


def test_anchors_do_not_depend_on_batch_composition():
    ids, loss_mask, lengths = one_batch([20, 24, 17])
    idx = torch.tensor([11, 12, 13])
    full_a, full_k = batch_anchors(loss_mask, lengths, idx, 2, 0, 6)
    alone_a, alone_k = batch_anchors(loss_mask[1:2, :], lengths[1:2], idx[1:2], 2, 0, 6)
    assert torch.equal(full_a[1], alone_a[0]) and torch.equal(full_k[1], alone_k[0])
    # padding the batch wider does not change them either
    wide = torch.nn.functional.pad(loss_mask, (0, 40))
    wide_a, _ = batch_anchors(wide, lengths, idx, 2, 0, 6)
    assert torch.equal(wide_a, full_a)
    # a new epoch redraws
    other, _ = batch_anchors(loss_mask, lengths, idx, 3, 0, 6)
    assert not torch.equal(other, full_a)


def test_labels_are_same_position_and_anchor_has_no_loss():
    ids, loss_mask, lengths = one_batch([20, 24])
    anchors, keep = batch_anchors(loss_mask, lengths, torch.tensor([0, 1]), 0, 0, 3)
    blocks = make_blocks(ids, loss_mask, lengths, anchors, keep, B, MASK, gamma=7.0)
    for r in range(2):
        for j in range(3):
            a = int(anchors[r, j])
            sl = slice(j * B, (j + 1) * B)
            n = int(lengths[r])
            inside = min(B, n - a)  # slots whose position is inside the sequence
            assert blocks.ids[r, sl].tolist() == [int(ids[r, a])] + [MASK] * (B - 1)
            assert blocks.labels[r, sl][:inside].tolist() == ids[r, a : a + inside].tolist(), "label of slot k is token[a+k]"
            assert blocks.positions[r, sl].tolist() == list(range(a, a + B))
            assert blocks.weights[r, j * B] == 0, "the anchor slot carries no loss"
            expected = decay_weights(B, 7.0)[1:] * (torch.arange(1, B) < inside)
            assert torch.allclose(blocks.weights[r, j * B + 1 : (j + 1) * B], expected), "no loss past the end"


def test_no_loss_outside_loss_mask_or_for_padded_anchors():
    ids = torch.arange(30).view(1, 30)
    loss_mask = torch.zeros(1, 30, dtype=torch.long)
    loss_mask[0, 10:12] = 1  # anchor 10 only (11's next token is unsupervised); the other slots are padding
    anchors, keep = batch_anchors(loss_mask, torch.tensor([30]), torch.tensor([0]), 0, 0, 3)
    assert keep.tolist() == [[True, False, False]] and anchors[0, 0].item() == 10
    blocks = make_blocks(ids, loss_mask, torch.tensor([30]), anchors, keep, B, MASK, gamma=7.0)
    assert (blocks.weights[0, :B] > 0).tolist() == [False, True, False, False], "labels 12, 13 are outside the loss mask"
    assert (blocks.weights[0, B:] == 0).all()


def test_decay_weights():
    w = decay_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1.0
    torch.testing.assert_close(w[15], torch.tensor(torch.e ** -2.0))
