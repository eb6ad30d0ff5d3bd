"""The optimizer-step loop shared by the colocated and drafter roles: micro-steps,
the reduction, skipped steps, logging, evaluations while training, checkpoints and
SIGTERM.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dflash.compile import CompileGuard
from dflash.data.bundle import MicroBatch
from dflash.decode.live import LocalEval, RemoteEval
from dflash.distributed.protocol import Protocol
from dflash.model.target import PrefillOutput
from dflash.run.checkpoint import CheckpointWriter
from dflash.run.garbage import StepCollector
from dflash.run.metrics import MetricsLogger
from dflash.run.settings import RunSettings
from dflash.run.startup import phases as startup
from dflash.run.step import DrafterTrainer

log = logging.getLogger(__name__)

Feed = Callable[[int], Iterator[tuple[MicroBatch, PrefillOutput]]]


class StopRequested:
    """SIGTERM flips a flag; training checkpoints at the next step boundary and exits."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        log.warning("SIGTERM: checkpointing at the end of this step")
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def agree(flag: bool, device: torch.device, group) -> bool:
    """True on every drafter rank if it is true on any (so all stop at one step)."""
    if group is None:
        return flag
    vote = torch.tensor([int(flag)], device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
    return bool(vote.item())


@dataclass
class StepLoop:
    """Runs optimizer steps ``start..steps`` on micro-batches from a feed. ``proto`` is
    None in one process; ``pipeline`` adds the drafter ranks' pipeline figures to each
    step's record; ``evaluator`` runs speculative decoding every ``eval.every`` steps
    (:mod:`dflash.decode.live`)."""

    settings: RunSettings
    trainer: DrafterTrainer
    metrics: MetricsLogger
    guard: CompileGuard
    proto: Protocol | None = None
    pipeline: Callable[[], dict] | None = None
    evaluator: LocalEval | RemoteEval | None = None
    skipped: int = field(default=0, init=False)  # steps skipped so far
    in_a_row: int = field(default=0, init=False)  # of them, the latest run of consecutive ones

    def bounded(self, what: str):
        """A step-deadline phase with the other drafters, or nothing in one process."""
        proto = self.proto
        return proto.phase(what, proto.timeouts.step_s, proto.other_drafters()) if proto else nullcontext()

    def run(self, feed: Feed, start: int, steps: int) -> int:
        """Returns the last completed step (``steps``, or earlier on SIGTERM), with its
        checkpoint on disk."""
        group = self.proto.drafters if self.proto else None
        writer = CheckpointWriter(self.settings.run_dir.checkpoints, self.settings.checkpoint_keep, group)
        stop = StopRequested()
        collector = StepCollector(start)
        self.metrics.begin()
        step = start
        try:
            while step < steps:
                for batch, prefill in feed(step):
                    self.trainer.micro_step(batch, prefill)
                step, stopping = self.finish_step(step, steps, stop)
                if step == start + 1 and self.metrics.enabled:
                    startup.mark("the first step")
                    log.info("%s", startup.report())
                if self.settings.checkpoint_due(step) or step == steps or stopping:
                    writer.save(step, self.trainer.drafter, self.trainer.optimizer, self.trainer.scheduler)
                writer.prepare(self.trainer.drafter, self.trainer.optimizer, self.trainer.scheduler)
                collector.before(step)
                if stopping:
                    log.warning("stopped at step %d; run again with resume=auto to continue", step)
                    break
            with self.bounded(f"writing the checkpoint of step {step}"):
                writer.close()
        finally:
            writer.abandon()
            stop.restore()
        return step

    def finish_step(self, step: int, steps: int, stop: StopRequested) -> tuple[int, bool]:
        """Reduce, step the optimizer, log and evaluate after step ``step``'s micro-batches;
        returns the new step and whether training stops there (the caller checkpoints)."""
        trainer, settings = self.trainer, self.settings
        group = self.proto.drafters if self.proto else None
        with self.bounded(f"reducing the gradients of step {step + 1}"):
            result = trainer.finish(group)
            extra = self.pipeline() if self.pipeline else {}
            stopping = agree(stop.requested, trainer.device, group)
        step += 1
        extra.update(self.guard.check(f"step {step}"))
        if result is None:
            self.skipped += 1
            self.in_a_row += 1
            log.warning("step %d skipped: no valid anchor or a non-finite loss (%d in a row)", step, self.in_a_row)
            if self.in_a_row >= settings.max_nonfinite:
                raise RuntimeError(f"{self.in_a_row} steps in a row had no valid anchor or a non-finite loss")
        else:
            self.in_a_row = 0
            self.metrics.count(result)
            if step % settings.log_every == 0 or step == steps:
                self.metrics.log_step(step, steps, result, {"skipped_steps": self.skipped, **extra})
        for record in self.evaluator.after_step(step, trainer.drafter, lambda: stop.requested) if self.evaluator else ():
            self.metrics.log_eval(record)
        return step, stopping
