"""The drafter really uses the training mask (CPU path: dense mask, SDPA).

Block j of the training forward must equal an inference-style forward (no mask)
over the context ``features[:a_j]`` and that block alone; nothing at or after the
anchor and nothing of another block may reach it; context before the anchor must.
With sliding layers (docs/DESIGN.md section 1), the same against the forward
speculative decoding runs: the context cut to the last ``window - 1`` positions when
every layer slides, the sliding layers' window applied by the drafter itself.
In float64, so the only differences are real ones.
"""

import pytest
import torch
from helpers import tiny_drafter, tiny_head

from dflash.model.drafter import FULL, SLIDING
from dflash.objective.masks import build_mask

pytestmark = pytest.mark.usefixtures("one_thread")

B, VOCAB, HIDDEN, S = 4, 96, 64, 20
MASK = VOCAB - 1
# row 0 has an unfilled slot (anchor 0, keep False): it sees only its own block
ANCHORS = torch.tensor([[2, 6, 13, 0], [1, 7, 9, 15]])
TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    drafter = tiny_drafter(block_size=B).double().eval()
    drafter.reset_parameters(0.2)  # larger weights: the context visibly moves the outputs
    drafter.double()
    head = tiny_head()
    head.embed_weight.data = head.embed_weight.data.double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MASK, (2, S), generator=g)
    features = torch.randn(2, S, 3 * HIDDEN, generator=g, dtype=torch.float64)
    return drafter, head, ids, features


