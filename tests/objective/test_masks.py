"""The training mask against a brute-force reading of the spec."""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import (
    BlockMask,
    create_block_mask,
    flex_attention,
)

from dflash.data.dataset import Dataset, Sample
from dflash.data.order import collate
from dflash.flex import (
    BLOCK,
    INDICES,
    block_indices,
    block_mask,
    packed_causal_block_mask,
)
from dflash.objective.anchors import AnchorSpec, sample_starts
from dflash.objective.masks import (
    build_mask,
    dense_mask,
    dflash_mask_mod,
    flex_block_mask,
    mask_of_parts,
    mask_parts,
)


def reference_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, window: int | None = None) -> torch.Tensor:
    """Plain loops over docs/DESIGN.md section 1: strict context, bidirectional own block, no
    other block; with ``window``, of those only the keys at positions (p - window, p] for the
    query at position p = anchor + slot."""
    b, n = anchors.shape
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    out = torch.zeros(b, 1, q_len, kv_len, dtype=torch.bool)
    for r in range(b):
        for q in range(q_len):
            j = q // block_size
            p = int(anchors[r, j]) + q % block_size
            for kv in range(kv_len):
                if kv < ctx_len:
                    out[r, 0, q, kv] = kv < int(anchors[r, j])
                    position = kv
                else:
                    out[r, 0, q, kv] = (kv - ctx_len) // block_size == j
                    position = int(anchors[r, j]) + (kv - ctx_len) % block_size
                if window is not None:
                    out[r, 0, q, kv] &= p - window < position <= p
    return out


ANCHORS = torch.tensor([[3, 7, 12, 0], [5, 6, 9, 13]])


def test_dense_mask_matches_spec():
    got = build_mask(ANCHORS, ctx_len=18, block_size=4, use_flex=False)
    assert torch.equal(got, reference_mask(ANCHORS, 18, 4))


@pytest.mark.parametrize("window", [1, 2, 4, 6, 30])
def test_windowed_dense_mask_matches_spec(window):
    got = build_mask(ANCHORS, ctx_len=18, block_size=4, use_flex=False, window=window)
    assert torch.equal(got, reference_mask(ANCHORS, 18, 4, window))
    assert got.any(-1).all(), "every query sees at least itself"


def test_window_counts_the_block_and_measures_from_each_query():
    m = build_mask(ANCHORS, ctx_len=18, block_size=4, use_flex=False, window=3)
    # row 1, block 0: anchor 5, slots at positions 5..8; keys (p - 3, p]
    assert m[1, 0, 0, :18].nonzero().flatten().tolist() == [3, 4]  # slot 0: two context keys and itself
    assert m[1, 0, 1, :18].nonzero().flatten().tolist() == [4]
    assert not m[1, 0, 2, :18].any() and not m[1, 0, 3, :18].any()  # the window is all block
    assert m[1, 0, 0:4, 18:22].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]
    huge, full = build_mask(ANCHORS, 18, 4, False, window=10**6), build_mask(ANCHORS, 18, 4, False)
    assert torch.equal(huge[..., :18], full[..., :18]), "a window past the sequence keeps all the context"
    assert torch.equal(huge[1, 0, 0:4, 18:22], torch.ones(4, 4, dtype=torch.bool).tril()), "and is causal in the block"


@pytest.mark.parametrize("window", [None, 3])
def test_a_mask_put_back_from_its_parts_is_the_mask(window):
    """The trainer builds the masks outside its compiled step and passes them in as plain
    tensors: put back together, a BlockMask has the same block indices, lengths and
    entries, and a dense mask is itself."""
    starts = torch.tensor([[0, 0, 9, 0], [0, 5, 5, 5]])  # packed rows: where each anchor's sample starts
    flex = build_mask(ANCHORS, 18, 4, True, window, starts)
    again = mask_of_parts(mask_parts(flex), ANCHORS, 18, 4, window, starts)
    assert again.seq_lengths == flex.seq_lengths and again.BLOCK_SIZE == flex.BLOCK_SIZE
    assert all(torch.equal(a, b) for a, b in zip(mask_parts(again), mask_parts(flex)))
    dense = build_mask(ANCHORS, 18, 4, False, window, starts)
    assert torch.equal(dense_mask(again.mask_mod, 2, 16, 34, torch.device("cpu")), dense)
    assert mask_of_parts(mask_parts(dense), ANCHORS, 18, 4, window, starts) is dense


