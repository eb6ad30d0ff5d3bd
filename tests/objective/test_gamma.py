"""The loss decay: gamma's defaults and the per-slot weights exp(-(k-1)/gamma), against float64 by hand."""

import math

import pytest
import torch
from helpers import tiny_drafter, tiny_head

from dflash.data.bundle import MicroBatch
from dflash.model.target import PrefillOutput
from dflash.objective.anchors import make_blocks
from dflash.objective.loss import decay_weights, default_gamma


def hand_weights(block_size: int, gamma: float) -> torch.Tensor:
    """README: slot 0 (the anchor) has no loss; slot k >= 1 weighs exp(-(k-1)/gamma)."""
    return torch.tensor([0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block_size)], dtype=torch.float64)


def test_default_gamma_is_the_papers():
    assert default_gamma(16) == 7
    assert default_gamma(10) == 5
    assert default_gamma(8) == 4


@pytest.mark.parametrize("block_size, gamma", [(16, None), (10, None), (8, None), (16, 2.5), (5, 0.7)])
def test_decay_weights_match_float64(block_size, gamma):
    gamma = gamma if gamma is not None else default_gamma(block_size)
    got = decay_weights(block_size, gamma)
    assert got.shape == (block_size,)
    torch.testing.assert_close(got.double(), hand_weights(block_size, gamma), rtol=2e-7, atol=1e-12)
    assert got[0] == 0 and got[1] == 1


def test_paper_weights_spot_values():
    """B=16, gamma=7: slot 8 weighs e^-1, slot 15 e^-2 (no off-by-one in k-1)."""
    w = decay_weights(16, default_gamma(16)).double()
    assert abs(float(w[8]) - math.exp(-1)) < 1e-7
    assert abs(float(w[15]) - math.exp(-2)) < 1e-7


def test_blocks_carry_the_decay_where_there_is_loss():
    """make_blocks' weights, slot by slot, against a loop over the README rule:
    decay weight if the label position is a response token inside the sequence,
    the anchor slot and unkept anchors get 0."""
    B, gamma, S = 8, 4.0, 30
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 90, (2, S), generator=g)
    lengths = torch.tensor([30, 21])
    loss_mask = torch.zeros(2, S, dtype=torch.long)
    loss_mask[0, 3:] = 1
    loss_mask[1, 5:12] = 1  # a gap: positions 12.. have no loss
    loss_mask[1, 15:21] = 1
    anchors = torch.tensor([[3, 10, 22, 0], [5, 9, 15, 0]])
    keep = torch.tensor([[True, True, True, False], [True, True, True, False]])
    blocks = make_blocks(ids, loss_mask, lengths, anchors, keep, B, 95, gamma)
    ref = hand_weights(B, gamma)
    expected = torch.zeros(2, anchors.shape[1] * B, dtype=torch.float64)
    for r in range(2):
        for j in range(anchors.shape[1]):
            for k in range(B):
                pos = int(anchors[r, j]) + k
                if keep[r, j] and k >= 1 and pos < int(lengths[r]) and loss_mask[r, pos]:
                    expected[r, j * B + k] = ref[k]
    torch.testing.assert_close(blocks.weights.double(), expected, rtol=2e-7, atol=1e-12)
    assert (expected > 0).sum() > 10


def test_trainer_passes_decayed_weights_to_the_loss(monkeypatch):
    """What the drafter step hands to the head loss (and normalises by) is the decay above."""
    import dflash.run.step as step_module
    from dflash.objective.config import ObjectiveConfig
    from dflash.run.step import DrafterTrainer

    B, gamma, S = 4, 1.7, 20
    seen = {}
    original = step_module.head_loss

    def spy(hidden, head_weight, labels, weights, *args, **kwargs):
        seen["weights"] = weights.detach().clone()
        return original(hidden, head_weight, labels, weights, *args, **kwargs)

    monkeypatch.setattr(step_module, "head_loss", spy)
    drafter = tiny_drafter(block_size=B)
    opt = torch.optim.SGD(drafter.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    trainer = DrafterTrainer(
        drafter, tiny_head(), ObjectiveConfig(block_size=B, mask_token_id=95, gamma=gamma), opt, sched, 1e9, None
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 90, (1, S), generator=g)
    anchors = torch.tensor([[2, 6, 11]])
    batch = MicroBatch(ids, torch.ones(1, S, dtype=torch.long), torch.tensor([S]), anchors, torch.ones(1, 3, dtype=torch.bool), 0)
    trainer.micro_step(batch, PrefillOutput(torch.randn(1, S, 3 * 64, generator=g)))
    expected = hand_weights(B, gamma)[1:].repeat(3)  # the loss sees slots 1..B-1; slot 0 has none
    torch.testing.assert_close(seen["weights"].double().flatten(), expected, rtol=2e-7, atol=1e-12)
    torch.testing.assert_close(trainer.stats.weight_sum.double(), expected.sum(), rtol=1e-6, atol=0)
