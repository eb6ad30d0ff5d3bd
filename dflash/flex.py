"""Flex attention for the drafter's training mask (:mod:`dflash.objective.masks`) and the
target's packed rows (:mod:`dflash.model.target`): ``BlockMask``s built without a sort, and
the choice of kernel every flex call runs (:func:`kernel_options`).

``create_block_mask`` orders block indices with an argsort, which torch <= 2.12 compiles
into a Triton sort kernel that took most of the cold compile at Qwen3-8B shapes
(docs/benchmarks/2026-11-30-h200-compile-warm-starts-checkpoints.md, "Where the compile
time goes"); :func:`ordered_blocks` gives the same order from a cumulative sum.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.nn.attention.flex_attention import BlockMask

if TYPE_CHECKING:
    import sympy

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BLOCK = 128  # flex attention's tile, in queries and keys
# a BlockMask's block-index tensors, in the order of its constructor's keywords
INDICES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
           "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


# The ``kernel_options`` of every flex attention call in this process: None runs Inductor's
# Triton kernels, {"BACKEND": "FLASH"} FlashAttention-4's (:func:`use_flash_kernels`).
_kernel_options: dict[str, str] | None = None


def kernel_options() -> dict[str, str] | None:
    """What every flex attention call of this process passes as ``kernel_options``."""
    return _kernel_options


def flash_unsupported(device: torch.device) -> str | None:
    """Why FlashAttention-4's flex kernels (flex attention's ``FLASH`` backend, CuteDSL) cannot
    run on ``device``; None where they can."""
    if device.type != "cuda":
        return "they run on CUDA devices only"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"{torch.cuda.get_device_name(device)} is compute capability {major}.{minor}; they need 9.x or 10.x"
    if not _findable("flash_attn.cute"):
        return "the flash-attn-4 package is not installed (pip install 'dflash[flash]')"
    if not _findable("cutlass"):
        # Found here, not mid-warmup: Inductor imports it only once it generates the kernels.
        return ("flash-attn-4 is installed but its CuteDSL (the `cutlass` package of nvidia-cutlass-dsl) cannot "
                "be found; reinstall it with pip install 'dflash[flash]'")
    return None


def _findable(module: str) -> bool:
    """Whether ``module`` can be found; a dotted name imports its parent package (a missing parent is not found)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def use_flash_kernels() -> None:
    """Run every flex attention call of this process, the drafter's and the packed prefill's,
    on FlashAttention-4's kernels. On one H200 at Qwen3-8B heads they ran the packed prefill's
    attention 1.4-1.6x and the drafter's forward and backward 1.9x as fast as Inductor's
    Triton kernels, within bf16 rounding of them (BENCHMARKS.md).

    Two changes to Inductor come with them. Graph partitioning is off: torch 2.11's
    partitions left the mask's captured tensors (the anchors) out of the inputs of the
    partition that runs the FLASH backward, which then failed at its first call under CUDA
    graphs; without partitions the step is still one CUDA graph per direction. And torch
    2.11's CuteDSL code generator gains ``index_expr`` (:func:`_add_cutedsl_index_expr`)."""
    import torch._inductor.config

    global _kernel_options
    _add_cutedsl_index_expr()
    torch._inductor.config.graph_partition = False
    _kernel_options = {"BACKEND": "FLASH"}


def _add_cutedsl_index_expr() -> None:
    """An index expression as a scalar of the generated CuteDSL kernel. The FLASH template
    lowers a mask that compares positions through it; torch 2.11's ``CuteDSLOpOverrides``
    lacks it (later versions have their own, which is kept)."""
    import sympy
    from torch._inductor.codegen.cutedsl.cutedsl_op_overrides import CuteDSLOpOverrides
    from torch._inductor.utils import get_bounds_index_expr
    from torch._inductor.virtualized import V

    if "index_expr" in vars(CuteDSLOpOverrides):
        return

    def index_expr(expr: sympy.Expr, dtype: torch.dtype):
        if isinstance(expr, (int, sympy.Integer)):
            return CuteDSLOpOverrides.constant(int(expr), dtype)
        kernel = V.kernel
        scalar = kernel.cse.generate(kernel.body, kernel.kexpr(kernel.rename_indexing(expr)),
                                     bounds=get_bounds_index_expr(expr), dtype=dtype)
        scalar.is_scalar_expr = True
        scalar.index_expr = V.graph.sizevars.simplify(expr)
        return scalar

    CuteDSLOpOverrides.index_expr = staticmethod(index_expr)


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


