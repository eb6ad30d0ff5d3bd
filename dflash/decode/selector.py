"""Drafting a block's tokens from the drafter's hidden states: the LM head's choice for a
DFlash drafter, the selector's path walk for a DFlash2 drafter.

The walk follows z-lab's ``CandidateSelector.select`` (z-lab/dflash ``dflash/model.py``):
each drafted slot keeps the LM head's top-k candidates, scores them with the selector
given the token drafted at the slot before (the anchor for slot 1), and takes the best
(temperature 0) or samples ``softmax(scores / T)`` over the k candidates. That candidate
distribution is the draft distribution speculative sampling divides by, so the target's
distribution is kept at any temperature.
"""

from __future__ import annotations

import torch

from dflash.model.drafter import DFlashDrafter, TargetHead


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits`` ``[n, V]``: argmax at temperature 0."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def walk(
    selector,
    hidden: torch.Tensor,
    unary: torch.Tensor,
    candidates: torch.Tensor,
    anchor: int,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The path through ``candidates [n, k]`` of the ``n`` drafted slots with hidden states
    ``hidden [n, H]`` and unary logits ``unary [n, k]``: the picked tokens ``[n]`` and each
    slot's candidate scores ``[n, k]`` (given the picks before it)."""
    picks, scores = [], []
    previous = torch.tensor([anchor], device=hidden.device)
    for i in range(hidden.shape[0]):
        s = unary[i] + selector.transition(hidden[i : i + 1], previous, candidates[i : i + 1])[0].float()
        previous = candidates[i, sample(s[None], temperature, generator)]
        picks.append(previous)
        scores.append(s)
    return torch.cat(picks), torch.stack(scores)


def propose(
    drafter: DFlashDrafter,
    head: TargetHead,
    hidden: torch.Tensor,
    anchor: int,
    temperature: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts ``[n]`` for the drafted slots with final-normed ``hidden [n, H]`` after the
    ``anchor`` token, and the draft logits ``[n, V]`` whose softmax at ``temperature`` is
    the distribution they were drawn from (what :func:`dflash.decode.speculative.accept`
    needs). A DFlash2 drafter's logits are its candidate scores, ``-inf`` elsewhere."""
    logits = drafter.draft_logits(head, hidden)
    if drafter.config.dflash2 is None:
        return sample(logits, temperature, generator), logits
    selector = drafter.candidate_selector
    unary, candidates = logits.topk(selector.top_k, dim=-1)
    drafts, scores = walk(selector, hidden, unary, candidates, anchor, temperature, generator)
    return drafts, torch.full_like(logits, -torch.inf).scatter(-1, candidates, scores)
