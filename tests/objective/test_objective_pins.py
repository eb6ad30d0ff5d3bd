"""Regression pins of the objective: behaviours whose silent breakage would still train,
each checked against an independent reference (a hand count, a hand formula) rather than
against the code under test."""

import pytest
import torch

from dflash.objective.loss import default_gamma, slot_accuracy, tau_sim

# docs/DESIGN.md: "7 for B=16, 5 for B=10, 4 for B=8, else max(1, (B-2)/2)", worked by hand.
HAND_GAMMA = {2: 1.0, 3: 1.0, 4: 1.0, 5: 1.5, 6: 2.0, 7: 2.5, 9: 3.5, 12: 5.0, 14: 6.0, 20: 9.0, 32: 15.0}


@pytest.mark.parametrize("block_size", sorted(HAND_GAMMA))
def test_default_gamma_of_other_block_sizes_follows_the_documented_rule(block_size: int):
    """Block sizes the paper does not name get ``max(1, (B-2)/2)`` (DESIGN.md): a float,
    never below 1, so the decay ``exp(-(k-1)/gamma)`` stays finite and not too steep."""
    got = default_gamma(block_size)
    assert isinstance(got, float)
    assert got == HAND_GAMMA[block_size]


def test_slot_accuracy_and_tau_sim_ignore_zero_weight_slots():
    """Slots without loss (padding, unkept anchors, prompt tokens) are neither counted nor
    correct, so ``acc_k`` and ``tau_sim`` describe only trained slots (checked by a plain loop)."""
    block, blocks = 5, 12
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (blocks * (block - 1),), generator=g)
    predictions = torch.where(torch.rand(labels.shape, generator=g) < 0.6, labels, (labels + 1) % 4)
    weights = torch.rand(labels.shape, generator=g) * (torch.rand(labels.shape, generator=g) < 0.5)
    weights[3::4] = 0.0  # slot 4 has no loss anywhere: counted 0, accuracy 0
    # the zero-weight slots are all right: counting them would raise every accuracy
    predictions[weights == 0] = labels[weights == 0]

    correct, counted = [0] * block, [0] * block
    for i, (p, y, w) in enumerate(zip(predictions.tolist(), labels.tolist(), weights.tolist())):
        slot = 1 + i % (block - 1)
        if w > 0:
            counted[slot] += 1
            correct[slot] += p == y
    got_correct, got_counted = slot_accuracy(predictions, labels, weights, block)
    assert got_correct.tolist() == correct and got_counted.tolist() == counted
    assert counted[0] == 0 and counted[4] == 0 and min(counted[1:4]) > 0

    acc = [c / n if n else 0.0 for c, n in zip(correct, counted)]
    expected_tau, run = 1.0, 1.0
    for a in acc[1:]:
        run *= a
        expected_tau += run
    got_acc = got_correct / got_counted.clamp(min=1)  # float32, as DrafterTrainer.finish reports it
    assert abs(tau_sim(got_acc) - expected_tau) < 1e-6
    assert 1.0 < expected_tau < 2.0 and acc[1] < 1.0
