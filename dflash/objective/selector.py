"""The DFlash2 selector's training loss, and its weight over the run.

Each drafted slot's selector is taught to pick the label among the LM head's top-k
candidates of that slot, given the label of the slot before (teacher forcing; slot 1's
predecessor is the anchor token): a cross-entropy over the k candidate scores
``logit(c) + transition(h, predecessor, c)``, the transition being the selector's
(``CandidateSelector.transition`` in :mod:`dflash.model.selector`, passed in: this
package knows no model).

The candidates are the strict unary top-k, the set decoding walks. A slot whose label
is not among them adds nothing: the selector could not have chosen it, so the miss is
the unary head's, and the decay-weighted CE already teaches that. The selector term
takes the same decay weights ``w_k`` as the CE and, like it, is returned as a weighted
**sum**, so the trainer's division by the step's total weight normalises both at once
(docs/DESIGN.md, DFlash2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (hidden [..., H], predecessors [...], candidates [..., k]) -> transition scores [..., k]
Transition = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def predecessors(block_labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """The token before each drafted slot (slots 1..B-1), ``[b, n*(B-1)]``, from the
    same-position labels of every slot ``[b, n*B]`` (slot 0's label is the anchor token)."""
    return block_labels.unflatten(1, (-1, block_size))[:, :, :-1].flatten(1, 2)


def widened(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or wider if it already is: bf16 logits would round the scores."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class _CandidateLogits(torch.autograd.Function):
    """The candidates' unary logits ``[rows, k]``, taken as computed by the head loss's pass
    (:func:`dflash.objective.loss.head_loss` with ``top_k``), made differentiable in
    ``hidden``: the gradient is rebuilt from the k head rows of each row, so the full
    ``[rows, V]`` logits are never computed a second time."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head_weight: torch.Tensor, values: torch.Tensor, ids: torch.Tensor):
        ctx.save_for_backward(head_weight, ids)
        ctx.hidden_dtype = hidden.dtype
        return values.clone()

    @staticmethod
    def backward(ctx, grad_values: torch.Tensor):
        head_weight, ids = ctx.saved_tensors
        grad = torch.einsum("nk,nkh->nh", grad_values.to(head_weight.dtype), head_weight[ids])
        return grad.to(ctx.hidden_dtype), None, None, None


@dataclass
class SelectorLoss:
    loss_sum: torch.Tensor  # scalar, sum_i w_i * [label_i in top-k] * CE_i
    covered: torch.Tensor  # scalar, how many weighted slots have their label among the candidates
    correct: torch.Tensor  # scalar, how many of those the selector ranks first (teacher-forced)


def selector_loss(
    transition: Transition,
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    top_values: torch.Tensor,
    top_ids: torch.Tensor,
    labels: torch.Tensor,
    predecessor_ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    stop_gradient: bool = False,
    chunk_size: int = 1024,
) -> SelectorLoss:
    """The selector loss of drafted slots with final-normed ``hidden [rows, H]``, labels,
    predecessors and decay ``weights`` ``[rows]``, over each row's candidates: the
    ``top_values``/``top_ids [rows, k]`` of the frozen ``head_weight [V, H]``'s logits, as
    the head loss's pass returns them, rescored by ``transition``.

    ``stop_gradient`` keeps this term out of the drafter's layers: only the selector's
    own parameters learn from it. Rows are scored ``chunk_size`` at a time."""
    total = widened(hidden.new_zeros(()))
    covered = correct = total.detach().clone()
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        candidates = top_ids[rows]
        if stop_gradient:
            h, unary = hidden[rows].detach(), top_values[rows]
        else:
            h = hidden[rows]
            unary = _CandidateLogits.apply(h, head_weight, top_values[rows], candidates)
        scores = unary + widened(transition(h, predecessor_ids[rows], candidates))
        hit = candidates == labels[rows, None]
        target = hit.int().argmax(-1)
        w = torch.where(hit.any(-1), widened(weights[rows]), 0.0)
        total = total + (w * F.cross_entropy(scores, target, reduction="none")).sum()
        counted = w > 0
        covered = covered + counted.sum()
        correct = correct + (counted & (scores.detach().argmax(-1) == target)).sum()
    return SelectorLoss(total, covered, correct)


def selector_weight(step: int, total_steps: int, alpha: float, warmup: float, ramp: float) -> float:
    """The selector term's weight at optimizer step ``step`` (0-based) of ``total_steps``:
    0 for the first ``warmup * total_steps`` steps, then rising linearly over the next
    ``ramp * total_steps`` to ``alpha``, which it keeps. ``warmup`` and ``ramp`` are
    fractions of the run, as SpecForge's ``dflash2_selector_warmup_ratio`` and
    ``dflash2_selector_ramp_ratio`` are."""
    warmup_steps, ramp_steps = int(total_steps * warmup), int(total_steps * ramp)
    if step < warmup_steps:
        return 0.0
    if ramp_steps <= 0:
        return alpha
    return alpha * min((step - warmup_steps + 1) / ramp_steps, 1.0)