def test_sliding_block_mask_skips_tiles_outside_the_window():
    """The flex BlockMask of a sliding layer visits as many key tiles at any context length;
    a full layer's grows with the context."""

    def tiles(ctx_len, window):
        """Key tiles visited by each of the 4 query tiles (8 blocks of 16 each)."""
        anchors = (ctx_len - 512 + torch.arange(32) * 16)[None]  # 32 anchors in the last 512 positions
        bm = build_mask(anchors, ctx_len, 16, use_flex=True, window=window)
        return (bm.kv_num_blocks + bm.full_kv_num_blocks).flatten().tolist()

    # 128 queries see context from 63 before their first anchor to their last one: two
    # context tiles, and the tile of their own blocks
    assert tiles(1024, 64) == tiles(4096, 64) == [3, 3, 3, 3]
    assert tiles(1024, None) == [6, 7, 8, 9] and tiles(4096, None) == [30, 31, 32, 33]


def test_context_is_strictly_before_anchor():
    m = build_mask(ANCHORS, ctx_len=18, block_size=4, use_flex=False)
    # block 0 of row 0 has anchor 3: keys 0,1,2 visible, key 3 (the anchor itself) not
    assert m[0, 0, 0, :3].all() and not m[0, 0, 0, 3]
    # every slot of the block sees the same context
    assert torch.equal(m[0, 0, 0, :18], m[0, 0, 3, :18])


def test_block_is_bidirectional_and_isolated():
    m = build_mask(ANCHORS, ctx_len=18, block_size=4, use_flex=False)
    block0 = m[1, 0, 0:4, 18:22]
    assert block0.all(), "slot 0 must see slot 3 of its own block (no causal mask)"
    assert not m[1, 0, 0:4, 22:].any(), "a block must not see other blocks"


def test_flex_block_mask_matches_dense_on_cpu():
    """The same mask_mod through create_block_mask and flex (CPU forward) equals SDPA with the dense mask."""
    torch.manual_seed(0)
    anchors = torch.tensor([[20, 50, 90, 0], [10, 33, 64, 100]])
    ctx_len, bs = 128, 16
    q_len, kv_len = anchors.shape[1] * bs, ctx_len + anchors.shape[1] * bs
    mod = dflash_mask_mod(anchors, ctx_len, bs)
    bm = create_block_mask(mod, 2, None, q_len, kv_len, device="cpu")
    q = torch.randn(2, 4, q_len, 32)
    k = torch.randn(2, 2, kv_len, 32)
    v = torch.randn(2, 2, kv_len, 32)
    flex = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(mod, 2, q_len, kv_len, torch.device("cpu")), enable_gqa=True)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def assert_same_block_mask(got: BlockMask, want: BlockMask) -> None:
    """Every block-index tensor equal to ``want``'s and contiguous (flex's kernels ignore
    strides: equal values in a transposed layout gave a wrong backward on the H200)."""
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
    for name in INDICES:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0, msg=name)
        assert getattr(got, name).is_contiguous(), f"{name} has strides {getattr(got, name).stride()}"


