"""Decoding keeps the drafter's context as every layer's keys and values per position
(:meth:`DFlashDrafter.context_kv`); the forward over them equals the forward over the
projected context, in float64."""

import pytest
import torch
from helpers import tiny_drafter

from dflash.decode.batch import drafter_masks
from dflash.model.drafter import FULL, SLIDING, ContextKV


@pytest.mark.parametrize("layer_types,window", [(None, None), ([SLIDING, FULL], 5)], ids=["full", "sliding"])
def test_the_forward_over_kept_keys_and_values_equals_the_forward_over_the_context(layer_types, window):
    drafter = tiny_drafter(layer_types=layer_types, sliding_window=window).double()
    drafter.reset_parameters(0.3)
    g = torch.Generator().manual_seed(0)
    rows, length, block = 3, 11, drafter.config.block_size
    context = drafter.context(torch.randn(rows, length, 3 * 64, generator=g, dtype=torch.float64), torch.float64)
    ctx_positions = torch.arange(length).expand(rows, -1)
    block_positions = torch.tensor([[11], [9], [6]]) + torch.arange(block)
    valid = ctx_positions < block_positions[:, :1]  # rows of 11, 9 and 6 positions
    embeds = torch.randn(rows, block, 64, generator=g, dtype=torch.float64)
    masks = drafter_masks(drafter, valid, ctx_positions, block_positions)
    want = drafter(context, embeds, ctx_positions, block_positions, masks, projected=True)
    kept = ContextKV.of_flat(drafter.context_kv(context, ctx_positions).flat(), drafter.config.num_key_value_heads)
    got = drafter(kept, embeds, ctx_positions, block_positions, masks)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    alone = drafter(context[2:, :6], embeds[2:], ctx_positions[2:, :6], block_positions[2:], projected=True)
    torch.testing.assert_close(got[2:], alone, rtol=1e-12, atol=1e-12)  # a masked row is its own context alone
