"""The benchmark's FLOP count matches docs/DESIGN.md section 6, and both bench commands run."""

import json

import pytest
import torch
from runs import RANDOM_TARGET

from dflash.bench.decoding import format_decode, parse_decode, run_decode
from dflash.bench.p2p import format_p2p, run_p2p
from dflash.bench.roles import PACKED_ROWS, format_rows, packed_batches, run_bench
from dflash.bench.timing import bench_job
from dflash.bench.training import format_training, run_training
from dflash.bench.warmup import format_warmup, run_warmup
from dflash.model.drafter import DFlashDrafter
from dflash.model.target import random_target
from dflash.run.estimate import drafter_flops, keys_per_token, prefill_flops
from dflash.run.step import DrafterTrainer

TINY = ["wandb.mode=disabled", "train.micro_batch_size=2", "train.num_anchors=4", "train.max_len=64",
        "train.buckets=[64]", "drafter.num_layers=1", "compile.backend=aot_eager"]


def test_flop_count_of_the_design_reference():
    job = bench_job(["target=qwen3_8b", "train=paper"])
    config = job.target_config
    drafter = job.drafter
    with torch.device("meta"):
        params = sum(p.numel() for p in DFlashDrafter(drafter).parameters())
    assert params == pytest.approx(1.049e9, rel=1e-3)
    assert drafter_flops(drafter, 3072, 512, config.vocab_size) / 1e12 == pytest.approx(71.0, abs=0.05)
    # the public trainer's 43.3% MFU: 10.1 samples/s at S=768, 256 anchors, over 790 TFLOP/s
    assert 10.1 * drafter_flops(drafter, 768, 256, config.vocab_size) / 790e12 == pytest.approx(0.433, abs=0.002)


