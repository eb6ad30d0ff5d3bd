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


def anchor_keys(loss_mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A uniform random key per position of one unpadded sample ``[L]``, 2.0 where no
    anchor may sit: anchors go to response tokens whose next token is a response token.

    A block may run past the end of the reply or of the sequence: ``make_blocks``
    gives those slots no loss. Requiring room for a whole block instead would never
    anchor in a reply's last ``B - 1`` tokens, so its end (the end-of-turn token
    above all) would be taught only in late, lightly weighted slots, while at
    serving time the drafter drafts from anchors right there. A sample's last token
    has no next token of its own, so it is never an anchor, packed or not."""
    supervised = loss_mask.bool()
    valid = supervised & torch.cat([supervised[1:], supervised.new_zeros(1)])
    return torch.where(valid, torch.rand(loss_mask.shape[0], generator=generator), 2.0)


def choose_anchors(keys: torch.Tensor, num_anchors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``num_anchors`` positions of the smallest keys below 1: ``anchors [n]`` sorted
    ascending (unfilled slots are 0 and sit at the end) and ``keep [n]``.

    ``keys`` covers one row: a sample, or the samples of a packed row side by side, each
    keyed by its own generator. Taking the smallest keys of the row draws its anchors
    uniformly among all its valid positions, and a sample's share depends only on the
    samples it is packed with, never on the rank or the micro-batch split."""
    length = keys.shape[0]
    if length < num_anchors:
        keys = torch.cat([keys, torch.full((num_anchors - length,), 3.0)])
    chosen = keys.topk(num_anchors, largest=False).indices
    keep = keys[chosen] < 1.0
    anchors = torch.where(keep, chosen, 0)
    order = torch.where(keep, anchors, length + num_anchors).argsort(stable=True)
    return anchors[order], keep[order]


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors of one unpadded sample ``[L]`` alone in its row (:func:`anchor_keys`,
    :func:`choose_anchors`)."""
    return choose_anchors(anchor_keys(loss_mask, generator), num_anchors)


@dataclass
class Blocks:
    ids: torch.Tensor  # [b, n*B] anchor token then MASK ids
    positions: torch.Tensor  # [b, n*B] RoPE positions in the anchor's sample, anchor..anchor+B-1
    labels: torch.Tensor  # [b, n*B] token at the same position (not shifted)
    weights: torch.Tensor  # [b, n*B] decay weight, 0 where there is no loss
    label_positions: torch.Tensor  # [b, n*B] where each label sits in the row
    starts: torch.Tensor  # [b, n] the row index where each anchor's sample starts


def sample_starts(anchors: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Where the sample of each anchor starts in its row, ``[b, n]``: a position id counts
    from its sample's first token."""
    return anchors - position_ids.gather(1, anchors)


def make_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    position_ids: torch.Tensor | None = None,
) -> Blocks:
    """Blocks ``[token[a], MASK x (B-1)]`` and their same-position labels, with no host sync.

    ``position_ids [b, S]`` restart at 0 where each packed sample starts (``None``: one
    sample per row, ``0..S-1``). A block's positions count in its anchor's sample, and
    its slots past that sample's end carry no loss: the next sample's tokens are not
    what the drafter would be asked for at that position."""
    seq_len = input_ids.shape[1]
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device).expand_as(input_ids)
    offsets = torch.arange(block_size, device=input_ids.device)
    index = anchors[..., None] + offsets  # [b, n, B] row indices
    gather_at = index.clamp(max=seq_len - 1).flatten(1)
    starts = sample_starts(anchors, position_ids)
    in_sample = (index - position_ids.gather(1, gather_at).view_as(index)) == starts[..., None]
    labels = input_ids.gather(1, gather_at)
    anchor_tokens = input_ids.gather(1, anchors)
    ids = torch.where(offsets == 0, anchor_tokens[..., None], mask_token_id).flatten(1)
    has_loss = (
        keep[..., None]
        & (index < lengths[:, None, None])
        & in_sample
        & (offsets >= 1)
    ).flatten(1) & loss_mask.gather(1, gather_at).bool()
    weights = decay_weights(block_size, gamma, input_ids.device).repeat(anchors.shape[1])
    weights = torch.where(has_loss, weights, 0.0)
    return Blocks(ids, (index - starts[..., None]).flatten(1), labels, weights, gather_at, starts)

