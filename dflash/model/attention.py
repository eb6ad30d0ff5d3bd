"""Attention of grouped query heads under a dense mask, without repeating the keys.

SDPA's fused kernels take either an explicit mask or grouped key/value heads, not both:
given both, it runs its math kernel on copies of the keys and values repeated for every
query head (and HF's SDPA path repeats them itself whenever a mask is given). At
decoding shapes those copies were 40% of a batched greedy step's device time on the
H200 (Qwen3-8B, 32 rows, 4 query heads per key/value head; BENCHMARKS.md). Here the
query heads that share a key/value head are stacked as extra query rows of one batched
matmul, so the keys and values are read once and never copied. On CUDA that matmul is
SDPA's own fused call (memory-efficient attention, the mask repeated for the stacked rows):
at verification shapes (64 rows x 16 queries over about 1.5k columns, Qwen3-8B) the math
kernel's float32 scores, mask and softmax were about 14 ms of a 55 ms forward on the H200
(BENCHMARKS.md). On the CPU it is the math kernel's arithmetic in float32 or wider, which
CPU training's dense mask runs too.

Decoding uses it for the target's forwards over its cache (registered with HF as
``GROUPED``, switched on only around them) and for the drafter under a dense mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

GROUPED = "dflash_grouped"


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """Attention of ``q [b, h, n, d]`` over ``k [b, kv, s, d]``, ``v [b, kv, s, dv]``
    (``h`` a multiple of ``kv``; query head ``i`` reads key/value head ``i // (h / kv)``,
    HF's and SDPA's grouping) under ``mask [b or 1, 1, n, s]``: boolean (True attends) or
    additive (finite). Scores and softmax in float32 (or wider); under a boolean mask a query
    that may see no key gets zeros, as SDPA gives it. Returns ``[b, h, n, dv]``."""
    b, h, n, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = h // kv
    if q.is_cuda:
        rows = mask[:, :, None].expand(-1, -1, g, -1, -1).reshape(mask.shape[0], 1, g * n, s)
        out = F.scaled_dot_product_attention(q.reshape(b, kv, g * n, d), k, v, attn_mask=rows, scale=scale)
        if mask.dtype == torch.bool:  # a row that sees nothing: zeros, as on the CPU
            out = out.masked_fill(~rows.any(-1, keepdim=True), 0.0)
        return out.reshape(b, h, n, v.shape[-1])  # SDPA may return it with its heads inner
    scale = d**-0.5 if scale is None else scale
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.reshape(b, kv, g * n, d), k.transpose(-1, -2)).to(wide).view(b, kv, g, n, s) * scale
    if mask.dtype == torch.bool:  # -inf everywhere in a row gives NaN there: zeros, as SDPA
        probs = scores.masked_fill(~mask[:, :, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    else:  # an additive mask holds finite values: no row is empty
        probs = (scores + mask[:, :, None].to(wide)).softmax(-1)
    probs = probs.to(v.dtype).view(b, kv, g * n, s)
    return torch.matmul(probs, v).view(b, h, n, v.shape[-1])


def hf_grouped_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs) -> tuple[torch.Tensor, None]:
    """:func:`grouped_attention` as an HF attention function: output ``[b, n, h, dv]``."""
    return grouped_attention(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED, hf_grouped_attention)


@contextmanager
def attention_implementation(model: nn.Module, name: str) -> Iterator[None]:
    """The HF ``model``'s attention function set to ``name`` for a while (the attention
    layers look it up in the config at every call)."""
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = saved