@pytest.mark.parametrize("ctx_len,num_anchors,block_size,window,packed", [
    (128, 4, 16, None, False), (256, 24, 16, None, False), (200, 9, 10, None, False), (640, 40, 16, None, False),
    (256, 24, 16, 40, False), (640, 40, 16, 7, False), (640, 40, 16, None, True), (640, 40, 16, 40, True),
])
def test_block_mask_equals_create_block_mask(ctx_len, num_anchors, block_size, window, packed):
    """Every tensor of the sort-free BlockMask equals create_block_mask's, padded anchors
    (0), lengths that are not multiples of the 128 block, sliding windows and packed
    rows (each anchor's context from its sample's start) included."""
    g = torch.Generator().manual_seed(ctx_len + num_anchors)
    anchors = torch.randint(1, ctx_len, (3, num_anchors), generator=g).sort(-1).values
    anchors[1, num_anchors // 2:] = 0  # unfilled slots
    anchors[2] = 0
    starts = (anchors // 150) * 150 if packed else None  # samples of 150 tokens side by side
    mod = dflash_mask_mod(anchors, ctx_len, block_size, window, starts)
    q_len = num_anchors * block_size
    kv_len = ctx_len + q_len
    want = create_block_mask(mod, 3, None, q_len, kv_len, device="cpu")
    got = flex_block_mask(mod, 3, q_len, kv_len, torch.device("cpu"))
    assert_same_block_mask(got, want)
    assert torch.equal(got.to_dense(), want.to_dense())


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 24])
def test_flex_matches_dense_sdpa_on_cuda(window):
    torch.manual_seed(0)
    anchors = torch.tensor([[20, 50, 90, 0], [10, 33, 64, 100]], device="cuda")
    ctx_len, bs = 128, 16
    q_len, kv_len = anchors.shape[1] * bs, ctx_len + anchors.shape[1] * bs
    bm = build_mask(anchors, ctx_len, bs, use_flex=True, window=window)
    dense = build_mask(anchors, ctx_len, bs, use_flex=False, window=window)
    q = torch.randn(2, 4, q_len, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, kv_len, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, kv_len, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out_flex = torch.compile(flex_attention)(q, k, v, block_mask=bm, enable_gqa=True)
    grads_flex = torch.autograd.grad(out_flex.float().square().sum(), (q, k, v))
    out_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    grads_sdpa = torch.autograd.grad(out_sdpa.float().square().sum(), (q, k, v))
    torch.testing.assert_close(out_flex, out_sdpa, atol=2e-2, rtol=2e-2)
    for a, b in zip(grads_flex, grads_sdpa):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


def test_compiled_block_order_equals_the_eager_scatter():
    """Compiled, the order of each row's blocks is a reduction rather than a scatter; both
    give every tensor of the BlockMask alike, packed rows and windows included."""
    g = torch.Generator().manual_seed(4)
    anchors = torch.randint(1, 600, (2, 37), generator=g).sort(-1).values
    anchors[1, 20:] = 0
    starts = (anchors // 150) * 150
    mod = dflash_mask_mod(anchors, 600, 16, 40, starts)
    q_len, kv_len = 37 * 16, 600 + 37 * 16
    eager = flex_block_mask(mod, 2, q_len, kv_len, torch.device("cpu"))
    compiled = torch.compile(lambda: flex_block_mask(mod, 2, q_len, kv_len, torch.device("cpu")), backend="aot_eager")()
    assert_same_block_mask(compiled, eager)


def test_block_mask_makes_its_indices_contiguous():
    """Block indices in the layouts that broke training on the H200 (a transposed grid's
    query-side indices; a block count ``[2, 1, 1]`` with batch stride 3, as Inductor laid
    it out) come out of :func:`dflash.flex.block_mask` contiguous and unchanged."""
    anchors = torch.tensor([[40, 90, 130, 200], [10, 60, 150, 220]])
    mod = dflash_mask_mod(anchors, 256, 16)
    want = flex_block_mask(mod, 2, 64, 320, torch.device("cpu"))
    strided = [torch.empty_strided(t.shape, tuple(3 * s for s in t.stride()), dtype=t.dtype).copy_(t)
               for t in block_indices(want)]
    transposed = [t.transpose(-2, -1).contiguous().transpose(-2, -1) if t.dim() == 4 else t for t in strided]
    assert not all(t.is_contiguous() for t in transposed)
    assert_same_block_mask(block_mask(transposed, mod, 64, 320), want)


@pytest.mark.parametrize("lengths", [(300, 212, 500), (128, 128, 256), (1000,), (90, 40, 60, 1, 200, 9), (130, 3, 400, 37), (126, 300, 50)])
def test_packed_causal_block_mask_equals_create_block_mask(lengths):
    """The target's packed-row BlockMask, built from the samples' starts per block, equals
    create_block_mask's evaluation of causal-within-sample on every (query, key) pair: each
    tensor, and the dense mask; rows that are not whole blocks and samples shorter than a
    block included."""
    rows = [torch.cat([torch.arange(n) for n in lengths]), torch.cat([torch.arange(n) for n in reversed(lengths)])]
    position_ids = torch.stack(rows)
    total = position_ids.shape[1]
    starts = torch.arange(total) - position_ids
    want = create_block_mask(lambda b, h, q, kv: (kv <= q) & (starts[b, q] == starts[b, kv]), 2, None, total, total,
                             device="cpu")
    got = packed_causal_block_mask(position_ids)
    assert_same_block_mask(got, want)
    assert torch.equal(got.to_dense(), want.to_dense())
    dense = dense_mask(got.mask_mod, 2, total, total, torch.device("cpu"))[:, 0]
    assert torch.equal(dense, (torch.arange(total)[None, :, None] >= torch.arange(total)[None, None, :])
                       & (starts[:, :, None] == starts[:, None, :]))


def test_random_rows_give_the_block_masks_of_create_block_mask():
    """Seeded random micro-batches, collated as training collates them, through the path the
    trainer takes (``build_mask``, ``mask_parts``, ``mask_of_parts``; the target's
    ``packed_causal_block_mask``): every block-index tensor equals, contiguous,
    ``create_block_mask``'s over a mask written from docs/DESIGN.md section 1 with each
    sample's start taken from the row's layout, and each ``mask_mod`` equals that mask on
    every (query, key) pair. The cases span 1 to 3 rows, block sizes 2 to 16, padded rows,
    lengths under and off the 128 tile, packed rows of up to 6 samples (of length 1,
    starting at a tile's last key, the last ending on a tile), from 1 anchor to every valid
    position and past it (unfilled slots), and windows of 1, a few slots, and more than the
    row, causal or not: the hand-picked cases above miss the corners where a tile holds a
    sample boundary, a padded query or a partly unfilled block."""
    cpu = torch.device("cpu")
    rng = random.Random(0)
    for case in range(30):
        batch, block_size = rng.randint(1, 3), rng.choice([2, 4, 8, 16])
        packed = case % 2 == 1
        rows = []
        for _ in range(batch):
            lengths = [rng.choice([1, rng.randint(2, 9), rng.randint(2, 300)])
                       for _ in range(rng.randint(1, 6) if packed else 1)]
            if case % 5 == 0:
                lengths[-1] += -sum(lengths) % BLOCK
            if case % 4 == 3:
                lengths[0] += -(lengths[0] + 1) % BLOCK  # the next sample starts at a tile's last key
            rows.append(lengths)
        width = max(map(sum, rows)) + rng.choice([0, rng.randint(1, 150)])
        valid = max(sum(n - 1 for n in lengths) for lengths in rows)  # the most anchors a row can hold
        num_anchors = max(1, min(rng.choice([1, rng.randint(1, 12), valid, valid + 2]), 1024 // block_size))
        samples = [Sample([1] * n, [1] * n, "t") for lengths in rows for n in lengths]
        bounds = torch.tensor([0, *map(len, rows)]).cumsum(0).tolist()
        mb = collate(Dataset(samples), 0, [np.arange(lo, hi) for lo, hi in zip(bounds, bounds[1:])], [width], pad_id=0,
                     spec=AnchorSpec(num_anchors, case))
        anchors, position_ids = mb.anchors, mb.position_ids
        first = torch.zeros(batch, width, dtype=torch.long)  # where the sample of each position starts
        for r, lengths in enumerate(rows):
            for at, n in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths):
                first[r, at:] = at
        window = rng.choice([1, rng.randint(2, 2 * block_size), 10**6])
        causal = rng.random() < 0.5
        starts = sample_starts(anchors, position_ids) if packed else None
        q_len = num_anchors * block_size
        kv_len = width + q_len
        for w in (None, window):

            def spec(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
                anchor = anchors[b, q // block_size]
                query = anchor + q % block_size
                position = torch.where(kv < width, kv, anchor + (kv - width) % block_size)
                seen = torch.where(kv < width, (kv >= first[b, anchor]) & (kv < anchor),
                                   (kv - width) // block_size == q // block_size)
                if w is None:
                    return seen
                ahead = (position <= query) if causal else (position - query < w)
                return seen & ahead & (query - position < w)

            built = build_mask(anchors, width, block_size, True, w, starts, causal)
            got = mask_of_parts(mask_parts(built), anchors, width, block_size, w, starts, causal)
            assert_same_block_mask(got, create_block_mask(spec, batch, None, q_len, kv_len, device="cpu"))
            assert torch.equal(dense_mask(got.mask_mod, batch, q_len, kv_len, cpu),
                               dense_mask(spec, batch, q_len, kv_len, cpu)), (case, w)

        def causal_in_sample(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return (kv <= q) & (first[b, kv] == first[b, q])

        target = packed_causal_block_mask(position_ids)
        assert_same_block_mask(target, create_block_mask(causal_in_sample, batch, None, width, width, device="cpu"))
        assert torch.equal(dense_mask(target.mask_mod, batch, width, width, cpu),
                           dense_mask(causal_in_sample, batch, width, width, cpu)), case
