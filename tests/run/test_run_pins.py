"""Regression pins of a run's construction, schedule and checkpoints: behaviours whose
silent breakage would still train, each checked against an independent reference (a hand
formula, a hand count) rather than against the code under test."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import tiny_drafter, tiny_head
from runs import RANDOM_TARGET, TINY

from dflash.data.bundle import MicroBatch
from dflash.model.target import PrefillOutput
from dflash.objective.config import ObjectiveConfig
from dflash.objective.loss import default_gamma
from dflash.run.build import build_job, build_trainer
from dflash.run.checkpoint import checkpoints, save_checkpoint
from dflash.run.config import compose_config
from dflash.run.plan import resolve_plan
from dflash.run.step import (
    DrafterTrainer,
    build_optimizer,
    cosine_schedule,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# loss.gamma ------------------------------------------------------------------------------


def test_configured_gamma_reaches_the_plan_and_the_trainer():
    """A ``loss.gamma`` override is what the plan, its objective and the built trainer use,
    not the block size's default (a falsy-``or`` or a dropped field would fall back to it)."""
    cfg = compose_config(TINY + RANDOM_TARGET + ["loss.gamma=2.5"])
    assert cfg.drafter.block_size == 8 and default_gamma(8) == 4.0  # so 2.5 cannot be the default by chance
    job = build_job(cfg)
    assert resolve_plan(cfg, job.target_config, job.tokenizer).objective.gamma == 2.5
    assert job.plan.objective.gamma == 2.5
    assert job.plan.mask_token_id == job.plan.objective.mask_token_id == 255
    text = job.target_config.get_text_config()
    head = tiny_head(hidden=text.hidden_size, vocab=text.vocab_size)
    assert build_trainer(job, head, steps=10).obj.gamma == 2.5
    unset = build_job(compose_config(TINY + RANDOM_TARGET))
    assert unset.plan.objective.gamma == 4.0


def test_packing_reaches_the_trainers_mask():
    """``train.packing`` tells the objective that rows hold several samples (each anchor's
    context then stops at its sample's start); without it the mask takes no sample starts."""
    packed = build_job(compose_config(TINY + RANDOM_TARGET + ["train.packing=true", "train.buckets=null"]))
    assert packed.plan.objective.packed
    assert not build_job(compose_config(TINY + RANDOM_TARGET)).plan.objective.packed


# the LR schedule -------------------------------------------------------------------------


def hand_lr_factor(step: int, total: int, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warmup over round(total * ratio) steps (at least one), the first at 1/warmup,
    then a half cosine from 1 down to ``min_ratio`` at ``total``."""
    warmup = max(1, round(total * warmup_ratio))
    if step < warmup:
        return (step + 1) / warmup
    return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup)))) / 2


def micro_batch(seed: int, seq_len: int = 20) -> tuple[MicroBatch, PrefillOutput]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 90, (1, seq_len), generator=g)
    anchors = torch.tensor([[2, 7, 12]])
    batch = MicroBatch(ids, torch.ones(1, seq_len, dtype=torch.long), torch.tensor([seq_len]), anchors,
                       torch.ones(1, 3, dtype=torch.bool), 0)
    return batch, PrefillOutput(torch.randn(1, seq_len, 3 * 64, generator=g))


def test_scheduler_steps_once_per_optimizer_step_and_warmup_starts_above_zero():
    """With accumulation 3, N optimizer steps move the scheduler N times (not once per
    micro-batch), each step trains at the schedule's LR for its index, and the first
    warmup step's LR is 1/warmup of the peak, not 0 (a wasted step)."""
    total, warmup_ratio, min_ratio, base_lr, accumulation, steps = 10, 0.3, 0.1, 1e-3, 3, 4
    factor = cosine_schedule(total, warmup_ratio, min_ratio)
    assert factor(0) == pytest.approx(1 / 3, abs=1e-15) and factor(0) > 0
    assert cosine_schedule(100, 0.0, 0.0)(0) == 1.0  # no warmup asked: full LR from the start
    for s in range(total + 1):
        assert factor(s) == pytest.approx(hand_lr_factor(s, total, warmup_ratio, min_ratio), abs=1e-15)

    drafter = tiny_drafter(block_size=4)
    optimizer = build_optimizer(drafter, base_lr, 0.0, (0.9, 0.95))
    applied: list[float] = []  # the LR each optimizer update actually runs with
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: applied.append(opt.param_groups[0]["lr"]))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    trainer = DrafterTrainer(drafter, tiny_head(), ObjectiveConfig(block_size=4, mask_token_id=95, gamma=2.0),
                             optimizer, scheduler, grad_clip=1.0, autocast_dtype=None)
    for step in range(steps):
        for m in range(accumulation):
            trainer.micro_step(*micro_batch(step * accumulation + m))
        metrics = trainer.finish()
        want = base_lr * hand_lr_factor(step, total, warmup_ratio, min_ratio)
        assert metrics is not None and metrics["lr"] == pytest.approx(want, rel=1e-12)
        assert len(applied) == step + 1 and applied[-1] == pytest.approx(want, rel=1e-12)
    assert scheduler.last_epoch == steps
    assert optimizer.param_groups[0]["lr"] == pytest.approx(
        base_lr * hand_lr_factor(steps, total, warmup_ratio, min_ratio), rel=1e-12
    )


# checkpoint rotation ---------------------------------------------------------------------


def test_checkpoint_rotation_keeps_the_two_newest_by_step(tmp_path: Path):
    """``keep=2`` leaves the two highest steps after every save, ordered by number, also
    where the zero-padded names stop sorting as the steps do (past 10^8 steps)."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    saved: list[int] = []
    for step in [8, 9, 10, 11, 99_999_999, 100_000_000, 100_000_001]:
        save_checkpoint(tmp_path, step, model, optimizer, scheduler, keep=2)
        saved.append(step)
        on_disk = sorted(int(p.name.split("_")[1]) for p in tmp_path.iterdir() if p.name.startswith("step_"))
        assert on_disk == sorted(saved)[-2:], (step, on_disk)
        assert [int(p.name.split("_")[1]) for p in checkpoints(tmp_path)] == on_disk
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())