def test_bench_reports_every_role(tmp_path):
    report = run_bench(bench_job(TINY), steps=1, peak_tflops=790.0, modes=["eager", "compile"],
                       checkpoint_dir=str(tmp_path))
    rows = {(r["role"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {("target", "eager"), ("target", "compile"), ("drafter", "eager"), ("drafter", "compile"),
                         ("colocated", "compiled"), ("checkpoint", "dcp"), ("drafter", "compile, warm start")}
    assert rows[("drafter", "compile")]["compile_s"] and not rows[("drafter", "eager")]["compile_s"]
    assert rows[("drafter", "compile, warm start")]["warmup_s"] > 0
    assert rows[("checkpoint", "dcp")]["load_s"] >= 0 and (tmp_path / "step_00000001").is_dir()
    assert rows[("drafter", "compile")]["graphs"] == 2 and rows[("drafter", "eager")]["graphs"] == 0  # step, masks
    assert all(r["step_ms"] > 0 for r in report["rows"] if "step_ms" in r)
    assert sum("step_ms" in r for r in report["rows"]) == 5
    json.dumps(report)
    assert "mfu_pct" in format_rows(report)


def test_decode_bench_times_the_evaluation_loops():
    report = run_decode(bench_job(TINY), parse_decode("3x6"), batch_one=1, profile=2)
    rows = {r["mode"]: r for r in report["decode"]}
    assert "Self CPU" in report["profile"]
    assert set(rows) == {"speculative, batch 32", "speculative, batch 1", "greedy baseline, batch 32"}
    assert rows["speculative, batch 32"]["new_tokens"] == 18 and rows["speculative, batch 1"]["new_tokens"] == 6
    assert rows["greedy baseline, batch 32"]["lossless_prompts"] == 3  # float32 on the CPU
    assert "tokens/s" in format_decode(report)
    with pytest.raises(SystemExit, match="PROMPTSxNEW_TOKENS"):
        parse_decode("64")


def test_every_timed_row_amortises_the_optimizer_over_the_accumulation(monkeypatch):
    """The drafter and colocated rows both run ``accumulation`` micro-batches per optimizer
    step, as training does (a colocated row that stepped after every micro-batch charged
    each sample a whole AdamW step over 1B parameters)."""
    calls = {"micro_step": 0, "finish": 0}
    for name in calls:
        original = getattr(DrafterTrainer, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(DrafterTrainer, name, counted)
    report = run_bench(bench_job(TINY), steps=1, peak_tflops=790.0, modes=["eager"], accumulation=3)
    assert {r["role"] for r in report["rows"]} == {"target", "drafter", "colocated"}
    assert calls["finish"] > 2 and calls["micro_step"] == 3 * calls["finish"]


def test_warmup_bench_staggers_two_processes():
    report = run_warmup(TINY + ["compile.enabled=true"], procs=2)
    at_once, staggered = report["all_at_once"]["ranks"], report["staggered"]["ranks"]
    assert [r["turn"] for r in at_once] == [0, 0] and [r["turn"] for r in staggered] == [0, 1]
    assert staggered[1]["began"] >= staggered[0]["ended"]
    assert all(r["graphs"] == 2 for r in at_once + staggered)  # the step and its masks
    assert "staggered" in format_warmup(report)


def test_p2p_bench_sends_bundles_between_two_ranks():
    report = run_p2p(TINY, rounds=2)["p2p"]
    # 2 sequences x 64 tokens x (5 layers x 128) fp32 features alone are 0.33 MB
    assert report["backend"] == "gloo" and report["bundle_mb"] > 0.32
    assert report["bundle_gb_per_s"] > 0 and report["raw_gb_per_s"] > 0
    assert "GB/s" in format_p2p({"p2p": report})


@pytest.mark.parametrize("layout", [[], ["topology.target_ranks=1"]], ids=["auto", "split"])
def test_training_bench_times_the_steps_of_a_run_on_two_ranks(layout):
    """Two ranks under torchrun, as a user launches them: the steps after the untimed ones,
    the samples/s of all of them together, and the layout the plan named is the one the
    ranks ran."""
    overrides = [*RANDOM_TARGET, "wandb.mode=disabled", "train.batch_size=4", "train.micro_batch_size=2",
                 "train.num_anchors=4", "drafter.num_layers=1", *layout]
    report = run_training(overrides, ranks=2, steps=2)
    assert report["steps"] == 2 and report["samples_per_step"] == 4
    assert len(report["step_samples_per_s"]) == 2 and report["samples_per_s"] > 0
    assert report["samples_per_s"] == pytest.approx(2 / sum(1 / r for r in report["step_samples_per_s"]), rel=1e-2)
    assert report["samples_per_s_per_gpu"] == pytest.approx(report["samples_per_s"] / 2, rel=1e-3)
    roles = sorted(r["role"] for r in report["ranks"])
    assert roles == (["colocated"] * 2 if report["layout"] == "colocated data-parallel" else ["drafter", "target"])
    if layout:
        assert report["layout"] == "1 target / 1 drafter"
    assert "per GPU" in format_training(report)


def test_prefill_flops_count_only_the_layers_that_run():
    from transformers import AutoModelForCausalLM

    from dflash.run.estimate import prefill_flops

    job = bench_job(["target=qwen3_8b", "train=paper"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(job.target_config)
    ids = list(job.plan.layer_ids)
    assert ids == [1, 9, 17, 25, 33]
    # 34 of 36 layers run without top-k logits; all 36 and the LM head with them
    assert prefill_flops(model, 3072, False, ids) / 1e12 == pytest.approx(42.94, abs=0.01)
    head = model.get_output_embeddings().weight.numel()
    full = prefill_flops(model, 3072, True, ids)
    assert (full - 2 * head * 3072) / 1e12 == pytest.approx(45.46, abs=0.01)


def test_a_packed_bench_counts_the_work_of_the_rows_every_role_cycles_over():
    """Packed rows differ in attention work with their samples' lengths: the prefill row
    runs and counts the same rows as the drafter and colocated rows, not the first alone."""
    job = bench_job([*TINY, "train.packing=true", "data=synthetic", "data.mean_length=24", "train.micro_batch_size=1"])
    report = run_bench(job, steps=1, peak_tflops=790.0, modes=["eager"])
    batches, _ = packed_batches(job, job.target_config.vocab_size, PACKED_ROWS)
    shapes = report["shapes"]
    assert shapes["rows"] == PACKED_ROWS
    keys = [keys_per_token(b) for b in batches]
    assert len(set(keys)) > 1, "the rows should differ, or this test shows nothing"
    assert shapes["keys_per_token"] == round(sum(keys) / len(keys))
    model = random_target(job.target_config, torch.device("cpu"), torch.float32, 0)
    flops = [prefill_flops(model, 64, False, list(job.plan.layer_ids), k) for k in keys]
    prefill = next(r for r in report["rows"] if r["role"] == "target")
    assert prefill["tflop_per_step"] == round(sum(flops) / len(flops) / 1e12, 2)
    assert "8 packed rows" in format_rows(report)