def block_ids(ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """README: block j is [token[a_j], MASK x (B-1)]; built here by hand."""
    out = torch.full((ids.shape[0], anchors.shape[1] * B), MASK)
    for r in range(ids.shape[0]):
        for j in range(anchors.shape[1]):
            out[r, j * B] = ids[r, anchors[r, j]]
    return out


def train_forward(drafter, head, features, blk_ids, anchors=ANCHORS):
    b, s = features.shape[:2]
    positions = (anchors[..., None] + torch.arange(B)).flatten(1)
    mask = build_mask(anchors, s, B, use_flex=False)
    window = drafter.config.sliding_window
    if window is not None:
        mask = {FULL: mask, SLIDING: build_mask(anchors, s, B, use_flex=False, window=window,
                                                causal=drafter.config.sliding_causal)}
    with torch.no_grad():
        out = drafter(features, head.embed(blk_ids), torch.arange(s).expand(b, s), positions, mask)
    return out.view(b, anchors.shape[1], B, -1)


def infer_forward(drafter, head, features_row, blk_row, anchor):
    """One block with its context cut at the anchor and no mask, as speculative decoding runs
    it; when every layer slides, the context also starts where the first slot's window does."""
    start = 0
    if drafter.config.layer_types is not None and FULL not in drafter.config.layer_types:
        start = max(0, anchor - (drafter.config.sliding_window - 1))
    with torch.no_grad():
        return drafter(
            features_row[None, start:anchor],
            head.embed(blk_row[None]),
            torch.arange(start, anchor)[None],
            torch.arange(anchor, anchor + B)[None],
        )[0]


@pytest.fixture(scope="module")
def blocks(setup):
    """The hand-built block ids of ``setup`` (tests change copies of them)."""
    _, _, ids, _ = setup
    return block_ids(ids, ANCHORS)


@pytest.fixture(scope="module")
def base(setup, blocks):
    """The training forward of ``setup``: what every change is compared with."""
    drafter, head, _, features = setup
    return train_forward(drafter, head, features, blocks)


def with_context_changed(setup, blocks, r: int, where) -> torch.Tensor:
    """The training forward after row ``r``'s context features at ``where`` (an index or a
    slice of positions) are moved by large noise."""
    drafter, head, _, features = setup
    changed = features.clone()
    changed[r, where] += torch.randn_like(changed[r, where]) * 3
    return train_forward(drafter, head, changed, blocks)


def test_each_block_equals_inference_on_its_truncated_context(setup, blocks, base):
    drafter, head, _, features = setup
    assert base.dtype == torch.float64
    for r in range(2):
        for j in range(ANCHORS.shape[1]):
            a = int(ANCHORS[r, j])
            ref = infer_forward(drafter, head, features[r], blocks[r, j * B : (j + 1) * B], a)
            torch.testing.assert_close(base[r, j], ref, **TOL, msg=f"row {r} block {j} (anchor {a})")


def test_context_at_or_after_the_anchor_is_invisible(setup, blocks, base):
    r, j = 1, 1
    a = int(ANCHORS[r, j])
    after = with_context_changed(setup, blocks, r, slice(a, None))
    torch.testing.assert_close(after[r, j], base[r, j], **TOL)
    torch.testing.assert_close(after[r, : j + 1], base[r, : j + 1], **TOL)  # earlier anchors too
    assert (after[r, j + 1 :] - base[r, j + 1 :]).abs().max() > 1e-3  # later anchors do see it
    torch.testing.assert_close(after[1 - r], base[1 - r], **TOL)  # nor the other sequence


def test_context_just_before_the_anchor_is_visible(setup, blocks, base):
    r, j = 1, 1
    a = int(ANCHORS[r, j])
    for pos in (a - 1, 0):
        after = with_context_changed(setup, blocks, r, pos)
        assert (after[r, j] - base[r, j]).abs().max() > 1e-4, f"feature at {pos} < anchor {a} did not reach block {j}"
        # every slot of the block sees it, not only the anchor slot
        assert ((after[r, j] - base[r, j]).abs().amax(-1) > 1e-6).all()


def test_other_blocks_are_invisible(setup, blocks, base):
    drafter, head, _, features = setup
    r, j = 1, 2
    changed = blocks.clone()
    for other in range(ANCHORS.shape[1]):
        if other != j:
            changed[r, other * B] = (changed[r, other * B] + 17) % MASK  # another anchor token
            changed[r, other * B + 2] = 5  # a slot that was MASK
    after = train_forward(drafter, head, features, changed)
    torch.testing.assert_close(after[r, j], base[r, j], **TOL)
    assert (after[r, j - 1] - base[r, j - 1]).abs().max() > 1e-4  # the changed blocks did change


def test_own_block_is_bidirectional(setup, blocks, base):
    """The anchor slot sees the later slots of its block (no causal mask inside a block)."""
    drafter, head, _, features = setup
    changed = blocks.clone()
    changed[0, 1 * B + 3] = 5  # last slot of block 1, row 0
    after = train_forward(drafter, head, features, changed)
    assert (after[0, 1, 0] - base[0, 1, 0]).abs().max() > 1e-4


def test_unfilled_slot_sees_only_itself(setup, blocks, base):
    drafter, head, _, features = setup
    ref = infer_forward(drafter, head, features[0], blocks[0, 3 * B :], 0)  # empty context
    torch.testing.assert_close(base[0, 3], ref, **TOL)


# ---------------------------------------------------------------------------
# Sliding layers
# ---------------------------------------------------------------------------

ALL_SLIDING = [SLIDING, SLIDING]


@pytest.fixture(scope="module", params=[(ALL_SLIDING, 3, True), (ALL_SLIDING, 6, True), ([SLIDING, FULL], 3, True),
                                        (ALL_SLIDING, 3, False), (ALL_SLIDING, 2, False), ([SLIDING, FULL], 2, False)],
                ids=["all-sliding-3", "all-sliding-6", "mixed-3", "all-sliding-3-both-ways", "all-sliding-2-both-ways",
                     "mixed-2-both-ways"])
def sliding(setup, request):
    """``setup``'s drafter, weights and all, with sliding layers (causal, or looking both ways
    as z-lab's ``is_causal: false`` makes them); and its training forward."""
    drafter, head, ids, features = setup
    layer_types, window, causal = request.param
    slider = tiny_drafter(block_size=B, layer_types=layer_types, sliding_window=window,
                          sliding_causal=causal).double().eval()
    slider.load_state_dict(drafter.state_dict())
    blocks = block_ids(ids, ANCHORS)
    return slider, head, features, blocks, train_forward(slider, head, features, blocks)


def test_sliding_block_equals_inference_on_its_windowed_context(sliding):
    drafter, head, features, blocks, trained = sliding
    for r in range(2):
        for j in range(ANCHORS.shape[1]):
            a = int(ANCHORS[r, j])
            ref = infer_forward(drafter, head, features[r], blocks[r, j * B : (j + 1) * B], a)
            torch.testing.assert_close(trained[r, j], ref, **TOL, msg=f"row {r} block {j} (anchor {a})")


def test_context_before_every_window_is_invisible(sliding):
    drafter, head, features, blocks, trained = sliding
    r, j = 1, 3
    a, w = int(ANCHORS[r, j]), drafter.config.sliding_window
    changed = features.clone()
    changed[r, : a - w + 1] += torch.randn_like(changed[r, : a - w + 1]) * 3  # before slot 0's window
    after = train_forward(drafter, head, changed, blocks)
    if FULL in drafter.config.layer_types:  # a full layer still reads it
        assert (after[r, j] - trained[r, j]).abs().max() > 1e-4
    else:
        torch.testing.assert_close(after[r, j], trained[r, j], **TOL)
    changed[r, a - w + 1] += 3  # the oldest key of slot 0's window
    assert (train_forward(drafter, head, changed, blocks)[r, j, 0] - trained[r, j, 0]).abs().max() > 1e-4


def test_sliding_layers_look_ahead_in_the_block_only_when_not_causal(sliding):
    """Causal sliding layers keep a slot from the later ones; looking both ways, a change
    to a slot reaches the earlier slots within two windows of it (one per layer), and none
    further back (without a full layer to carry it)."""
    drafter, head, features, blocks, trained = sliding
    changed = blocks.clone()
    changed[0, 1 * B + 3] = 5  # last slot of block 1, row 0
    after = train_forward(drafter, head, features, changed)
    moved = (after[0, 1, :3] - trained[0, 1, :3]).abs().amax(-1)
    w = drafter.config.sliding_window
    if FULL in drafter.config.layer_types:  # the full layer is bidirectional
        assert moved.max() > 1e-4
    elif drafter.config.sliding_causal:
        assert moved.max() == 0
    else:  # two layers: slot 3 reaches the slots within two windows of it, and no further
        reach = max(0, 3 - 2 * (w - 1))
        assert (moved[reach:] > 1e-6).all()
        assert (moved[:reach] == 0).all()
