"""The loss is normalised over the whole optimizer step, never per micro-batch."""

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import flat_grads, tiny_drafter, tiny_head

import dflash.run.step as step_module
from dflash.data.bundle import MicroBatch
from dflash.model.drafter import FULL, SLIDING
from dflash.model.target import PrefillOutput
from dflash.objective.anchors import make_blocks, sample_anchors, sample_generator
from dflash.objective.config import ObjectiveConfig
from dflash.objective.masks import build_mask
from dflash.run.checkpoint import save_checkpoint
from dflash.run.step import (
    DENSE_SCORES_LIMIT,
    DrafterTrainer,
    build_optimizer,
    cosine_schedule,
    dense_scores_bytes,
)

BS = 4


def batch(rows, lengths, seq_len=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(rows)
    ids = torch.randint(0, 90, (n, seq_len), generator=g)
    loss_mask = torch.zeros(n, seq_len, dtype=torch.long)
    for r, length in enumerate(lengths):
        loss_mask[r, 4:length] = 1
    feats = torch.randn(n, seq_len, 3 * 64, generator=g)
    drawn = [sample_anchors(loss_mask[r, :length], 6, sample_generator(0, 0, i)) for r, (i, length) in enumerate(zip(rows, lengths))]
    anchors = torch.stack([a for a, _ in drawn])
    keep = torch.stack([k for _, k in drawn])
    mb = MicroBatch(ids, loss_mask, torch.tensor(lengths), anchors, keep, epoch=0)
    return mb, PrefillOutput(feats)


def split(mb: MicroBatch, pf: PrefillOutput, sl: slice):
    return (
        MicroBatch(mb.input_ids[sl], mb.loss_mask[sl], mb.lengths[sl], mb.anchors[sl], mb.keep[sl], mb.epoch),
        PrefillOutput(pf.features[sl]),
    )


def make_trainer(drafter, sgd: bool = False, autocast: torch.dtype | None = None, packed: bool = False):
    """SGD makes the update the normalised gradient itself; AdamW's first step would hide its scale."""
    opt = torch.optim.SGD(drafter.parameters(), lr=1.0) if sgd else build_optimizer(drafter, 1e-2, 0.0, (0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_schedule(10, 0.0, 0.0))
    obj = ObjectiveConfig(block_size=BS, mask_token_id=95, gamma=7.0, packed=packed)
    return DrafterTrainer(drafter, tiny_head(), obj, opt, sched, grad_clip=1e9, autocast_dtype=autocast)


def autocast_over_masters(drafter) -> DrafterTrainer:
    """The plain mixed-precision reference: fp32 weights that autocast casts at every use."""
    trainer = make_trainer(drafter)
    trainer.autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    return trainer


def test_bf16_compute_weights_train_exactly_as_autocast_over_fp32_masters():
    """Gradients, losses and updated masters equal bit for bit over several steps: the
    compute weights are refreshed after every update, or the second step would differ."""
    base = tiny_drafter(block_size=BS)
    ref, held = autocast_over_masters(copy.deepcopy(base)), make_trainer(copy.deepcopy(base), autocast=torch.bfloat16)
    linear = [m.weight for m in held.compute.modules() if isinstance(m, torch.nn.Linear)]
    assert linear and all(w.dtype == torch.bfloat16 for w in linear)
    assert all(p.dtype == torch.float32 for p in held.drafter.parameters())
    for step in range(3):
        mb, pf = batch(rows=[0, 1, 2, 3], lengths=[32, 12, 30, 9], seed=step)
        for sl in (slice(0, 2), slice(2, 4)):
            for trainer in (ref, held):
                trainer.micro_step(*split(mb, pf, sl))
            assert torch.equal(flat_grads(ref), flat_grads(held))
        m_ref, m_held = ref.finish(), held.finish()
        assert m_ref["loss"] == m_held["loss"] and m_ref["grad_norm"] == m_held["grad_norm"]
        for a, b in zip(ref.drafter.parameters(), held.drafter.parameters()):
            assert torch.equal(a, b)
    for master, compute in zip(held.drafter.parameters(), held.compute.parameters()):
        assert torch.equal(master.to(compute.dtype), compute)


def test_restore_refreshes_the_compute_weights(tmp_path):
    """A resumed trainer computes with the checkpoint's weights, not its own initial ones."""
    trained = make_trainer(tiny_drafter(block_size=BS), autocast=torch.bfloat16)
    trained.micro_step(*batch(rows=[0, 1], lengths=[32, 20]))
    trained.finish()
    path = save_checkpoint(tmp_path, 1, trained.drafter, trained.optimizer, trained.scheduler, keep=1)
    resumed = make_trainer(tiny_drafter(block_size=BS, seed=7), autocast=torch.bfloat16)
    assert resumed.restore(path) == 1
    mb, pf = batch(rows=[2, 3], lengths=[30, 9], seed=1)
    for trainer in (trained, resumed):
        trainer.micro_step(mb, pf)
    assert torch.equal(flat_grads(trained), flat_grads(resumed))


@pytest.mark.parametrize("attention", [{}, {"layer_types": [SLIDING, FULL], "sliding_window": 5}],
                         ids=["full", "sliding"])
def test_micro_step_equals_a_float64_loss_over_every_block_slot(attention):
    """The step takes logits only at the drafted slots 1..B-1. A float64 loss with logits at
    every slot, the anchor's included (with its zero weight), has the same value and the
    same gradients. With a sliding layer, the reference gives it the windowed mask."""
    base, head = tiny_drafter(block_size=BS, **attention), tiny_head()
    mb, pf = batch(rows=[0, 1], lengths=[32, 20])
    trainer = make_trainer(copy.deepcopy(base))
    trainer.micro_step(mb, pf)

    ref = copy.deepcopy(base).double()
    blocks = make_blocks(mb.input_ids, mb.loss_mask, mb.lengths, mb.anchors, mb.keep, BS, 95, 7.0)
    seq_len = mb.input_ids.shape[1]
    mask = build_mask(mb.anchors, seq_len, BS, False)
    if attention:
        mask = {FULL: mask, SLIDING: build_mask(mb.anchors, seq_len, BS, False, window=attention["sliding_window"])}
    hidden = ref(
        pf.features.double(), F.embedding(blocks.ids, head.embed_weight.double()),
        torch.arange(seq_len).expand(2, seq_len), blocks.positions, mask,
    )
    nll = F.cross_entropy((hidden @ head.lm_head_weight.double().T).flatten(0, 1), blocks.labels.flatten(), reduction="none")
    loss = (blocks.weights.double().flatten() * nll).sum()
    loss.backward()
    assert (blocks.weights.view(-1, BS)[:, 0] == 0).all() and (nll.view(-1, BS)[:, 0] > 0).all()
    torch.testing.assert_close(trainer.stats.loss_sum.double(), loss.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(trainer.stats.weight_sum.double(), blocks.weights.double().sum(), rtol=1e-6, atol=0)
    grads = torch.cat([p.grad.flatten() for p in ref.parameters()])
    torch.testing.assert_close(flat_grads(trainer).double(), grads, rtol=1e-4, atol=1e-6)


def test_replaced_gradient_buffers_are_refused():
    """Without autocast the buffers sit on the drafter's own linear layers: a later
    ``.double()`` swaps them for copies, and the optimizer would see only the norms train."""
    trainer = make_trainer(tiny_drafter(block_size=BS))
    trainer.micro_step(*batch(rows=[0, 1], lengths=[32, 20]))
    trainer.drafter.double()
    with pytest.raises(RuntimeError, match="gradient buffers were replaced"):
        trainer.finish()


def test_drafter_and_loss_must_agree_on_the_block_size():
    with pytest.raises(ValueError, match="block size"):
        make_trainer(tiny_drafter(block_size=BS + 1))


def test_accumulation_equals_one_big_micro_batch():
    base = tiny_drafter(block_size=BS)
    mb, pf = batch(rows=[0, 1, 2, 3], lengths=[32, 12, 30, 9])  # uneven: weight sums differ per half

    one = make_trainer(copy.deepcopy(base), sgd=True)
    one.micro_step(mb, pf)
    m_one = one.finish()

    two = make_trainer(copy.deepcopy(base), sgd=True)
    for sl in (slice(0, 2), slice(2, 4)):
        two.micro_step(*split(mb, pf, sl))
    m_two = two.finish()

    assert abs(m_one["loss"] - m_two["loss"]) < 1e-5
    for a, b in zip(one.drafter.parameters(), two.drafter.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_per_micro_batch_normalisation_would_differ():
    """Guard that the batch above can tell the two normalisations apart."""
    mb, pf = batch(rows=[0, 1, 2, 3], lengths=[32, 12, 30, 9])
    sums = []
    for sl in (slice(0, 2), slice(2, 4)):
        t = make_trainer(tiny_drafter(block_size=BS))
        t.micro_step(*split(mb, pf, sl))
        sums.append(float(t.stats.weight_sum))
    assert abs(sums[0] - sums[1]) > 1.0


def test_step_without_valid_anchor_is_skipped():
    t = make_trainer(tiny_drafter(block_size=BS))
    before = [p.detach().clone() for p in t.drafter.parameters()]
    mb, pf = batch(rows=[0], lengths=[32])
    mb.keep.zero_()
    t.micro_step(mb, pf)
    assert t.finish() is None
    assert all(torch.equal(a, b) for a, b in zip(before, t.drafter.parameters()))


def test_training_reduces_loss_on_a_fixed_batch():
    t = make_trainer(tiny_drafter(block_size=BS))
    mb, pf = batch(rows=[0, 1], lengths=[32, 28])
    losses = []
    for _ in range(8):
        t.micro_step(mb, pf)
        losses.append(t.finish()["loss"])
    assert losses[-1] < losses[0]


def test_an_eager_cuda_step_attends_densely_where_its_scores_stay_small(monkeypatch):
    """Flex attention compiles a kernel pair per shape; an eager GPU step at small shapes
    takes the dense mask, which compiles nothing, and a compiled one always flex's."""
    trainer = make_trainer(tiny_drafter(block_size=BS))
    trainer.device = types.SimpleNamespace(type="cuda")  # _mask_parts reads only the device's type
    anchors = torch.tensor([[3, 20], [5, 40]])
    positions = torch.arange(64).expand(2, 64)
    config = trainer.drafter.config
    scores = dense_scores_bytes(2, 2 * BS, 64, config.num_attention_heads, config.num_layers)
    assert scores == 4 * 2 * config.num_attention_heads * (2 * BS) * (64 + 2 * BS) * config.num_layers
    assert len(trainer._mask_parts(anchors, positions)[FULL]) == 1  # dense: one bool tensor
    monkeypatch.setattr(step_module, "DENSE_SCORES_LIMIT", scores - 1)
    assert len(trainer._mask_parts(anchors, positions)[FULL]) > 1  # a BlockMask's block indices
    monkeypatch.setattr(step_module, "DENSE_SCORES_LIMIT", 1 << 40)
    trainer.compiled = True
    assert len(trainer._mask_parts(anchors, positions)[FULL]) > 1
    trainer.device = torch.device("cpu")
    assert len(trainer._mask_parts(anchors, positions)[FULL]) == 1


def test_the_paper_shapes_are_too_large_to_attend_densely_and_the_demo_small():
    paper = dense_scores_bytes(2, 512 * 16, 3072, 32, 5)
    demo = dense_scores_bytes(8, 16 * 16, 320, 4, 5)
    assert paper > 100 * DENSE_SCORES_LIMIT and demo < DENSE_SCORES_LIMIT / 10
