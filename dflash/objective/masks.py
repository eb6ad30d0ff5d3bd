"""The DFlash training attention mask, written once as a flex ``mask_mod``.

Keys are laid out ``[context (S) | block_0 | block_1 | ...]``; queries are the
block tokens. A query of block ``j`` sees context keys strictly before its anchor
(the anchor's own hidden state does not exist yet at inference) and every key of
its own block (bidirectional), never another block; in a packed row, only the
context of its own sample (from the sample's start). A padded block (anchor 0)
sees only itself, so no row is empty and SDPA never yields NaN. A sliding layer's
mask keeps of these only the keys within its window (:func:`dflash_mask_mod`).

The same function gives a flex ``BlockMask`` on CUDA and a dense boolean mask for
SDPA on the CPU (flex_attention has no CPU backward), so the two cannot drift.

The ``BlockMask`` is built by :func:`flex_block_mask` rather than by
``create_block_mask``, whose argsort compiles for minutes (:mod:`dflash.flex`).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from dflash.flex import BLOCK, MaskMod, block_indices, block_mask, block_mask_of


def dflash_mask_mod(anchors: torch.Tensor, ctx_len: int, block_size: int, window: int | None = None,
                    starts: torch.Tensor | None = None, causal: bool = True) -> MaskMod:
    """``anchors`` is ``[b, num_anchors]``; ``ctx_len`` the (padded) context length;
    ``starts`` ``[b, num_anchors]`` where each anchor's sample starts in a packed row
    (``None``: every row is one sample).

    With ``window`` (a sliding layer), the query at position ``p = anchor + slot`` keeps
    of those keys only the ones at positions ``(p - window, p]``: context keys after
    ``p - window``, and the slots of its own block up to its own, at most ``window`` of
    them (z-lab's rule, docs/DESIGN.md section 1); not ``causal``, also the slots after
    its own within ``window`` (z-lab's ``is_causal: false``). A padded block still sees
    its own slot, so no row is empty."""

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        in_ctx = kv_idx < ctx_len
        sees_ctx = in_ctx & (kv_idx < anchors[b, block])
        if starts is not None:
            sees_ctx = sees_ctx & (kv_idx >= starts[b, block])
        same_block = ~in_ctx & ((kv_idx - ctx_len) // block_size == block)
        return sees_ctx | same_block

    if window is None:
        return mask_mod

    def windowed(b, h, q_idx, kv_idx):
        # positions relative to the anchor: the query's is its slot, a context key's is negative
        slot = q_idx % block_size
        key = torch.where(kv_idx < ctx_len, kv_idx - anchors[b, q_idx // block_size], (kv_idx - ctx_len) % block_size)
        ahead = (key <= slot) if causal else (key - slot < window)
        return mask_mod(b, h, q_idx, kv_idx) & ahead & (slot - key < window)

    return windowed


def dense_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Evaluate ``mask_mod`` on the full index grid: ``[batch, 1, q_len, kv_len]`` bool."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    q = torch.arange(q_len, device=device)[None, None, :, None]
    kv = torch.arange(kv_len, device=device)[None, None, None, :]
    return mask_mod(b, torch.zeros_like(b), q, kv)


def flex_block_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device,
                    block: int = BLOCK) -> BlockMask:
    """The ``BlockMask`` that ``create_block_mask(mask_mod, batch, None, q_len, kv_len)``
    gives: ``mask_mod`` evaluated on the grid padded to whole blocks with False, blocks
    that are all set are full, blocks partly set are partial."""
    q_blocks, kv_blocks = -(-q_len // block), -(-kv_len // block)
    b = torch.arange(batch, device=device)[:, None, None]
    q = torch.arange(q_blocks * block, device=device)[None, :, None]
    kv = torch.arange(kv_blocks * block, device=device)[None, None, :]
    inside = (q < q_len) & (kv < kv_len)
    grid = mask_mod(b, torch.zeros_like(b), q.clamp(max=q_len - 1), kv.clamp(max=kv_len - 1)) & inside
    grid = grid.view(batch, 1, q_blocks, block, kv_blocks, block)
    full = grid.all(5).all(3)
    return block_mask_of(grid.any(5).any(3) & ~full, full, mask_mod, q_len, kv_len, block)


MaskParts = tuple[torch.Tensor, ...]


def mask_parts(mask: BlockMask | torch.Tensor) -> MaskParts:
    """A mask as the plain tensors that enter the compiled step: the dense mask, or a
    ``BlockMask``'s block indices (:func:`mask_of_parts` puts it back together)."""
    return block_indices(mask) if isinstance(mask, BlockMask) else (mask,)


def mask_of_parts(parts: MaskParts, anchors: torch.Tensor, ctx_len: int, block_size: int, window: int | None = None,
                  starts: torch.Tensor | None = None, causal: bool = True) -> BlockMask | torch.Tensor:
    """The mask :func:`build_mask` gives for these arguments, from its :func:`mask_parts`:
    the block indices come in, the ``mask_mod`` is made here."""
    if len(parts) == 1:
        return parts[0]
    q_len = anchors.shape[1] * block_size
    mask_mod = dflash_mask_mod(anchors, ctx_len, block_size, window, starts, causal)
    return block_mask(parts, mask_mod, q_len, ctx_len + q_len)


def build_mask(
    anchors: torch.Tensor, ctx_len: int, block_size: int, use_flex: bool, window: int | None = None,
    starts: torch.Tensor | None = None, causal: bool = True,
) -> BlockMask | torch.Tensor:
    """The mask for one micro-batch, as a BlockMask (flex) or a dense bool tensor (SDPA);
    with ``window``, a sliding layer's (its BlockMask skips the tiles outside the window,
    so the layer's attention does not grow with the context); with ``starts``, a packed
    row's (the tiles of other samples are skipped too)."""
    batch, num_anchors = anchors.shape
    q_len = num_anchors * block_size
    kv_len = ctx_len + q_len
    mod = dflash_mask_mod(anchors, ctx_len, block_size, window, starts, causal)
    if use_flex:
        return flex_block_mask(mod, batch, q_len, kv_len, anchors.device)
    return dense_mask(mod, batch, q_len, kv_len, anchors.device)
