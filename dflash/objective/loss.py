"""Decay-weighted cross-entropy (and optional KL) through the frozen LM head, chunked.

``anchors * B x vocab`` fp32 logits are never materialised at once: rows are
processed ``chunk_size`` at a time, and since the LM head is frozen the only
gradient needed is the one of the drafter's hidden states, which is computed
chunk by chunk in the forward and handed back in the backward. The autograd
graph therefore holds ``[rows, H]``, not ``[rows, V]``.

The returned loss is a weighted **sum**; the trainer divides the gradients by
the sum of weights over the whole optimizer step (all micro-batches, all
drafter ranks), so the split into micro-batches never changes training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import dflash.objective.xent  # noqa: F401  (registers torch.ops.dflash.softmax_xent)
from dflash.objective.selector import widened
from dflash.topk import SEGMENT, top_k_of_rows


def decay_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """``w_k = exp(-(k-1)/gamma)`` for block slot k >= 1; slot 0 (the anchor) has no loss."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), 0.0)


def default_gamma(block_size: int) -> float:
    """The paper's decay: 7 for B=16, 5 for B=10, 4 for B=8; max(1, (B-2)/2) for other sizes."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, (block_size - 2) / 2))


def teacher_at(
    label_positions: torch.Tensor, topk_values: torch.Tensor, topk_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k (indices, logits) that teach each drafted slot, ``[rows, k]``.

    Slot k of a block is labelled with the token at position ``a + k``; the target
    predicts that token from position ``a + k - 1``, so its logits there are the
    teacher. ``label_positions [b, m]`` are the ``a + k`` of the drafted slots
    (``m = n*(B-1)``, ``model.drafter.drafted``).
    """
    at = (label_positions - 1).clamp(min=0)[..., None]
    k = topk_indices.shape[-1]
    return topk_indices.gather(1, at.expand(-1, -1, k)).flatten(0, 1), topk_values.gather(1, at.expand(-1, -1, k)).flatten(0, 1)


@dataclass
class LossOutput:
    loss_sum: torch.Tensor  # scalar, sum_i w_i * (ce_weight * ce_i + kl_weight * kl_i)
    predictions: torch.Tensor  # [rows] argmax of the drafter logits
    top_values: torch.Tensor | None = None  # [rows, k] the k largest logits, in float32 or wider (top_k > 0)
    top_ids: torch.Tensor | None = None  # [rows, k] their token ids


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, teacher_idx, teacher_logits, ce_weight, kl_weight, chunk_size,
                top_k):
        total = hidden.new_zeros((), dtype=torch.float32)
        grads, predictions, top_values, top_ids = [], [], [], []
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = hidden[rows] @ head_weight.t()
            w = weights[rows].float()
            # d/dlogits of sum_i w_i (ce * nll_i + kl * kl_i): w * ((ce + kl) * p - ce * onehot - kl * teacher)
            lse, label_logit, argmax, grad_logits, maxima = torch.ops.dflash.softmax_xent(
                logits, labels[rows], (ce_weight + kl_weight) * w, ce_weight * w, SEGMENT if top_k else 0
            )
            if ce_weight:
                total = total + ce_weight * (w * (lse - label_logit)).sum()
            if kl_weight:
                # The teacher's top-k columns get their exact gradient, rounded once.
                idx = teacher_idx[rows]
                t_log_probs = teacher_logits[rows].float().log_softmax(-1)
                t_probs = t_log_probs.exp()
                log_probs = logits.gather(1, idx).float() - lse[:, None]
                kl = (t_probs * (t_log_probs - log_probs)).sum(-1)
                total = total + kl_weight * (w * kl).sum()
                at_idx = (ce_weight + kl_weight) * w[:, None] * log_probs.exp()
                at_idx = at_idx - torch.where(idx == labels[rows, None], ce_weight * w[:, None], 0.0)
                at_idx = at_idx - kl_weight * w[:, None] * t_probs
                grad_logits.scatter_(1, idx, at_idx.to(grad_logits.dtype))
            grads.append((grad_logits.to(head_weight.dtype) @ head_weight).to(hidden.dtype))
            predictions.append(argmax)
            if top_k:  # the DFlash2 selector's candidates, from these logits rather than a second pass
                values, ids = top_k_of_rows(logits, top_k, SEGMENT, maxima)
                top_values.append(widened(values))
                top_ids.append(ids)
        grad_hidden, predictions = torch.cat(grads), torch.cat(predictions)
        ctx.save_for_backward(grad_hidden)
        if not top_k:
            top_values, top_ids = [hidden.new_empty(hidden.shape[0], 0, dtype=torch.float32)], [predictions[:, None][:, :0]]
        top_values, top_ids = torch.cat(top_values), torch.cat(top_ids)
        ctx.mark_non_differentiable(predictions, top_values, top_ids)
        return total, predictions, top_values, top_ids

    @staticmethod
    def backward(ctx, grad_total, _grad_predictions, _grad_values, _grad_ids):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), *[None] * 9


def head_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    teacher_idx: torch.Tensor | None = None,
    teacher_logits: torch.Tensor | None = None,
    ce_weight: float = 1.0,
    kl_weight: float = 0.0,
    chunk_size: int = 1024,
    top_k: int = 0,
) -> LossOutput:
    """Loss of ``hidden [rows, H]`` through the frozen ``head_weight [V, H]``.

    ``teacher_idx``/``teacher_logits`` ``[rows, k]`` are the target's top-k logits
    for the token each row predicts; the KL is taken against their softmax. A row's ids
    are distinct, as ``topk`` gives them (each column's gradient is written once).
    ``top_k > 0`` also returns each row's ``top_k`` largest logits and their ids (not
    differentiable here; :mod:`dflash.objective.selector` rebuilds their gradient), read
    from the logits this pass computes anyway.
    """
    if kl_weight and teacher_logits is None:
        raise ValueError("loss.kl_weight > 0 needs the target's top-k logits (loss.kl_topk > 0)")
    if teacher_idx is None:
        teacher_idx = labels[:, None]
        teacher_logits = hidden.new_zeros(labels.shape[0], 1, dtype=torch.float32)
    total, predictions, top_values, top_ids = _ChunkedHeadLoss.apply(
        hidden, head_weight, labels, weights, teacher_idx, teacher_logits, ce_weight, kl_weight, chunk_size, top_k
    )
    if not top_k:
        return LossOutput(total, predictions)
    return LossOutput(total, predictions, top_values, top_ids)


def slot_accuracy(predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, block_size: int):
    """Per-slot (correct, counted) sums over a micro-batch, ``[B]`` each, on device.

    The inputs cover the drafted slots 1..B-1 of each block (``model.drafter.drafted``);
    slot 0, the anchor, counts nothing."""
    valid = (weights > 0).view(-1, block_size - 1)
    correct = ((predictions == labels.view(-1)).view(-1, block_size - 1) & valid).sum(0)
    return F.pad(correct, (1, 0)), F.pad(valid.sum(0), (1, 0))


def tau_sim(acc: torch.Tensor) -> float:
    """Simulated acceptance length ``1 + sum_k prod_{i<=k} acc_i`` over slots 1..B-1."""
    return float(1.0 + torch.cumprod(acc[1:].double(), 0).sum())