def block_indices(mask: BlockMask) -> tuple[torch.Tensor, ...]:
    """The block-index tensors of ``mask`` (:data:`INDICES`): with its lengths and
    ``mask_mod``, all :func:`block_mask` needs to make it again."""
    return tuple(getattr(mask, name) for name in INDICES)


def block_mask(indices: tuple[torch.Tensor, ...], mask_mod: MaskMod, q_len: int, kv_len: int,
               block: int = BLOCK) -> BlockMask:
    """A ``BlockMask`` of square ``block`` tiles from its block-index tensors (:data:`INDICES`).

    Each tensor is made contiguous: flex's Triton kernels index them as contiguous and
    ignore their strides, and ``BlockMask`` does not check. Both layouts that broke
    training on the H200 are legal tensors: the query-side indices of a transposed grid
    (a wrong backward once the queries span two tiles) and Inductor's batch stride 3 for
    a ``[2, 1, 1]`` block count (a wrong forward for the second row)."""
    tensors = {name: t.contiguous() for name, t in zip(INDICES, indices)}
    return BlockMask(seq_lengths=(q_len, kv_len), **tensors, BLOCK_SIZE=(block, block), mask_mod=mask_mod)


def block_mask_of(partial: torch.Tensor, full: torch.Tensor, mask_mod: MaskMod, q_len: int, kv_len: int,
                  block: int) -> BlockMask:
    """A ``BlockMask`` from its block grid ``[b, 1, q_blocks, kv_blocks]``: the ``partial``
    blocks (``mask_mod`` decides each entry) and the ``full`` ones; the query-side
    indices (for the backward) are those of the transposed grid."""
    kv_num, kv_indices = ordered_blocks(partial)
    full_kv_num, full_kv_indices = ordered_blocks(full)
    q_num, q_indices = ordered_blocks(partial.transpose(-2, -1))
    full_q_num, full_q_indices = ordered_blocks(full.transpose(-2, -1))
    indices = (kv_num, kv_indices, full_kv_num, full_kv_indices, q_num, q_indices, full_q_num, full_q_indices)
    return block_mask(indices, mask_mod, q_len, kv_len, block)


def packed_causal_mask_mod(position_ids: torch.Tensor) -> MaskMod:
    """Causal attention within each sample of packed rows: ``position_ids [b, S]`` count
    from each sample's first token, so the query at ``q`` sees the keys from its sample's
    start ``q - position_ids[q]`` up to itself."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - position_ids[b, q_idx])

    return mask_mod


def packed_causal_block_mask(position_ids: torch.Tensor, block: int = BLOCK) -> BlockMask:
    """The target's ``BlockMask`` for packed rows (:func:`packed_causal_mask_mod`), built
    from each query block's earliest and latest sample start rather than from every
    (query, key) pair: ``O(S^2 / block^2)`` work where evaluating the mask on the full grid
    is ``O(S^2)`` (a billion entries at 32k tokens), and nothing on the host waits for the
    device. A key block is partial where the query block's earliest start reaches it and
    full where it lies wholly before the query block and after its latest start."""
    batch, length = position_ids.shape
    blocks = -(-length // block)
    index = torch.arange(blocks * block, device=position_ids.device)
    padded = torch.nn.functional.pad(position_ids, (0, blocks * block - length), value=0)
    starts = (index - padded).view(batch, blocks, block)  # a padding row's start is itself: it moves neither bound
    first = starts.amin(-1)[:, None, :, None]
    last = starts.amax(-1)[:, None, :, None]
    i = torch.arange(blocks, device=position_ids.device)
    q_block, kv_block = i[:, None], i[None, :]
    seen = (kv_block <= q_block) & (first <= (kv_block + 1) * block - 1)
    full = (kv_block < q_block) & (last <= kv_block * block)
    return block_mask_of(seen & ~full, full, packed_causal_mask_mod(position_ids), length, length, block)
