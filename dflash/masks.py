"""The DFlash training attention mask, written once as a flex ``mask_mod``.

Keys are laid out ``[context (S) | block_0 | block_1 | ...]``; queries are the
block tokens. A query of block ``j`` sees context keys strictly before its anchor
(the anchor's own hidden state does not exist yet at inference) and every key of
its own block (bidirectional), never another block. A padded block (anchor 0)
sees only itself, so no row is empty and SDPA never yields NaN.

The same function gives a flex ``BlockMask`` on CUDA and a dense boolean mask for
SDPA on the CPU (flex_attention has no CPU backward), so the two cannot drift.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dflash_mask_mod(anchors: torch.Tensor, ctx_len: int, block_size: int) -> MaskMod:
    """``anchors`` is ``[b, num_anchors]``; ``ctx_len`` the (padded) context length."""

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        in_ctx = kv_idx < ctx_len
        sees_ctx = in_ctx & (kv_idx < anchors[b, block])
        same_block = ~in_ctx & ((kv_idx - ctx_len) // block_size == block)
        return sees_ctx | same_block

    return mask_mod


def dense_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Evaluate ``mask_mod`` on the full index grid: ``[batch, 1, q_len, kv_len]`` bool."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    q = torch.arange(q_len, device=device)[None, None, :, None]
    kv = torch.arange(kv_len, device=device)[None, None, None, :]
    return mask_mod(b, torch.zeros_like(b), q, kv)


@functools.cache
def compiled_create_block_mask():
    """Eager ``create_block_mask`` evaluates the mask over the full grid; compiled, it does not."""
    return torch.compile(create_block_mask)


def build_mask(
    anchors: torch.Tensor, ctx_len: int, block_size: int, use_flex: bool
) -> BlockMask | torch.Tensor:
    """The mask for one micro-batch, as a BlockMask (flex) or a dense bool tensor (SDPA)."""
    batch, num_anchors = anchors.shape
    q_len = num_anchors * block_size
    kv_len = ctx_len + q_len
    mod = dflash_mask_mod(anchors, ctx_len, block_size)
    if use_flex:
        # Inside a compiled step the mask is traced with the rest; outside, compile it alone.
        make = create_block_mask if torch.compiler.is_compiling() else compiled_create_block_mask()
        return make(mod, batch, None, q_len, kv_len, device=anchors.device)
    return dense_mask(mod, batch, q_len, kv_len, anchors.device)
