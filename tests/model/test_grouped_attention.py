"""Grouped-query attention under a dense mask against SDPA with repeated keys, in float64."""

import pytest
import torch
import torch.nn.functional as F

from dflash.model.attention import grouped_attention


def inputs(b=2, heads=6, kv=2, n=5, s=9, d=8, dv=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, kv, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, kv, s, dv, generator=g, dtype=torch.float64)
    mask = torch.rand(b, 1, n, s, generator=g) < 0.6
    mask[0, 0, 1] = False  # a query that sees nothing
    return q, k, v, mask


def reference(q, k, v, mask, scale=None):
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask,
                                         scale=scale)
    return out.nan_to_num(0.0)


@pytest.mark.parametrize("kv", [1, 2, 6])
def test_boolean_mask_equals_sdpa_with_repeated_keys(kv):
    q, k, v, mask = inputs(kv=kv)
    got = grouped_attention(q, k, v, mask)
    torch.testing.assert_close(got, reference(q, k, v, mask), rtol=1e-10, atol=1e-10)
    assert torch.equal(got[0, :, 1], torch.zeros_like(got[0, :, 1]))  # nothing to see: zeros, as SDPA


def test_additive_mask_and_scale_as_hf_passes_them():
    q, k, v, mask = inputs(seed=1)
    mask[0, 0, 1, 0] = True
    additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, torch.finfo(torch.float64).min)
    got = grouped_attention(q, k, v, additive, scale=0.3)
    torch.testing.assert_close(got, reference(q, k, v, mask, scale=0.3), rtol=1e-10, atol=1e-10)
