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

The ``BlockMask`` is built here rather than by ``create_block_mask``: that one
orders block indices with an argsort, which torch <= 2.12 compiles into a Triton
sort kernel that took 154 s of the 207 s cold compile at Qwen3-8B shapes
(BENCHMARKS.md "Where the compile time goes"). :func:`flex_block_mask` gives the
same tensors from a cumulative sum (:func:`ordered_blocks`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


def ordered_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a block-level mask ``[..., rows, cols]``: how many columns are set, and
    every column index with the set ones first, each group ascending: the stable
    descending argsort flex uses, computed from each column's position in its group.

    Eager, the positions are a cumulative sum and one scatter puts each column there.
    Compiled, the cumulative sum is a product with a triangular matrix (exact in
    float64) and the order a sum over the columns, ``order[j] = sum_c c * (slot[c] == j)``,
    which Inductor fuses into one reduction: torch 2.11's Triton codegen failed on the
    scan and the scatter over the transposed mask at long-context shapes (rows of 8k
    and 32k tokens), and a sort compiles for minutes."""
    d = dense.to(torch.int32)
    cols = torch.arange(dense.shape[-1], device=dense.device, dtype=torch.int32)
    if torch.compiler.is_compiling():
        upper = (cols[:, None] <= cols[None, :]).double()
        through = (dense.double() @ upper).to(torch.int32)  # set columns up to each column, itself included
        count = through[..., -1]
        slot = torch.where(dense, through - 1, count[..., None] + cols - through)
        return count, ((slot[..., None, :] == cols[:, None]) * cols).sum(-1, dtype=torch.int32)
    count = d.sum(-1, dtype=torch.int32)
    slot = torch.where(dense, d.cumsum(-1) - 1, count[..., None] + (1 - d).cumsum(-1) - 1)
    return count, torch.empty_like(d).scatter_(-1, slot.long(), cols.expand_as(d))


def flex_block_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device,
                    block: int = 128) -> BlockMask:
    """The ``BlockMask`` that ``create_block_mask(mask_mod, batch, None, q_len, kv_len)``
    gives: ``mask_mod`` evaluated on the grid padded to whole blocks with False, blocks
    that are all set are full, blocks partly set are partial, and the query-side
    indices (for the backward) are those of the transposed block grid."""
    q_blocks, kv_blocks = -(-q_len // block), -(-kv_len // block)
    b = torch.arange(batch, device=device)[:, None, None]
    q = torch.arange(q_blocks * block, device=device)[None, :, None]
    kv = torch.arange(kv_blocks * block, device=device)[None, None, :]
    inside = (q < q_len) & (kv < kv_len)
    grid = mask_mod(b, torch.zeros_like(b), q.clamp(max=q_len - 1), kv.clamp(max=kv_len - 1)) & inside
    grid = grid.view(batch, 1, q_blocks, block, kv_blocks, block)
    full = grid.all(5).all(3)
    partial = grid.any(5).any(3) & ~full
    kv_num, kv_indices = ordered_blocks(partial)
    full_kv_num, full_kv_indices = ordered_blocks(full)
    q_num, q_indices = ordered_blocks(partial.transpose(-2, -1))
    full_q_num, full_q_indices = ordered_blocks(full.transpose(-2, -1))
    return BlockMask(
        seq_lengths=(q_len, kv_len),
        kv_num_blocks=kv_num,
        kv_indices=kv_indices,
        full_kv_num_blocks=full_kv_num,
        full_kv_indices=full_kv_indices,
        q_num_blocks=q_num,
        q_indices=q_indices,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_indices,
        BLOCK_SIZE=(block, block),
        mask_mod=mask_mod,
    )


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
