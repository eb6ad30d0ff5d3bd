"""The chunked head loss against a float64 reference, and per-slot metrics."""

import pytest
import torch

from dflash.objective.loss import head_loss, slot_accuracy, tau_sim
from dflash.topk import top_k_of_rows


def reference(hidden, weight, labels, w, t_idx=None, t_logits=None, ce=1.0, kl=0.0):
    logp = (hidden.double() @ weight.double().t()).log_softmax(-1)
    total = ce * (w.double() * -logp.gather(1, labels[:, None]).squeeze(1)).sum()
    if kl:
        t_logp = t_logits.double().log_softmax(-1)
        total = total + kl * (w.double() * (t_logp.exp() * (t_logp - logp.gather(1, t_idx))).sum(-1)).sum()
    return total


def make(rows=37, hidden=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g, requires_grad=True)
    W = torch.randn(vocab, hidden, generator=g)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    w = torch.rand(rows, generator=g) * (torch.rand(rows, generator=g) > 0.3)
    return h, W, labels, w


def test_ce_matches_float64_reference_value_and_gradient():
    h, W, labels, w = make()
    out = head_loss(h, W, labels, w, chunk_size=8)
    (g,) = torch.autograd.grad(out.loss_sum, h)
    h64 = h.detach().double().requires_grad_()
    ref = reference(h64, W, labels, w)
    (g_ref,) = torch.autograd.grad(ref, h64)
    torch.testing.assert_close(out.loss_sum.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("ce, kl", [(0.5, 2.0), (0.0, 1.0), (0.0, 0.0)])
def test_kl_matches_float64_reference(ce, kl):
    """Both terms, the KL alone (the gradient's softmax factor is then kl, not ce + kl), and neither."""
    h, W, labels, w = make(seed=1)
    g = torch.Generator().manual_seed(5)
    t_idx = torch.stack([torch.randperm(50, generator=g)[:6] for _ in range(h.shape[0])])
    t_logits = torch.randn(h.shape[0], 6, generator=g) * 3
    out = head_loss(h, W, labels, w, t_idx, t_logits, ce_weight=ce, kl_weight=kl, chunk_size=5)
    (grad,) = torch.autograd.grad(out.loss_sum, h)
    h64 = h.detach().double().requires_grad_()
    ref = reference(h64, W, labels, w, t_idx, t_logits, ce=ce, kl=kl)
    (g_ref,) = torch.autograd.grad(ref, h64)
    torch.testing.assert_close(out.loss_sum.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), g_ref, rtol=1e-4, atol=1e-6)


def test_top_k_is_the_logits_top_k_and_leaves_the_loss_alone():
    """The DFlash2 selector's candidates come out of the loss's own pass over the head."""
    h, W, labels, w = make(rows=23, seed=2)
    plain = head_loss(h, W, labels, w, chunk_size=5)
    out = head_loss(h, W, labels, w, chunk_size=5, top_k=4)
    top = (h.detach() @ W.t()).topk(4, dim=-1)
    assert plain.top_values is None and out.top_values.dtype == torch.float32
    torch.testing.assert_close(out.top_values, top.values)
    assert torch.equal(out.top_ids, top.indices)
    torch.testing.assert_close(out.loss_sum, plain.loss_sum)
    assert not out.top_values.requires_grad


def test_chunked_equals_unchunked():
    h, W, labels, w = make(rows=64)
    a = head_loss(h, W, labels, w, chunk_size=64)
    b = head_loss(h, W, labels, w, chunk_size=7)
    torch.testing.assert_close(a.loss_sum, b.loss_sum)
    assert torch.equal(a.predictions, b.predictions)
    ga, = torch.autograd.grad(a.loss_sum, h)
    gb, = torch.autograd.grad(b.loss_sum, h)
    torch.testing.assert_close(ga, gb)


def test_slot_accuracy_and_tau_sim():
    # two blocks of 4, slots 1..3 of each (slot 0, the anchor, is never predicted)
    labels = torch.tensor([1, 2, 3, 1, 9, 3])
    preds = torch.tensor([1, 2, 0, 1, 2, 3])
    weights = torch.tensor([1, 1, 1, 1, 1, 1.0])
    correct, counted = slot_accuracy(preds, labels, weights, 4)
    assert correct.tolist() == [0, 2, 1, 1] and counted.tolist() == [0, 2, 2, 2]
    acc = correct / counted.clamp(min=1)
    assert abs(tau_sim(acc) - (1 + 1.0 + 0.5 + 0.25)) < 1e-9


@pytest.mark.parametrize("width, segment", [(200, 8), (203, 8), (64, 8), (40, 8), (1000, 128)])
@pytest.mark.parametrize("kind", ["distinct", "ties", "clustered", "constant"])
def test_top_k_of_rows_gives_the_rows_largest_values(width, segment, kind):
    """Against a sort in plain Python: the same values in the same order, at ids that hold
    them, each id once; rows with many equal values (bf16 logits tie often), with every
    large value in one segment, and constant rows included; widths with and without a
    partial last segment, and with fewer whole segments than k (topk itself)."""
    k = 6
    g = torch.Generator().manual_seed(width + segment)
    if kind == "ties":
        x = torch.randint(0, 4, (9, width), generator=g).to(torch.bfloat16)
    elif kind == "constant":
        x = torch.ones(9, width, dtype=torch.bfloat16)
    else:
        x = torch.randn(9, width, generator=g).to(torch.bfloat16)
        if kind == "clustered":
            x[:, 16 : 16 + k] += 100
    values, ids = top_k_of_rows(x, k, segment)
    for row in range(x.shape[0]):
        expected = sorted(x[row].tolist(), reverse=True)[:k]
        assert values[row].tolist() == expected
        assert x[row, ids[row]].tolist() == expected
        assert len(set(ids[row].tolist())) == k
