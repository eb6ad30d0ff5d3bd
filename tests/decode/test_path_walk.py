"""DFlash2 drafting: the selector's path walk, lossless greedy decoding, the sampling rule."""

import dataclasses

import pytest
import torch
from helpers import tiny_drafter, varied_target

from dflash.decode.selector import propose
from dflash.decode.speculative import accept, context_features, greedy_generate
from dflash.model.drafter import DFlash2Config, DFlashDrafter, TargetHead

pytestmark = pytest.mark.usefixtures("one_thread")

B, VOCAB, MAX_NEW, TOP_K = 4, 96, 24, 5


def dflash2_drafter(seed: int = 0, scale: float = 0.0) -> DFlashDrafter:
    """A tiny DFlash2 drafter; with ``scale`` its convolutions and successor codebook are
    random too, so neither is a no-op and the selector overrules the LM head's argmax."""
    cfg = dataclasses.replace(tiny_drafter(vocab=VOCAB, block_size=B).config, dflash2=DFlash2Config(
        conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=TOP_K))
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    if scale:
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if "conv" in name or "selector" in name:
                    p.normal_(std=scale)
    return drafter.eval()


def hand_walk(drafter, head, hidden, anchor):
    """Greedy path by the formula: at each slot the top-k logit plus
    sum_r P[prev, r] (A h)_r S[c, r], the previous pick as ``prev``."""
    sel = drafter.candidate_selector
    P, S, A = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    prev, out = anchor, []
    for h in hidden:
        z = head.logits(h)
        top = z.topk(TOP_K)
        scores = [float(top.values[j]) + float((P[prev] * (A @ h) * S[c]).sum()) for j, c in enumerate(top.indices)]
        prev = int(top.indices[max(range(TOP_K), key=scores.__getitem__)])
        out.append(prev)
    return out


def selector_decode(target, drafter, head, prompt_ids, max_new):
    """Speculative greedy decoding with the path walk, recomputing the target over the
    whole sequence each cycle (no cache): tokens and acceptance lengths."""
    seq, lengths, ids = prompt_ids[0].tolist(), [], drafter.config.target_layer_ids
    first = len(seq)
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([seq])).logits
        seq.append(int(logits[0, -1].argmax()))
        while len(seq) - first < max_new:
            p = len(seq) - 1
            out = target(input_ids=torch.tensor([seq]), output_hidden_states=True)
            block = torch.tensor([[seq[p]] + [drafter.config.mask_token_id] * (B - 1)])
            hidden = drafter(context_features(out.hidden_states, ids)[:, :p], head.embed(block),
                             torch.arange(p)[None], torch.arange(p, p + B)[None])
            drafts, draft_logits = propose(drafter, head, hidden[0, 1:], seq[p], 0.0)
            verify = target(input_ids=torch.tensor([seq + drafts.tolist()])).logits[0, p:]
            n, bonus = accept(drafts, draft_logits, verify, 0.0)
            seq += drafts[:n].tolist() + [bonus]
            lengths.append(n + 1)
    return seq[first:first + max_new], lengths


def test_greedy_walk_equals_the_formula():
    drafter, head = dflash2_drafter(scale=0.5), TargetHead.of(varied_target(vocab=VOCAB))
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        drafts, _ = propose(drafter, head, hidden, anchor=7, temperature=0.0)
        assert drafts.tolist() == hand_walk(drafter, head, hidden, 7)
        assert drafts.tolist() != head.logits(hidden).argmax(-1).tolist()  # the selector overrules the head


def test_a_new_selector_drafts_the_head_argmax():
    drafter, head = dflash2_drafter(), TargetHead.of(varied_target(vocab=VOCAB))
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        drafts, _ = propose(drafter, head, hidden, anchor=3, temperature=0.0)
        assert drafts.tolist() == head.logits(hidden).argmax(-1).tolist()


def test_greedy_decoding_with_the_walk_is_lossless():
    target = varied_target(vocab=VOCAB)
    drafter, head = dflash2_drafter(scale=0.5), TargetHead.of(target)
    for seed in range(2):
        ids = torch.randint(0, VOCAB - 1, (1, 9), generator=torch.Generator().manual_seed(seed))
        tokens, lengths = selector_decode(target, drafter, head, ids, MAX_NEW)
        assert tokens == greedy_generate(target, ids, MAX_NEW)
        assert all(1 <= n <= B for n in lengths)


def test_sampling_draws_each_slot_from_its_candidate_scores_after_the_previous_draw():
    """At T > 0 the draft logits are the candidate scores (given the drafts before them)
    and -inf elsewhere, so accept's q is softmax(scores / T) over the k candidates."""
    drafter, head = dflash2_drafter(scale=0.5), TargetHead.of(varied_target(vocab=VOCAB))
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    sel = drafter.candidate_selector
    with torch.no_grad():
        drafts, logits = propose(drafter, head, hidden, 11, 0.7, torch.Generator().manual_seed(0))
        unary = head.logits(hidden).topk(TOP_K)
        previous = torch.tensor([11, *drafts[:-1].tolist()])
        scores = unary.values + sel.transition(hidden, previous, unary.indices)
        expected = torch.full_like(logits, -torch.inf).scatter(-1, unary.indices, scores)
    torch.testing.assert_close(logits, expected)
    assert all(int(d) in unary.indices[i].tolist() for i, d in enumerate(drafts))
    q = torch.softmax(logits / 0.7, -1)
    assert torch.allclose(q.sum(-1), torch.ones(6)) and ((q > 0).sum(-1) == TOP_K).all()


def test_a_dflash_drafter_drafts_as_before():
    drafter, head = tiny_drafter(vocab=VOCAB, block_size=B).eval(), TargetHead.of(varied_target(vocab=VOCAB))
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = drafter.draft_logits(head, hidden)
        drafts, got = propose(drafter, head, hidden, 5, 1.0, torch.Generator().manual_seed(4))
    assert torch.equal(got, logits)
    assert torch.equal(drafts, torch.multinomial(torch.softmax(logits, -1), 1, generator=torch.Generator().manual_seed(4))[:, 0])
