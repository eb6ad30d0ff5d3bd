"""Regression pins of ``compile.enabled=auto``'s arithmetic (dflash.run.warmup): the documented
compile estimates, the run time it weighs them against and the sentence each choice prints,
all as numbers worked out by hand, not derived from the functions under test.

By hand: a cold compile is 43 s for the first bucket and 20 s for each further one (0, 43,
63, 83 s for 0..3 buckets); compiling saves 35% of the compiled run's time; a step takes
``batch_size / samples_per_s`` seconds, or 0.017 s per micro-batch spread over the
drafter's ranks where that is slower."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from dflash.compile import CompileSettings
from dflash.run.build import build_job
from dflash.run.config import compose_config
from dflash.run.warmup import _s, break_even, choose_warmup, compile_seconds, compiled_run_seconds

AUTO = CompileSettings(drafter=True, target=True, backend="inductor", mode="reduce-overhead", strict=False,
                       warmup_turns=1, auto=True, pending=True)
TAIL = "compile.enabled=true or false decides instead"


def plan(batch_size: int = 16, micro_per_step: int = 4, buckets=(128, 256, 512)) -> SimpleNamespace:
    return SimpleNamespace(batch_size=batch_size, micro_per_step=micro_per_step, buckets=buckets)


def layout(samples_per_s: float = 8.0, world_size: int = 1, colocated: bool = True, num_targets: int = 0):
    return SimpleNamespace(samples_per_s=samples_per_s, world_size=world_size, colocated=colocated,
                           num_targets=num_targets)


def test_the_documented_compile_estimates():
    assert [compile_seconds(n) for n in (0, 1, 2, 3, 4)] == [0.0, 43.0, 63.0, 83.0, 103.0]


@pytest.mark.parametrize(("shape", "steps", "seconds"), [
    (dict(samples_per_s=8.0), 3, 6.0),  # 16 samples at 8/s: 2 s a step
    (dict(samples_per_s=1e9), 3, 0.204),  # the floor: 4 micro-batches of 0.017 s on one rank
    (dict(samples_per_s=1e9, world_size=4), 3, 0.051),  # colocated: four ranks train
    (dict(samples_per_s=1e9, world_size=4, colocated=False, num_targets=2), 3, 0.102),  # two of four train
    (dict(samples_per_s=1e9, world_size=1, colocated=False, num_targets=1), 3, 0.204),  # none counted as one
])
def test_the_compiled_run_time_is_the_rate_or_the_hosts_floor(shape, steps, seconds):
    assert compiled_run_seconds(plan(), layout(**shape), steps) == pytest.approx(seconds, rel=1e-12)


def test_seconds_print_as_seconds_below_an_hour_and_as_hours_from_it():
    assert [_s(0), _s(59.4), _s(1234.4), _s(3599.4), _s(3600), _s(3780.4), _s(5400), _s(27000)] == [
        "0 s", "59 s", "1,234 s", "3,599 s", "1.0 h", "1.1 h", "1.5 h", "7.5 h"]  # 3780.4 s: 1.0501 h


def test_auto_weighs_the_saving_against_the_compile_and_says_so():
    """100 steps of 2 s: 200 s compiled, 270 s eager, a 70 s saving against 63 s for the two
    buckets met: on. At 90 steps the saving is 63 s, not more than the compile: off."""
    on = choose_warmup(AUTO, plan(), layout(), 100, (128, 256), cuda=True)
    assert on.compile == replace(AUTO, pending=False) and on.buckets == (128, 256)
    assert on.reason == (
        "compile: on (compile.enabled=auto: 100 steps are estimated at 200 s compiled and 270 s eager, and a cold "
        "compile of 2 bucket(s) at 63 s, less than the 70 s it would save; " + TAIL + "); warmup: 2 of 3 length "
        "bucket(s), [128, 256] (no micro-batch of the run is padded to [512])")
    off = choose_warmup(AUTO, plan(), layout(), 89, (128, 256, 512), cuda=True)
    assert off.compile == replace(AUTO, drafter=False, target=False, pending=False)
    assert off.buckets == (128, 256, 512)  # eager on CUDA still warms flex attention up per shape
    assert off.reason == (
        "compile: off, training eager (compile.enabled=auto: 89 steps are estimated at 178 s compiled and 240 s eager, "
        "and a cold compile of 3 bucket(s) at 83 s, more than the 62 s it would save; " + TAIL + "); warmup: 3 of 3 "
        "length bucket(s), [128, 256, 512]")


def test_a_run_of_no_steps_saves_nothing_and_compiles_nothing():
    """Nothing saved against nothing to compile: not more, so eager."""
    choice = choose_warmup(AUTO, plan(), layout(), 0, (), cuda=True)
    assert not choice.compile.drafter and choice.buckets == ()
    assert "0 steps are estimated at 0 s compiled and 0 s eager, and a cold compile of 0 bucket(s) at 0 s, more than " \
           "the 0 s it would save" in choice.reason


def test_a_long_run_is_weighed_in_hours_and_keeps_the_target_off_if_asked():
    no_target = replace(AUTO, target=False)
    choice = choose_warmup(no_target, plan(), layout(), 10_000, (128,), cuda=True)
    assert choice.compile == replace(no_target, drafter=True, target=False, pending=False)
    assert "10000 steps are estimated at 5.6 h compiled and 7.5 h eager, and a cold compile of 1 bucket(s) at 43 s, " \
           "less than the 1.9 h it would save" in choice.reason


@pytest.mark.parametrize(("settings", "cuda", "said"), [
    (replace(AUTO, drafter=False, target=False, pending=False), False,
     "compile: off (compile.enabled=auto: the CPU), nothing to warm up"),
    (replace(AUTO, drafter=False, target=False, auto=False, pending=False), False,
     "compile: off (compile.enabled=false), nothing to warm up"),
])
def test_the_cpu_trains_eager_with_nothing_to_warm_up(settings, cuda, said):
    choice = choose_warmup(settings, plan(), layout(), 100, (128,), cuda=cuda)
    assert (choice.compile, choice.buckets, choice.reason) == (settings, (), said)


@pytest.mark.parametrize(("settings", "cuda", "said"), [
    (replace(AUTO, auto=False, pending=False), False, "compile: on (compile.enabled=true); warmup: "),
    (replace(AUTO, drafter=False, target=False, auto=False, pending=False), True,
     "compile: off (compile.enabled=false); warmup: "),
    (replace(AUTO, pending=False), True, "compile: on (compile.enabled=auto); warmup: "),
])
def test_a_decided_compile_is_kept_and_warms_the_buckets_met(settings, cuda, said):
    """``compile.enabled=true`` on the CPU (the tests' aot_eager runs) still warms up."""
    choice = choose_warmup(settings, plan(), layout(), 100, (256,), cuda=cuda)
    assert (choice.compile, choice.buckets) == (settings, (256,))
    assert choice.reason == said + "1 of 3 length bucket(s), [256] (no micro-batch of the run is padded to [128, 512])"


def test_break_even_of_a_plan_by_hand():
    """83 s / (35% of 2 s) = 118.6: more than 119 steps compile."""
    assert break_even(plan(), layout()) == (
        "compile: auto compiles a run of more than 119 steps (a cold compile of 3 bucket(s), about 83 s, against "
        "the 35% of each 2.00 s step it saves); a shorter one trains eager")
    assert break_even(plan(), layout(samples_per_s=math.nan)) == "compile: auto is off on the CPU"


def cuda_job(overrides: list[str]):
    return build_job(compose_config(["estimate.device=cuda", "dry_run=true", *overrides]), 1)


def test_the_paper_plan_compiles_from_39_steps():
    """Qwen3-8B, train=paper on one H200: 32 samples at the plan's 5.23 samples/s are 6.12 s a
    step, and 83 s / (35% of 6.12 s) = 38.8, so a run of 39 steps compiles and one of 38
    does not."""
    job = cuda_job(["target=qwen3_8b", "train=paper"])
    p, l = job.plan, job.layout.taken
    assert p.buckets == (1024, 2048, 3072) and p.batch_size == 32
    assert break_even(p, l) == ("compile: auto compiles a run of more than 39 steps (a cold compile of 3 bucket(s), "
                                "about 83 s, against the 35% of each 6.12 s step it saves); a shorter one trains eager")
    assert choose_warmup(AUTO, p, l, 39, p.buckets, cuda=True).compile.drafter
    assert not choose_warmup(AUTO, p, l, 38, p.buckets, cuda=True).compile.drafter


def test_the_embedded_default_compiles_only_past_8656_steps():
    """Its 2 micro-batches a step at the host's floor are 0.034 s, and its 4 buckets 103 s:
    103 / (35% of 0.034) = 8655.5."""
    job = cuda_job([])
    assert break_even(job.plan, job.layout.taken).startswith(
        "compile: auto compiles a run of more than 8,656 steps (a cold compile of 4 bucket(s), about 103 s, against "
        "the 35% of each 0.03 s step")
    cpu = build_job(compose_config([]), 1)
    assert break_even(cpu.plan, cpu.layout.taken) == "compile: auto is off on the CPU"
