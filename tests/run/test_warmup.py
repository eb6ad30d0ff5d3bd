"""What a run compiles before its first step: only the buckets it meets, and under
compile.enabled=auto on CUDA only where the compile pays for itself over the run."""

import json
import math

import pytest

from dflash.compile import CompileSettings
from dflash.run.build import build_job
from dflash.run.config import compose_config
from dflash.run.warmup import EAGER_SLOWDOWN, break_even, choose_warmup, compile_seconds, compiled_run_seconds
from tests.runs import read_records, run_colocated

AUTO = CompileSettings(drafter=True, target=True, backend="inductor", mode="reduce-overhead", strict=False,
                       warmup_turns=1, auto=True, pending=True)


def cuda_job(overrides: list[str]):
    """A one-GPU job planned on this machine (no weights read)."""
    return build_job(compose_config(["estimate.device=cuda", "dry_run=true", *overrides]), 1)


def test_a_short_run_at_the_paper_shapes_trains_eager_and_a_long_one_compiles():
    job = cuda_job(["target=qwen3_8b", "train=paper"])
    plan, layout = job.plan, job.layout.taken
    short = choose_warmup(AUTO, plan, layout, 3, plan.buckets, cuda=True)  # the cold launch: 3 steps
    assert not short.compile.drafter and not short.compile.target and not short.compile.pending
    assert short.buckets == plan.buckets  # eager on CUDA still compiles flex attention per shape, before step 1
    assert "compile: off, training eager" in short.reason and "3 steps" in short.reason
    epoch = choose_warmup(AUTO, plan, layout, 25_000, plan.buckets, cuda=True)  # the paper's recipe runs for days
    assert epoch.compile.drafter and epoch.compile.target and epoch.compile.mode == "reduce-overhead"
    assert "compile: on" in epoch.reason


def test_auto_compiles_from_the_step_count_the_plan_prints():
    job = cuda_job(["target=qwen3_8b", "train=paper"])
    plan, layout = job.plan, job.layout.taken
    per_step = compiled_run_seconds(plan, layout, 1)
    steps = math.ceil(compile_seconds(len(plan.buckets)) / ((EAGER_SLOWDOWN - 1) * per_step))
    assert f"more than {steps:,} steps" in break_even(plan, layout)
    assert choose_warmup(AUTO, plan, layout, steps, plan.buckets, cuda=True).compile.drafter
    assert not choose_warmup(AUTO, plan, layout, steps - 1, plan.buckets, cuda=True).compile.drafter
    # fewer buckets met cost less to compile, so a shorter run already pays for it
    assert choose_warmup(AUTO, plan, layout, steps - 1, plan.buckets[:1], cuda=True).compile.drafter


def test_the_embedded_default_trains_eager_on_a_gpu():
    """Its 300 steps took about 10 s compiled on an H200, after 93.5 s of compiling."""
    job = cuda_job([])
    choice = choose_warmup(AUTO, job.plan, job.layout.taken, 300, job.plan.buckets, cuda=True)
    assert not choice.compile.drafter
    assert compiled_run_seconds(job.plan, job.layout.taken, 300) == pytest.approx(10.2, rel=0.05)


@pytest.mark.parametrize("enabled", [True, False])
def test_compile_enabled_true_or_false_is_kept_whatever_the_run(enabled):
    job = cuda_job(["target=qwen3_8b", "train=paper"])
    asked = CompileSettings(drafter=enabled, target=enabled, backend="inductor", mode="reduce-overhead",
                            strict=False, warmup_turns=1)
    for steps in (1, 10**6):
        choice = choose_warmup(asked, job.plan, job.layout.taken, steps, job.plan.buckets, cuda=True)
        assert choice.compile == asked
        assert f"compile: {'on' if enabled else 'off'} (compile.enabled={str(enabled).lower()})" in choice.reason


def test_the_cpu_trains_eager_with_nothing_to_warm_up():
    job = build_job(compose_config([]), 1)
    assert not job.compile.drafter and not job.compile.pending
    choice = choose_warmup(job.compile, job.plan, job.layout.taken, 300, job.plan.buckets, cuda=False)
    assert choice.buckets == () and "the CPU" in choice.reason


def test_a_run_compiles_only_the_buckets_its_micro_batches_meet(tmp_path):
    """Five buckets, of which the run's 40 demo samples reach two or three: every one
    compiled before would be 10 graphs; strict mode proves no met bucket was missed."""
    out = tmp_path / "run"
    run_colocated(out, ["compile.enabled=true", "compile.backend=aot_eager", "train.max_len=512",
                        "train.buckets=[128,192,256,320,512]"])
    met = next(r["data/buckets"] for r in read_records(out) if "data/buckets" in r)
    assert 0 < len(met) < 5 and set(met) <= {128, 192, 256, 320, 512}
    warmup = json.loads((out / "warmup.json").read_text())[0]
    assert warmup["graphs"] == 2 * len(met)  # the drafter step and its mask, per bucket met


def test_the_data_read_beside_the_target_raises_its_own_error_on_the_main_thread():
    import threading

    from dflash.run.build import in_background

    seen = []

    def read() -> int:
        seen.append(threading.current_thread() is threading.main_thread())
        raise FileNotFoundError("data.path=/absent: no such file")

    with pytest.raises(FileNotFoundError, match="data.path=/absent"):
        in_background(read, "dflash-data").result()
    assert seen == [False]
    assert in_background(lambda: 7, "dflash-data").result() == 7
