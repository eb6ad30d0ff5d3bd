"""One optimizer step of the drafter: micro-batch forward/backward, then normalise and update.

Micro-batches add *unnormalised* weighted loss sums to the gradients; ``finish``
divides by the total weight of the whole step (every micro-batch; every drafter
rank once gradients are reduced), so the loss is normalised over the optimizer
step and never per micro-batch.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dflash.anchors import make_blocks
from dflash.data import MicroBatch
from dflash.loss import head_loss, slot_accuracy
from dflash.masks import build_mask
from dflash.model import DFlashDrafter, TargetHead
from dflash.target import PrefillOutput


@dataclass
class ObjectiveConfig:
    block_size: int
    mask_token_id: int
    gamma: float
    ce_weight: float = 1.0
    kl_weight: float = 0.0
    chunk_size: int = 1024


@dataclass
class StepStats:
    """Sums over the micro-batches of one step (device tensors until ``finish``)."""

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor
    samples: int = 0
    tokens: int = 0


def cosine_schedule(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class DrafterTrainer:
    """Holds the drafter, the frozen head, the optimizer and the scheduler."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        head: TargetHead,
        objective: ObjectiveConfig,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        grad_clip: float,
        autocast_dtype: torch.dtype | None,
    ):
        self.drafter, self.head, self.obj = drafter, head, objective
        self.optimizer, self.scheduler, self.grad_clip = optimizer, scheduler, grad_clip
        self.device = next(drafter.parameters()).device
        self.use_flex = self.device.type == "cuda"
        self.autocast = (
            torch.autocast(self.device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
        )
        self.stats = self._fresh_stats()

    def _fresh_stats(self) -> StepStats:
        scalar = torch.zeros((), device=self.device)
        per_slot = torch.zeros(self.obj.block_size, device=self.device)
        return StepStats(scalar, scalar.clone(), per_slot, per_slot.clone())

    def micro_step(self, batch: MicroBatch, prefill: PrefillOutput) -> None:
        """Forward + backward of one micro-batch; gradients accumulate unnormalised."""
        obj = self.obj
        batch = batch.to(self.device)
        blocks = make_blocks(
            batch.input_ids, batch.loss_mask, batch.lengths, batch.anchors, batch.keep, obj.block_size, obj.mask_token_id, obj.gamma
        )
        b, seq_len = batch.input_ids.shape
        mask = build_mask(batch.anchors, seq_len, obj.block_size, self.use_flex)
        ctx_positions = torch.arange(seq_len, device=self.device).expand(b, seq_len)
        teacher_idx = teacher_logits = None
        if obj.kl_weight:
            at = (blocks.label_positions - 1).clamp(min=0)[..., None]
            teacher_idx = prefill.topk_indices.gather(1, at.expand(-1, -1, prefill.topk_indices.shape[-1])).flatten(0, 1)
            teacher_logits = prefill.topk_values.gather(1, at.expand(-1, -1, prefill.topk_values.shape[-1])).flatten(0, 1)
        with self.autocast:
            hidden = self.drafter(prefill.features, self.head.embed(blocks.ids), ctx_positions, blocks.positions, mask)
            out = head_loss(
                hidden.flatten(0, 1),
                self.head.lm_head_weight,
                blocks.labels.flatten(),
                blocks.weights.flatten(),
                teacher_idx,
                teacher_logits,
                obj.ce_weight,
                obj.kl_weight,
                obj.chunk_size,
            )
        out.loss_sum.backward()
        correct, counted = slot_accuracy(out.predictions, blocks.labels, blocks.weights, obj.block_size)
        s = self.stats
        s.loss_sum += out.loss_sum.detach()
        s.weight_sum += blocks.weights.sum()
        s.correct += correct
        s.counted += counted
        s.samples += b
        s.tokens += int(batch.lengths.sum())

    def finish(self, group=None) -> dict | None:
        """Reduce over the drafter ``group`` (if any), normalise by the step's total
        weight, clip, update. Returns metrics, or ``None`` when every rank skips the
        step (no valid anchor anywhere, or a non-finite loss)."""
        s, self.stats = self.stats, self._fresh_stats()
        params = [p for p in self.drafter.parameters() if p.grad is not None]
        sums = torch.cat([s.loss_sum[None], s.weight_sum[None], s.correct, s.counted,
                          torch.tensor([s.samples, s.tokens], dtype=torch.float32, device=self.device)])
        if group is not None:
            flat = torch.cat([p.grad.flatten() for p in params])
            dist.all_reduce(flat, group=group)
            dist.all_reduce(sums, group=group)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        b = self.obj.block_size
        loss_sum, weight, correct, counted = sums[0], float(sums[1]), sums[2 : 2 + b], sums[2 + b : 2 + 2 * b]
        loss = float(loss_sum) / weight if weight > 0 else float("nan")
        if weight <= 0 or not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            return None
        for p in params:
            p.grad.div_(weight)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.grad_clip))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "acc": (correct / counted.clamp(min=1)).cpu(),
            "samples": int(sums[-2]),
            "tokens": int(sums[-1]),
        }


def build_optimizer(drafter: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]):
    fused = next(drafter.parameters()).device.type == "cuda"
    return torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)
