"""The DFlash2 selector loss against the formula written out row by row, in float64."""

import pytest
import torch

from dflash.model.selector import CandidateSelector
from dflash.objective.loss import head_loss
from dflash.objective.selector import predecessors, selector_loss, selector_weight

ROWS, HIDDEN, VOCAB, RANK, TOP_K = 12, 8, 20, 4, 5


def setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    selector = CandidateSelector(HIDDEN, VOCAB, RANK, TOP_K).double()
    with torch.no_grad():
        for p in selector.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    hidden = torch.randn(ROWS, HIDDEN, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    logits = hidden.detach() @ head.t()
    # half the labels are each row's 2nd-best token (covered), the rest its worst (not)
    order = logits.argsort(-1, descending=True)
    labels = torch.where(torch.arange(ROWS) % 2 == 0, order[:, 1], order[:, -1])
    prev = torch.randint(0, VOCAB, (ROWS,), generator=g)
    weights = torch.rand(ROWS, generator=g, dtype=torch.float64)
    weights[3] = 0.0
    return selector, hidden, head, labels, prev, weights


def reference(selector, hidden, head, labels, prev, weights):
    """sum_i w_i [y_i in C_i] (logsumexp_{c in C_i} s_ic - s_iy), s_ic = z_ic + sum_r P[p_i,r] (A h_i)_r S[c,r],
    C_i the k largest z_i, row by row."""
    P, S, A = selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight
    total = hidden.new_zeros(())
    for i in range(ROWS):
        z = head @ hidden[i]
        ranked = sorted(range(VOCAB), key=lambda v: -float(z[v].detach()))[:TOP_K]
        if int(labels[i]) not in ranked:
            continue
        gate = P[prev[i]] * (A @ hidden[i])
        s = torch.stack([z[c] + (gate * S[c]).sum() for c in ranked])
        total = total + weights[i] * (torch.logsumexp(s, 0) - s[ranked.index(int(labels[i]))])
    return total


def selector_term(selector, hidden, head, labels, prev, weights, **kwargs):
    """The selector loss over the candidates the head loss's pass returns, as training takes them."""
    head_out = head_loss(hidden, head, labels, weights, top_k=TOP_K)
    return selector_loss(selector.transition, hidden, head, head_out.top_values, head_out.top_ids, labels, prev,
                         weights, **kwargs)


def grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunk_size", [ROWS, 5])
def test_loss_and_gradients_equal_the_formula(chunk_size):
    selector, hidden, head, labels, prev, weights = setup()
    params = [hidden, *selector.parameters()]
    out = selector_term(selector, hidden, head, labels, prev, weights, chunk_size=chunk_size)
    expected = reference(selector, hidden, head, labels, prev, weights)
    torch.testing.assert_close(out.loss_sum.double(), expected, rtol=1e-6, atol=1e-9)
    for got, want in zip(grads(out.loss_sum, params), grads(expected, params)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    covered = (torch.arange(ROWS) % 2 == 0) & (weights > 0)
    assert out.covered == covered.sum()
    assert 0 <= out.correct <= out.covered


def test_stop_gradient_trains_only_the_selector():
    selector, hidden, head, labels, prev, weights = setup(1)
    params = list(selector.parameters())
    out = selector_term(selector, hidden, head, labels, prev, weights, stop_gradient=True)
    expected = reference(selector, hidden, head, labels, prev, weights)
    torch.testing.assert_close(out.loss_sum.double(), expected, rtol=1e-6, atol=1e-9)
    got = torch.autograd.grad(out.loss_sum, [hidden, *params], allow_unused=True)
    assert got[0] is None
    for g, want in zip(got[1:], grads(expected, params)):
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-9)


def test_a_new_selector_scores_the_unary_top_k():
    """At initialisation the successor codebook is zero: the loss is the cross-entropy of
    the label among the unary top-k logits."""
    _, hidden, head, labels, prev, weights = setup(2)
    selector = CandidateSelector(HIDDEN, VOCAB, RANK, TOP_K).double()
    out = selector_term(selector, hidden, head, labels, prev, weights)
    z = hidden.detach() @ head.t()
    top = z.topk(TOP_K, -1)
    hit = top.indices == labels[:, None]
    ce = torch.logsumexp(top.values, -1) - (top.values * hit).sum(-1)
    torch.testing.assert_close(out.loss_sum.double(), (weights * hit.any(-1) * ce).sum())


def test_predecessors_are_the_previous_slot_labels():
    labels = torch.tensor([[10, 11, 12, 13, 20, 21, 22, 23]])  # two blocks of 4, slot 0 the anchor
    assert predecessors(labels, 4).tolist() == [[10, 11, 12, 20, 21, 22]]


def test_weight_schedule_warms_up_then_ramps():
    got = [selector_weight(s, 100, 0.5, warmup=0.1, ramp=0.2) for s in range(100)]
    assert got[:10] == [0.0] * 10
    assert got[10] == pytest.approx(0.5 / 20) and got[28] == pytest.approx(0.5 * 19 / 20)
    assert got[29:] == [0.5] * 71
    assert selector_weight(0, 100, 1.0, 0.0, 0.0) == 1.0


def test_the_codebooks_gradients_are_the_same_every_backward():
    """Many slots share predecessors and candidates, so the codebooks' gradients sum many
    rows per id. With indexing, two CPU threads added them with atomic adds in a varying
    order and DFlash2 runs drifted apart; the sums must not depend on the run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        selector = CandidateSelector(hidden_size=32, vocab_size=50, rank=64, top_k=16)
        torch.nn.init.normal_(selector.successor_codebook, generator=g)
        hidden = torch.randn(2048, 32, generator=g)
        prev, candidates = torch.randint(0, 50, (2048,), generator=g), torch.randint(0, 50, (2048, 16), generator=g)
        scale = torch.randn(2048, 16, generator=g)
        grads = []
        for _ in range(8):
            selector.zero_grad()
            (selector.transition(hidden, prev, candidates) * scale).sum().backward()
            grads.append(torch.cat([selector.predecessor_codebook.grad, selector.successor_codebook.grad]))
        assert all(torch.equal(grads[0], other) for other in grads[1:])
    finally:
        torch.set_num_threads(threads)
