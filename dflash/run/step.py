"""One optimizer step of the drafter: micro-batch forward/backward, then normalise and update.

Micro-batches add *unnormalised* weighted loss sums to the gradients; ``finish``
divides by the total weight of the whole step (every micro-batch; every drafter
rank once gradients are reduced), so the loss is normalised over the optimizer
step and never per micro-batch.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dflash.compile import CompileSettings, FixedAddresses
from dflash.data.bundle import MicroBatch
from dflash.model.drafter import FULL, SLIDING, DFlashDrafter, TargetHead, drafted
from dflash.model.fp8 import train_in_fp8
from dflash.model.linear import Linear
from dflash.model.target import PrefillOutput
from dflash.objective.anchors import make_blocks, sample_starts
from dflash.objective.config import ObjectiveConfig
from dflash.objective.loss import head_loss, slot_accuracy, teacher_at
from dflash.objective.masks import MaskParts, build_mask, mask_of_parts, mask_parts
from dflash.objective.selector import predecessors, selector_loss, selector_weight
from dflash.run.checkpoint import load_checkpoint


@dataclass
class StepStats:
    """Sums over the micro-batches of one step (device tensors until ``finish``)."""

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor
    tokens: torch.Tensor
    malformed: torch.Tensor  # rows whose position ids are no sample boundaries
    samples: torch.Tensor  # samples trained on: rows, or the samples packed into them

    @classmethod
    def zeros(cls, block_size: int, device: torch.device) -> StepStats:
        """Empty sums: scalars, and one entry per block slot for the accuracy counts."""
        per_slot = {"correct", "counted"}
        return cls(**{f.name: torch.zeros(block_size if f.name in per_slot else (), device=device)
                      for f in fields(cls)})

    def reduced(self, group=None) -> StepStats:
        """The sums over the ranks of ``group`` (``None``: this rank's), in one all-reduce."""
        parts = [getattr(self, f.name) for f in fields(self)]
        flat = torch.cat([t.reshape(-1) for t in parts])
        if group is not None:
            dist.all_reduce(flat, group=group)
        pieces = flat.split([t.numel() for t in parts])
        return StepStats(*(piece.reshape(t.shape) for piece, t in zip(pieces, parts)))


def malformed_rows(position_ids: torch.Tensor) -> torch.Tensor:
    """How many rows of ``position_ids [b, S]`` are not sample boundaries: a row starts
    at 0 and each next id is the one before plus 1, or 0 where a packed sample starts.
    Counted on the device and checked when the step's sums reach the host, so a
    malformed bundle stops the run without a sync per micro-batch."""
    p = position_ids
    steps_ok = ((p[:, 1:] == p[:, :-1] + 1) | (p[:, 1:] == 0)).all(1)
    return ((p[:, 0] != 0) | ~steps_ok).sum()


def cosine_schedule(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def compute_copy(drafter: DFlashDrafter, dtype: torch.dtype) -> DFlashDrafter:
    """The drafter that micro-steps run: its linear weights held in ``dtype``, the rest
    (norms, buffers) as the masters are.

    Autocast casts each fp32 weight to ``dtype`` at every use, forward and backward:
    at Qwen3-8B shapes that is 30 cast kernels and 2 GiB written per micro-batch.
    Held in ``dtype`` and refreshed once per optimizer step, the weights are the same
    values (the same round-to-nearest cast), so eager, the step is equal bit for bit to
    autocast over the masters (tests/run/test_step.py). Norm weights stay fp32: autocast
    computes the norms in fp32 either way. The linear weights enter the copy already
    cast, so the fp32 drafter is never held twice."""
    cast = {
        id(m.weight): nn.Parameter(m.weight.detach().to(dtype), m.weight.requires_grad)
        for m in drafter.modules()
        if isinstance(m, nn.Linear)
    }
    return copy.deepcopy(drafter, memo=cast)


# An eager step on CUDA attends densely below this many bytes of attention scores over all
# layers: flex attention compiles a kernel pair for every shape it meets (seconds each on a
# cold cache), the dense mask compiles nothing, and at small shapes (the embedded default's
# scores are a few MB) it costs no more. Above it (the paper shapes: about 24 GB a layer)
# flex's tiles are the only way the step fits.
DENSE_SCORES_LIMIT = 1 << 30


def dense_scores_bytes(batch: int, queries: int, context: int, heads: int, layers: int) -> int:
    """The fp32 attention scores a dense-mask step keeps for its backward: every block
    query against the context and every block's keys, in every head and layer."""
    return 4 * batch * heads * queries * (context + queries) * layers


class DrafterTrainer:
    """Holds the drafter, the frozen head, the optimizer and the scheduler.

    ``drafter`` holds the fp32 master weights that the optimizer updates and that
    checkpoints and exports save. Under autocast, micro-steps run ``compute``, a copy
    with its linear weights in the autocast dtype (:func:`compute_copy`); without it,
    ``compute`` is the drafter itself.

    Gradients accumulate in persistent fp32 buffers, ``grads``, one per trainable
    parameter; they are what the drafter group all-reduces and what the optimizer
    reads. The linear layers' backward GEMMs add into theirs directly
    (:mod:`dflash.model.linear`). The norm weights' gradients come through ``.grad``:
    under CUDA graphs that is memory of the graph pool that the next replay
    overwrites, so they are added to their buffers and dropped after each backward.
    """

    def __init__(
        self,
        drafter: DFlashDrafter,
        head: TargetHead,
        objective: ObjectiveConfig,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        grad_clip: float,
        autocast_dtype: torch.dtype | None,
        compile_settings: CompileSettings | None = None,
        fp8: bool = False,
    ):
        self.drafter, self.head, self.obj = drafter, head, objective
        self.optimizer, self.scheduler, self.grad_clip = optimizer, scheduler, grad_clip
        self.device = next(drafter.parameters()).device
        self.sliding_window = drafter.config.sliding_window  # None unless some layer slides
        self.sliding_causal = drafter.config.sliding_causal
        self.autocast = (
            torch.autocast(self.device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
        )
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.compute = compute_copy(drafter, autocast_dtype) if autocast_dtype is not None else drafter
        # train.fp8: the compute copy's linear layers become torchao's, sharing their weights
        self.fp8_layers = train_in_fp8(self.compute) if fp8 else []
        self.compute_params = [p for p in self.compute.parameters() if p.requires_grad]
        if drafter.config.block_size != objective.block_size:
            raise ValueError(f"drafter block size {drafter.config.block_size} != loss block size {objective.block_size}")
        self.grads = [torch.zeros_like(p) for p in self.params]
        sink_of = {id(p): g for p, g in zip(self.compute_params, self.grads)}
        self.sinks = [(m, sink_of.pop(id(m.weight))) for m in self.compute.modules()
                      if isinstance(m, Linear) and id(m.weight) in sink_of]
        for m, g in self.sinks:
            m.grad_sink = g
        # the rest (norm weights) get a .grad from autograd, added to their buffers after each backward
        rest = [(p, g) for p, g in zip(self.compute_params, self.grads) if id(p) in sink_of]
        self.autograd_params, self.autograd_grads = [p for p, _ in rest], [g for _, g in rest]
        self.compiled = compile_settings is not None and compile_settings.drafter
        self.cuda_graphs = self.compiled and compile_settings.cuda_graphs
        self.forward_loss = compile_settings.compile(self._forward_loss) if self.compiled else self._forward_loss
        # A graph of its own, not the step's: see _mask_parts
        self.mask_parts = compile_settings.compile(self._mask_parts, mode="default") if self.compiled else self._mask_parts
        self.fixed_addresses = FixedAddresses()
        self.stats = self._fresh_stats()
        self.samples_trained = torch.zeros((), device=self.device)  # by this rank, over the run: its share
        self.selector = drafter.config.dflash2 is not None
        # a device tensor, read by the compiled step: a new weight each step recompiles nothing
        self.selector_alpha = torch.zeros((), device=self.device)
        self.schedule_selector()

    def schedule_selector(self) -> None:
        """The selector term's weight for the coming optimizer step."""
        o = self.obj
        self.selector_alpha.fill_(selector_weight(self.scheduler.last_epoch, o.total_steps, o.selector_alpha,
                                                  o.selector_warmup, o.selector_ramp))

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the master weights into the compute weights, in place: the CUDA graphs
        read them at their recorded addresses."""
        if self.compute is not self.drafter:
            torch._foreach_copy_(self.compute_params, self.params)

    def restore(self, path: Path, group=None) -> int:
        """Load a checkpoint into the masters, optimizer and scheduler, then the compute
        weights from the masters. Returns the step it was taken after."""
        step = load_checkpoint(path, self.drafter, self.optimizer, self.scheduler, group)
        self.refresh()
        self.schedule_selector()
        return step

    def _fresh_stats(self) -> StepStats:
        return StepStats.zeros(self.obj.block_size, self.device)

    def _mask_parts(self, anchors: torch.Tensor, position_ids: torch.Tensor) -> dict[str, MaskParts]:
        """The micro-batch's attention masks (a sliding layer's too) as plain tensors: on
        CUDA ``BlockMask``s for flex attention, except in an eager step whose dense scores
        stay small (:data:`DENSE_SCORES_LIMIT`); on the CPU dense masks.

        They are built outside the step's compiled graph and enter it as inputs, the
        layout measured right on the H200: built inside, Inductor gave a block count a
        batch stride that flex's kernels do not read (``dflash.flex.block_mask`` now makes
        the indices contiguous either way). On CUDA this is a small compiled graph of its
        own: evaluated eagerly, the mask's full grid would not fit at long context."""
        obj, seq_len = self.obj, position_ids.shape[1]
        config = self.drafter.config
        flex = self.device.type == "cuda" and (self.compiled or dense_scores_bytes(
            anchors.shape[0], anchors.shape[1] * obj.block_size, seq_len, config.num_attention_heads,
            config.num_layers) > DENSE_SCORES_LIMIT)
        # One sample per row: no sample starts (each would be 0), one captured tensor fewer
        starts = sample_starts(anchors, position_ids) if obj.packed else None
        parts = {FULL: mask_parts(build_mask(anchors, seq_len, obj.block_size, flex, starts=starts))}
        if self.sliding_window is not None:  # sliding layers take a second, windowed mask
            parts[SLIDING] = mask_parts(build_mask(anchors, seq_len, obj.block_size, flex,
                                                   self.sliding_window, starts, self.sliding_causal))
        return parts

    def _forward_loss(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        lengths: torch.Tensor,
        anchors: torch.Tensor,
        keep: torch.Tensor,
        topk_values: torch.Tensor | None,
        topk_indices: torch.Tensor | None,
        selector_alpha: torch.Tensor,
        masks: dict[str, MaskParts],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Blocks, drafter and loss of one micro-batch over its :meth:`_mask_parts`: the
        compiled region. Returns (weighted loss sum, weight sum, per-slot correct,
        per-slot counted); a DFlash2 drafter's loss sum includes its selector term at
        ``selector_alpha``."""
        obj = self.obj
        blocks = make_blocks(input_ids, loss_mask, lengths, anchors, keep, obj.block_size, obj.mask_token_id, obj.gamma,
                             position_ids)
        seq_len = input_ids.shape[1]
        starts = blocks.starts if obj.packed else None
        mask = mask_of_parts(masks[FULL], anchors, seq_len, obj.block_size, starts=starts)
        if self.sliding_window is not None:
            mask = {FULL: mask, SLIDING: mask_of_parts(masks[SLIDING], anchors, seq_len, obj.block_size,
                                                       self.sliding_window, starts, self.sliding_causal)}
        ctx_positions = position_ids
        labels, weights = drafted(blocks.labels, obj.block_size), drafted(blocks.weights, obj.block_size)
        teacher_idx = teacher_logits = None
        if obj.kl_weight:
            label_positions = drafted(blocks.label_positions, obj.block_size)
            teacher_idx, teacher_logits = teacher_at(label_positions, topk_values, topk_indices)
        hidden = self.compute(features, self.head.embed(blocks.ids), ctx_positions, blocks.positions, mask, True)
        out = head_loss(
            hidden.flatten(0, 1),
            self.head.lm_head_weight,
            labels.flatten(),
            weights.flatten(),
            teacher_idx,
            teacher_logits,
            obj.ce_weight,
            obj.kl_weight,
            obj.chunk_size,
            self.compute.candidate_selector.top_k if self.selector else 0,
        )
        correct, counted = slot_accuracy(out.predictions, labels, weights, obj.block_size)
        loss_sum = out.loss_sum
        if self.selector:
            selector = self.compute.candidate_selector
            term = selector_loss(
                selector.transition, hidden.flatten(0, 1), self.head.lm_head_weight, out.top_values, out.top_ids,
                labels.flatten(), predecessors(blocks.labels, obj.block_size).flatten(), weights.flatten(),
                stop_gradient=obj.selector_stop_gradient, chunk_size=obj.chunk_size,
            )
            loss_sum = loss_sum + selector_alpha * term.loss_sum
        return loss_sum, weights.sum(), correct, counted

    def _forward_backward(self, batch: MicroBatch, prefill: PrefillOutput) -> None:
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        masks = self.mask_parts(batch.anchors, batch.position_ids)
        if self.cuda_graphs:  # the backward's CUDA graph reads the block indices where it recorded them
            masks = {name: self.fixed_addresses(name, parts) for name, parts in masks.items()}
        with self.autocast:  # outside the compiled code: inside, it keeps the graph out of the AOT cache
            loss_sum, weight_sum, correct, counted = self.forward_loss(
                prefill.features, batch.input_ids, batch.position_ids, batch.loss_mask, batch.lengths, batch.anchors,
                batch.keep, prefill.topk_values, prefill.topk_indices, self.selector_alpha, masks,
            )
        s = self.stats  # graph outputs: copied out before anything else runs
        s.loss_sum += loss_sum.detach()
        s.weight_sum += weight_sum
        s.correct += correct
        s.counted += counted
        loss_sum.backward()
        torch._foreach_add_(self.autograd_grads, [p.grad for p in self.autograd_params])
        for p in self.autograd_params:
            p.grad = None

    def micro_step(self, batch: MicroBatch, prefill: PrefillOutput) -> None:
        """Forward + backward of one micro-batch; gradients accumulate unnormalised."""
        batch = batch.to(self.device)
        self._forward_backward(batch, prefill)
        real = torch.arange(batch.input_ids.shape[1], device=self.device) < batch.lengths[:, None]
        self.stats.samples += ((batch.position_ids == 0) & real).sum()
        self.stats.tokens += batch.lengths.sum()
        self.stats.malformed += malformed_rows(batch.position_ids)

    def warmup(self, batches: list[tuple[MicroBatch, PrefillOutput]]) -> None:
        """Compile (and record) every shape before data flows. CUDAGraph Trees warms a
        graph up, records it, then replays, so each shape runs three times; eager on
        CUDA still compiles flex_attention once per shape too large to attend densely. The
        gradients and statistics are thrown away; no weight changes."""
        calls = 3 if self.cuda_graphs else 1
        for batch, prefill in batches:
            for _ in range(calls):
                self._forward_backward(batch.to(self.device), prefill)
        torch._foreach_zero_(self.grads)
        self.stats = self._fresh_stats()

    def finish(self, group=None) -> dict | None:
        """Reduce over the drafter ``group`` (if any), normalise by the step's total
        weight, clip, update. Returns metrics, or ``None`` when every rank skips the
        step (no valid anchor anywhere, or a non-finite loss)."""
        if any(m.grad_sink is not g for m, g in self.sinks):
            raise RuntimeError(
                "the drafter's gradient buffers were replaced (by .to(), .double() or a copy after the trainer "
                "was built): its linear layers' gradients no longer reach the optimizer"
            )
        mine, self.stats = self.stats, self._fresh_stats()
        self.samples_trained += mine.samples
        if group is not None:
            for g in self.grads:
                dist.all_reduce(g, group=group)
        s = mine.reduced(group)
        if s.malformed > 0:
            raise ValueError(f"{int(s.malformed)} micro-batch rows of this step carried position ids that are no sample "
                             "boundaries (each row counts 0, 1, 2, ... and restarts at 0 where a packed sample starts)")
        weight = float(s.weight_sum)
        loss = float(s.loss_sum) / weight if weight > 0 else float("nan")
        if weight <= 0 or not math.isfinite(loss):
            torch._foreach_zero_(self.grads)
            return None
        torch._foreach_div_(self.grads, weight)
        for p, g in zip(self.params, self.grads):
            p.grad = g
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.schedule_selector()
        self.optimizer.zero_grad(set_to_none=True)
        torch._foreach_zero_(self.grads)
        self.refresh()
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "acc": (s.correct / s.counted.clamp(min=1)).cpu(),
            "samples": int(s.samples),
            "tokens": int(s.tokens),
        }


def build_optimizer(drafter: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]):
    fused = next(drafter.parameters()).device.type == "cuda"
    return torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)
