"""The plan: every number that both sides of a run must agree on, resolved once.

Target ranks and drafter ranks build their parts from one :class:`Plan`, so a
number (the block size, the buckets, the anchor count, the feature width)
cannot reach the two sides by different routes. What must also agree on the
wire is checked there: the bundle header carries these numbers and the
receiver compares them with :meth:`Plan.expected`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from dflash.data.order import PackedOrder, SampleOrder
from dflash.distributed.topology import Topology
from dflash.distributed.transport import Expected
from dflash.model.drafter import default_target_layer_ids
from dflash.model.target import resolve_mask_token_id
from dflash.objective.anchors import AnchorSpec
from dflash.objective.config import ObjectiveConfig


@dataclass(frozen=True)
class Plan:
    """Every number of a run that target and drafter ranks must agree on.

    Resolved once per process from the config and the target's HF config (the same
    inputs on every rank), so the two sides cannot reach different values."""

    seed: int
    batch_size: int  # global rows per optimizer step: sequences, or packed rows
    micro_batch_size: int  # rows per drafter forward
    num_anchors: int  # per row
    block_size: int
    max_len: int  # longest sequence trained on; with packing, the tokens of every row
    buckets: tuple[int, ...]  # padded lengths, ascending
    topk: int  # target logits per position sent for the KL loss
    layer_ids: tuple[int, ...]  # target layers whose hidden states form the context
    feature_dim: int  # len(layer_ids) x the target's hidden size
    mask_token_id: int  # the embedding row of the drafted slots, checked against the target's vocabulary
    objective: ObjectiveConfig  # the loss group whole, with the block size, mask id and packing above
    max_steps: int  # 0: train for `epochs`
    epochs: int
    packing: bool = False  # rows of max_len tokens, each filled with whole samples

    @property
    def micro_per_step(self) -> int:
        """Micro-batches per optimizer step, over all drafter ranks together."""
        return self.batch_size // self.micro_batch_size

    @property
    def padded_len(self) -> int:
        """The longest padded length a micro-batch can have: the bucket that holds ``max_len``."""
        return padded_length(self.buckets, self.max_len)

    def anchor_spec(self) -> AnchorSpec:
        return AnchorSpec(self.num_anchors, self.seed)

    def sample_order(self, lengths: Sequence[int]) -> SampleOrder | PackedOrder:
        """The order of the samples of these lengths: one per row, or packed."""
        if self.packing:
            return PackedOrder(lengths, self.max_len, self.batch_size, self.micro_batch_size, self.seed)
        return SampleOrder(len(lengths), self.batch_size, self.micro_batch_size, self.seed)

    def total_steps(self, order: SampleOrder | PackedOrder) -> int:
        return self.max_steps or self.epochs * order.steps_per_epoch

    def expected(self, feature_dtype: torch.dtype) -> Expected:
        """What a drafter accepts in a bundle header."""
        return Expected(
            max_batch=self.micro_batch_size, num_anchors=self.num_anchors, feature_dim=self.feature_dim,
            feature_dtype=feature_dtype, topk=self.topk, buckets=list(self.buckets), block_size=self.block_size,
        )

    def topology(self, world_size: int, rank: int, num_targets: int) -> Topology:
        return Topology(world_size, rank, num_targets, self.micro_batch_size, self.batch_size)


def padded_length(buckets: tuple[int, ...], max_len: int) -> int:
    return next((b for b in buckets if b >= max_len), max(buckets))


def auto_micro_batch(batch_size: int, padded_len: int, tokens: int) -> int:
    """``train.micro_batch_size=auto``: the most sequences of the longest bucket that fit
    ``tokens`` (at least one) and divide the batch. An 8B target's prefill of one 768-token
    sequence runs far below the MFU that four reach, while the drafter step gains little
    (docs/benchmarks/2026-12-03-h200-micro-batch.md, "Larger micro-batches, colocated"): the prefill needs a few thousand
    tokens to fill the GPU."""
    most = max(1, tokens // padded_len)
    return next(m for m in range(min(most, batch_size), 0, -1) if batch_size % m == 0)


def resolve_plan(cfg: DictConfig, target_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase | None) -> Plan:
    """The plan of ``cfg`` for a target with this HF config and tokenizer (``None`` for a
    random target without one: ``target.mask_token_id`` is then required)."""
    train, text = cfg.train, target_config.get_text_config()
    layer_ids = cfg.drafter.target_layer_ids or default_target_layer_ids(
        text.num_hidden_layers, cfg.drafter.num_context_features
    )
    block_size = cfg.drafter.block_size
    packing = bool(train.get("packing", False))
    if packing and train.buckets and list(train.buckets) != [train.max_len]:
        raise ValueError(f"train.packing fills every row to train.max_len={train.max_len} tokens, so it takes no "
                         f"length buckets: set train.buckets=null (it is {list(train.buckets)})")
    buckets = (train.max_len,) if packing else tuple(sorted(train.buckets or [train.max_len]))
    micro = train.micro_batch_size
    if micro == "auto":
        micro = auto_micro_batch(train.batch_size, padded_length(buckets, train.max_len), train.micro_batch_tokens)
    mask_token_id = resolve_mask_token_id(tokenizer, text.vocab_size, cfg.target.mask_token_id)
    return Plan(
        seed=train.seed,
        batch_size=train.batch_size,
        micro_batch_size=int(micro),
        num_anchors=train.num_anchors,
        block_size=block_size,
        max_len=train.max_len,
        buckets=buckets,
        topk=cfg.loss.kl_topk,
        layer_ids=tuple(layer_ids),
        feature_dim=len(layer_ids) * text.hidden_size,
        mask_token_id=mask_token_id,
        objective=ObjectiveConfig.of_loss(cfg.loss, block_size=block_size, mask_token_id=mask_token_id, packed=packing),
        max_steps=train.max_steps or 0,
        epochs=train.epochs,
        packing=packing,
    )
