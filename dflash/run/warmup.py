"""What a run compiles before its first step, and whether compiling pays for itself.

A launch compiles, for every length bucket it warms up, a target decoder layer's prefill,
the drafter's mask and the drafter step. Measured on one H200 (torch 2.11, an empty
compile cache): at the Qwen3-8B paper shapes one bucket took 43.4 s and three 78.8-87.1 s,
so each further bucket about 20 s (``dflash.bench``'s one-bucket drafter warmup, 26.5 s,
is one bucket of the drafter alone); the embedded default compiled its 4 buckets for
93.5 s to train for about 10 s. Hence two rules:

- **Only the buckets the run meets.** Which bucket each micro-batch is padded to follows
  from the sample order and the lengths alone (:func:`~dflash.data.order.buckets_met`), so
  a bucket no micro-batch of the run reaches is never compiled.
- **Compile where it pays** (``compile.enabled=auto`` on CUDA). A compiled step is faster,
  but the compile is paid first: eager took 1.32x the compiled drafter step and 1.37x the
  compiled prefill at the paper shapes (the bench's eager rows), so compiling saves about
  :data:`EAGER_SLOWDOWN` - 1 of the compiled run's time and is worth it only when that
  saving exceeds the compile's estimated seconds. The embedded default and a short test
  run train eager; a long run keeps its CUDA graphs. ``compile.enabled=true`` or ``false``
  decides instead.

The estimates are for a cold cache: a warm one compiles in a fraction of the time, which
only moves the choice near the threshold, where either costs about the same.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from dflash.compile import CompileSettings
from dflash.run.layout import Layout
from dflash.run.plan import Plan

log = logging.getLogger(__name__)

# Cold compile seconds on one H200 (torch 2.11), a rank compiling both roles (the colocated
# case; a rank of one role compiles less, so the estimate errs toward eager):
# docs/benchmarks/2026-11-30-h200-compile-warm-starts-checkpoints.md (one bucket, 43.4 s) and
# BENCHMARKS.md's cold start (three buckets, 87.1 s; 78.8 s in the start-up issue's launch).
FIRST_BUCKET_S = 43.0
NEXT_BUCKET_S = 20.0
# Eager step time over the compiled one at the paper shapes (drafter 196.5 / 148.4 ms,
# prefill 93-99 / 68-71 ms; docs/benchmarks/2026-11-29-h200-bench-qwen3-8b-shapes.md and
# 2026-12-01-h200-micro-batch-and-layout.md). Launch-bound small models lose more.
EAGER_SLOWDOWN = 1.35
# The host's share of a compiled micro-batch, whatever its FLOPs (collation, the prefill's
# launches, the optimizer): the embedded default trained 600 micro-batches in about 10 s.
MICRO_BATCH_FLOOR_S = 0.017


def compile_seconds(num_buckets: int) -> float:
    """The estimated cold compile of ``num_buckets`` buckets."""
    return 0.0 if num_buckets == 0 else FIRST_BUCKET_S + NEXT_BUCKET_S * (num_buckets - 1)


def compiled_run_seconds(plan: Plan, layout: Layout, steps: int) -> float:
    """The run's estimated seconds with the step compiled: each step at the layout's
    expected rate, or at the host's floor per micro-batch where that is slower (NaN
    without rates: a CPU plan)."""
    trainers = layout.world_size if layout.colocated else layout.world_size - layout.num_targets
    floor = MICRO_BATCH_FLOOR_S * plan.micro_per_step / max(1, trainers)
    return steps * max(plan.batch_size / layout.samples_per_s, floor)


@dataclass(frozen=True)
class WarmupChoice:
    """What this run compiles before its first step, and why (one line for the start log)."""

    compile: CompileSettings
    buckets: tuple[int, ...]  # warmed up before data flows: the buckets the run meets
    reason: str


def choose_warmup(settings: CompileSettings, plan: Plan, layout: Layout, steps: int,
                  buckets: tuple[int, ...], cuda: bool) -> WarmupChoice:
    """Whether the run compiles (decided here under ``compile.enabled=auto`` on CUDA) and
    which buckets its warmup covers: ``buckets``, those its ``steps`` steps meet. On CUDA
    an eager run warms them up too (flex attention is compiled per shape); the CPU
    trains eager with nothing to warm."""
    if not cuda and not settings.drafter:
        how = "auto: the CPU" if settings.auto else "false"
        return WarmupChoice(settings, (), f"compile: off (compile.enabled={how}), nothing to warm up")
    skipped = sorted(set(plan.buckets) - set(buckets))
    met = f"{len(buckets)} of {len(plan.buckets)} length bucket(s), {list(buckets)}" + (
        f" (no micro-batch of the run is padded to {skipped})" if skipped else "")
    if not settings.pending:
        on = settings.drafter
        how = f"compile.enabled={'auto' if settings.auto else str(on).lower()}"
        return WarmupChoice(settings, buckets, f"compile: {'on' if on else 'off'} ({how}); warmup: {met}")
    compiled = compiled_run_seconds(plan, layout, steps)
    cost, saving = compile_seconds(len(buckets)), (EAGER_SLOWDOWN - 1) * compiled
    on = math.isfinite(compiled) and saving > cost
    weighed = (f"{steps} steps are estimated at {_s(compiled)} compiled and {_s(EAGER_SLOWDOWN * compiled)} eager, "
               f"and a cold compile of {len(buckets)} bucket(s) at {_s(cost)}, "
               f"{'less' if on else 'more'} than the {_s(saving)} it would save")
    chosen = replace(settings, drafter=on, target=on and settings.target, pending=False)
    verdict = "on" if on else "off, training eager"
    return WarmupChoice(chosen, buckets, f"compile: {verdict} (compile.enabled=auto: {weighed}; compile.enabled=true "
                                         f"or false decides instead); warmup: {met}")


def break_even(plan: Plan, layout: Layout) -> str:
    """For the plan's printout: the run length from which ``compile.enabled=auto`` compiles,
    with every bucket counted (a dry run reads no data, so neither the steps nor the
    buckets met are known yet)."""
    per_step = compiled_run_seconds(plan, layout, 1)
    if not math.isfinite(per_step):
        return "compile: auto is off on the CPU"
    cost = compile_seconds(len(plan.buckets))
    steps = math.ceil(cost / ((EAGER_SLOWDOWN - 1) * per_step))
    return (f"compile: auto compiles a run of more than {steps:,} steps (a cold compile of {len(plan.buckets)} "
            f"bucket(s), about {_s(cost)}, against the {EAGER_SLOWDOWN - 1:.0%} of each {per_step:.2f} s step it "
            "saves); a shorter one trains eager")


def _s(seconds: float) -> str:
    return f"{seconds:,.0f} s" if seconds < 3600 else f"{seconds / 3600:,.1f} h"
