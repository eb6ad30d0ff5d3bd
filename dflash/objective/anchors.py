"""Anchor sampling and block construction for one micro-batch.

Every sequence gets a **fixed** number of anchors (static shapes); slots that
cannot be filled carry ``keep=False``. A sequence's anchors are drawn from its
own generator, seeded by (seed, epoch, sample index), so they never depend on
which other sequences share the batch, how the batch is split into
micro-batches, or how many ranks there are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash.objective.loss import decay_weights


@dataclass(frozen=True)
class AnchorSpec:
    """How anchors are drawn: how many per sequence, from which seed."""

    num_anchors: int
    seed: int


def sample_generator(seed: int, epoch: int, sample_index: int) -> torch.Generator:
    state = np.random.SeedSequence([seed, epoch, sample_index]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors uniformly among response tokens whose next token is a response token.

    A block may run past the end of the reply or of the sequence: ``make_blocks``
    gives those slots no loss. Requiring room for a whole block instead would never
    anchor in a reply's last ``B - 1`` tokens, so its end (the end-of-turn token
    above all) would be taught only in late, lightly weighted slots, while at
    serving time the drafter drafts from anchors right there.

    ``loss_mask`` is one unpadded sequence ``[L]``. Returns ``anchors [n]`` sorted
    ascending (unfilled slots are 0 and sit at the end) and ``keep [n]``.
    """
    length = loss_mask.shape[0]
    supervised = loss_mask.bool()
    valid = supervised & torch.cat([supervised[1:], supervised.new_zeros(1)])
    keys = torch.rand(length, generator=generator)
    keys = torch.where(valid, keys, 2.0)
    if length < num_anchors:
        keys = torch.cat([keys, torch.full((num_anchors - length,), 3.0)])
    chosen = keys.topk(num_anchors, largest=False).indices
    keep = keys[chosen] < 1.0
    anchors = torch.where(keep, chosen, 0)
    order = torch.where(keep, anchors, length + num_anchors).argsort(stable=True)
    return anchors[order], keep[order]


@dataclass
class Blocks:
    ids: torch.Tensor  # [b, n*B] anchor token then MASK ids
    positions: torch.Tensor  # [b, n*B] absolute positions anchor..anchor+B-1
    labels: torch.Tensor  # [b, n*B] token at the same position (not shifted)
    weights: torch.Tensor  # [b, n*B] decay weight, 0 where there is no loss
    label_positions: torch.Tensor  # [b, n*B] where each label sits in the sequence


def make_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> Blocks:
    """Blocks ``[token[a], MASK x (B-1)]`` and their same-position labels, with no host sync."""
    seq_len = input_ids.shape[1]
    offsets = torch.arange(block_size, device=input_ids.device)
    positions = anchors[..., None] + offsets  # [b, n, B]
    gather_at = positions.clamp(max=seq_len - 1).flatten(1)
    labels = input_ids.gather(1, gather_at)
    anchor_tokens = input_ids.gather(1, anchors)
    ids = torch.where(offsets == 0, anchor_tokens[..., None], mask_token_id).flatten(1)
    has_loss = (
        keep[..., None]
        & (positions < lengths[:, None, None])
        & (offsets >= 1)
    ).flatten(1) & loss_mask.gather(1, gather_at).bool()
    weights = decay_weights(block_size, gamma, input_ids.device).repeat(anchors.shape[1])
    weights = torch.where(has_loss, weights, 0.0)
    return Blocks(ids, positions.flatten(1), labels, weights, gather_at)

