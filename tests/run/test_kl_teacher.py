"""KL teacher alignment: slot k of the block anchored at a is taught by the target's
logits at position a+k-1 (the target's logits at p predict token p+1, and slot k is
labelled with token a+k, README "How it trains").

Checked three ways, each against something computed here and not by the step:
the gathered teacher row by row against a hand loop; with a real target's greedy
continuation as data, the gathered teacher's top-1 equals the label on every slot
with loss; and with a one-hot teacher, KL-only training equals CE-only training
(same loss, same gradients).
"""

import copy

import pytest
import torch
from helpers import flat_grads, greedy_reference, tiny_drafter, tiny_head, varied_target

import dflash.run.step as step_module
from dflash.data.bundle import MicroBatch
from dflash.model.drafter import TargetHead
from dflash.model.target import PrefillOutput, Target
from dflash.objective.config import ObjectiveConfig
from dflash.run.step import DrafterTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

B, VOCAB, HIDDEN, S, TOPK = 4, 96, 64, 24, 3
MASK = VOCAB - 1
ANCHORS = torch.tensor([[0, 5, 11, 17, 0], [1, 4, 9, 13, 18]])
KEEP = torch.tensor([[True, True, True, True, False], [True, True, True, True, True]])
LENGTHS = torch.tensor([24, 22])


def trainer(drafter, ce: float, kl: float, head=None) -> DrafterTrainer:
    opt = torch.optim.SGD(drafter.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    obj = ObjectiveConfig(block_size=B, mask_token_id=MASK, gamma=2.0, ce_weight=ce, kl_weight=kl, chunk_size=16)
    return DrafterTrainer(drafter, head if head is not None else tiny_head(), obj, opt, sched, 1e9, None)


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK, (2, S), generator=g)
    loss_mask = torch.ones(2, S, dtype=torch.long)
    loss_mask[1, 20:] = 0  # padding of row 1
    batch = MicroBatch(ids, loss_mask, LENGTHS.clone(), ANCHORS.clone(), KEEP.clone(), epoch=0)
    features = torch.randn(2, S, 3 * HIDDEN, generator=g)
    return batch, features


@pytest.fixture
def captured(monkeypatch):
    """What the step hands to the head loss: labels, weights and the gathered teacher."""
    seen = {}
    original = step_module.head_loss

    def spy(hidden, head_weight, labels, weights, teacher_idx=None, teacher_logits=None, *args, **kwargs):
        seen.update(labels=labels.detach().clone(), weights=weights.detach().clone(),
                    teacher_idx=None if teacher_idx is None else teacher_idx.detach().clone(),
                    teacher_logits=None if teacher_logits is None else teacher_logits.detach().clone())
        return original(hidden, head_weight, labels, weights, teacher_idx, teacher_logits, *args, **kwargs)

    monkeypatch.setattr(step_module, "head_loss", spy)
    return seen


def test_teacher_of_slot_k_is_the_target_at_a_plus_k_minus_1(captured):
    batch, features = data()
    g = torch.Generator().manual_seed(3)
    topk_indices = torch.stack([torch.randperm(VOCAB, generator=g)[:TOPK] for _ in range(2 * S)]).view(2, S, TOPK)
    topk_values = torch.randn(2, S, TOPK, generator=g).sort(-1, descending=True).values
    t = trainer(tiny_drafter(block_size=B), ce=0.0, kl=1.0)
    t.micro_step(batch, PrefillOutput(features, topk_values, topk_indices))

    n = ANCHORS.shape[1]
    # the loss sees the drafted slots 1..B-1 of each block: index k - 1 is slot k
    t_idx = captured["teacher_idx"].view(2, n, B - 1, TOPK)
    t_val = captured["teacher_logits"].view(2, n, B - 1, TOPK)
    labels = captured["labels"].view(2, n, B - 1)
    weights = captured["weights"].view(2, n, B - 1)
    checked = 0
    for r in range(2):
        for j in range(n):
            a = int(ANCHORS[r, j])
            for k in range(1, B):
                if weights[r, j, k - 1] == 0:
                    continue
                assert int(labels[r, j, k - 1]) == int(batch.input_ids[r, a + k]), (r, j, k)
                assert torch.equal(t_idx[r, j, k - 1], topk_indices[r, a + k - 1]), (r, j, k)
                assert torch.equal(t_val[r, j, k - 1], topk_values[r, a + k - 1]), (r, j, k)
                checked += 1
    # row 0: four kept blocks of 3 slots; row 1: four full blocks, and the one at 18 keeps
    # only slot 1 (position 19; 20 and 21 have no loss)
    assert checked == 4 * 3 + 4 * 3 + 1


