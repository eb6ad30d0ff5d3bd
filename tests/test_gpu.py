"""CUDA paths: the drafter with a flex BlockMask equals the dense-mask SDPA path."""

import pytest
import torch

from conftest import tiny_drafter
from dflash.anchors import make_blocks, sample_anchors, sample_generator
from dflash.masks import build_mask

pytestmark = pytest.mark.gpu


def test_drafter_flex_equals_dense_forward_and_backward():
    torch.manual_seed(0)
    bs, seq_len, n = 16, 256, 12
    drafter = tiny_drafter(hidden=128, layer_ids=(1, 2, 3), block_size=bs).cuda()
    ids = torch.randint(0, 90, (2, seq_len), device="cuda")
    loss_mask = torch.zeros(2, seq_len, dtype=torch.long)
    loss_mask[:, 40:] = 1
    drawn = [sample_anchors(loss_mask[r], n, bs, sample_generator(0, 0, r)) for r in range(2)]
    anchors = torch.stack([a for a, _ in drawn]).cuda()
    keep = torch.stack([k for _, k in drawn]).cuda()
    blocks = make_blocks(ids, loss_mask.cuda(), torch.tensor([seq_len] * 2, device="cuda"), anchors, keep, bs, 95, 7.0)
    feats = torch.randn(2, seq_len, 3 * 128, device="cuda")
    embeds = torch.randn(2, n * bs, 128, device="cuda")
    ctx_pos = torch.arange(seq_len, device="cuda").expand(2, -1)
    outs, grads = [], []
    for flex in (True, False):
        drafter.zero_grad()
        mask = build_mask(anchors, seq_len, bs, use_flex=flex)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = drafter(feats, embeds, ctx_pos, blocks.positions, mask)
        out.float().square().mean().backward()
        outs.append(out.float())
        grads.append(torch.cat([p.grad.flatten() for p in drafter.parameters()]))
    torch.testing.assert_close(outs[0], outs[1], atol=3e-2, rtol=3e-2)
    cos = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert cos > 0.999
