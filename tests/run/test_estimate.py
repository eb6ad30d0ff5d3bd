"""dry_run: the plan of a real preset in seconds, with no weights read and nothing written;
plans that cannot run are refused with the key to change."""

import math
import subprocess
import sys
from pathlib import Path

import torch

from dflash.data.bundle import flatten, random_batch, random_prefill
from dflash.run.build import build_job
from dflash.run.config import compose_config
from dflash.run.estimate import estimate

ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B = ["target=qwen3_8b", "train=paper", "dry_run=true", "estimate.nproc=8"]


def dry_run(tmp_path, overrides: list[str]) -> subprocess.CompletedProcess:
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "dflash.train", *overrides, f"output_dir={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert not out.exists(), "a dry run writes nothing to the output directory"
    return proc


def test_dry_run_of_an_eight_gpu_qwen3_8b_plan(tmp_path):
    proc = dry_run(tmp_path, QWEN3_8B + ["train.batch_size=30"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout
    assert "on 8 rank(s)" in lines
    assert "rank 0-2      target" in lines and "rank 3-7      drafter" in lines  # auto: 3 targets, 5 drafters
    assert "1.049B trainable" in lines and "8.19B frozen" in lines
    assert lines.count("GiB") >= 3
    assert "drafter step 71.0 T" in lines  # docs/DESIGN.md section 6's count
    assert "samples/s" in lines


def test_a_plan_that_cannot_run_is_refused_with_the_key_to_change(tmp_path):
    small = dry_run(tmp_path, QWEN3_8B + ["train.batch_size=30", "estimate.device_gib=24"])
    assert small.returncode != 0
    assert "refused" in small.stderr and "drafter rank needs an estimated" in small.stderr
    assert "train.micro_batch_size" in small.stderr
    uneven = dry_run(tmp_path, QWEN3_8B + ["train.batch_size=32", "topology.target_ranks=3"])
    assert uneven.returncode != 0 and "train.batch_size=32 must be a multiple" in uneven.stderr
    indivisible = dry_run(tmp_path, QWEN3_8B + ["train.batch_size=7", "train.micro_batch_size=2"])
    assert indivisible.returncode != 0 and "train.batch_size=7 must be a multiple" in indivisible.stderr


def test_bundle_bytes_are_those_of_a_real_bundle():
    job = build_job(compose_config(["loss.kl_topk=4", "loss.kl_weight=0.5", "train.micro_batch_size=2"]))
    plan = job.plan
    vocab = job.target_config.get_text_config().vocab_size
    seq_len = max(plan.buckets)
    batch = random_batch(plan.micro_batch_size, seq_len, vocab, plan.anchor_spec())
    prefill = random_prefill(plan.micro_batch_size, seq_len, plan.feature_dim, torch.float32, plan.topk, vocab, "cpu")
    real = sum(t.numel() * t.element_size() for t in flatten(batch, prefill))
    assert estimate(job, 1, 0).bundle_bytes == real
    assert math.isnan(estimate(job, 1, 0).target_rate), "no rate guess for a CPU run"


def test_evaluation_while_training_is_planned_on_target_rank_0(tmp_path):
    proc = dry_run(tmp_path, QWEN3_8B + ["train.batch_size=30", "eval.every=500"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2.0 evaluation drafter" in proc.stdout  # 1.049B parameters in bf16
    assert "every 500 steps on target rank 0" in proc.stdout