def test_real_targets_teacher_top1_equals_the_label_on_its_own_greedy_text(captured):
    """Data = the target's own greedy continuation, so the target's top-1 at p is token
    p+1: a correctly aligned teacher agrees with the label on every slot with loss."""
    model = varied_target(vocab=VOCAB)
    prompt_len = 4
    rows = [greedy_reference(model, [7 + r, 30 + r, 50, 3 * r + 1], S) for r in range(2)]
    ids = torch.tensor(rows)
    assert len(set(ids[:, prompt_len:].flatten().tolist())) > 4, "the continuation must vary"
    loss_mask = torch.zeros(2, S, dtype=torch.long)
    loss_mask[:, prompt_len:] = 1
    anchors = torch.tensor([[4, 7, 12, 19], [5, 9, 14, 20]])
    batch = MicroBatch(ids, loss_mask, torch.tensor([S, S]), anchors, torch.ones_like(anchors, dtype=torch.bool), 0)
    prefill = Target(model, [1, 2, 3]).prefill(ids, topk=TOPK)
    head = TargetHead.of(model)
    t = trainer(tiny_drafter(block_size=B), ce=0.0, kl=1.0, head=head)
    t.micro_step(batch, prefill)

    has_loss = captured["weights"] > 0
    assert int(has_loss.sum()) == 4 * (B - 1) * 2
    teacher_top1 = captured["teacher_idx"][:, 0]
    assert torch.equal(teacher_top1[has_loss], captured["labels"][has_loss])


def one_hot_teacher(ids: torch.Tensor, shift: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k whose softmax is exactly one-hot on token p+shift (the others at -1e4 have
    probability exactly 0 in float32), with distinct decoys behind it."""
    b, s = ids.shape
    nxt = ids.gather(1, (torch.arange(s) + shift).clamp(0, s - 1).expand(b, s))
    decoys = torch.stack([(nxt + 1 + i) % MASK for i in range(TOPK - 1)], dim=-1)
    indices = torch.cat([nxt[..., None], decoys], dim=-1)
    values = torch.full((b, s, TOPK), -1e4)
    values[..., 0] = 0.0
    return values, indices


def test_kl_on_a_one_hot_next_token_teacher_equals_ce():
    batch, features = data(seed=5)
    base = tiny_drafter(block_size=B)
    base.reset_parameters(0.3)  # away from the near-uniform init, so CE and its gradient are not trivial

    ce = trainer(copy.deepcopy(base), ce=1.0, kl=0.0)
    ce.micro_step(batch, PrefillOutput(features))
    kl = trainer(copy.deepcopy(base), ce=0.0, kl=1.0)
    kl.micro_step(batch, PrefillOutput(features, *one_hot_teacher(batch.input_ids)))

    assert float(ce.stats.weight_sum) > 0
    torch.testing.assert_close(kl.stats.loss_sum, ce.stats.loss_sum, rtol=1e-5, atol=1e-6)
    assert flat_grads(ce).abs().max() > 1e-4
    torch.testing.assert_close(flat_grads(kl), flat_grads(ce), rtol=1e-4, atol=1e-7)


def test_a_misaligned_teacher_would_differ():
    """Guard: the comparison above tells the alignments apart (teacher on token p, not p+1)."""
    batch, features = data(seed=5)
    base = tiny_drafter(block_size=B)
    base.reset_parameters(0.3)
    ce = trainer(copy.deepcopy(base), ce=1.0, kl=0.0)
    ce.micro_step(batch, PrefillOutput(features))
    kl = trainer(copy.deepcopy(base), ce=0.0, kl=1.0)
    kl.micro_step(batch, PrefillOutput(features, *one_hot_teacher(batch.input_ids, shift=0)))
    assert abs(float(kl.stats.loss_sum) - float(ce.stats.loss_sum)) > 1e-2 * float(ce.stats.loss_sum)
