"""dry_run: the plan of a real preset in seconds, with no weights read and nothing written;
plans that cannot run are refused with the key to change."""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dflash.run.build as build_module
import dflash.run.estimate as estimate_module
import dflash.run.layout as layout_module
from dflash.data.bundle import flatten, random_batch, random_prefill
from dflash.distributed.topology import TopologyError
from dflash.flex import flash_unsupported
from dflash.model.drafter import DrafterConfig
from dflash.run.build import build_job, meta_models
from dflash.run.config import compose_config
from dflash.run.estimate import (
    Cost,
    drafter_attention_flops,
    drafter_flops,
    prefill_attention_flops,
    prefill_flops,
    seconds_per_row,
)
from dflash.run.layout import (
    DoesNotFit,
    Layout,
    faster_split_barred_by_batch,
    format_options,
)
from dflash.train import run_role

ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B = ["target=qwen3_8b", "train=paper", "dry_run=true", "estimate.nproc=8"]


def cost(overrides: list[str]) -> Cost:
    """What one process of these overrides costs each role, at the micro-batch it takes."""
    return build_job(compose_config(overrides), 1).layout.taken.cost


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


def test_a_plan_that_cannot_run_is_refused_with_the_key_to_change(capsys):
    with pytest.raises(SystemExit, match="refused.*drafter rank needs an estimated.*train.micro_batch_size"):
        printed_plan(capsys, [*QWEN3_8B, "train.batch_size=30", "estimate.device_gib=24"])
    with pytest.raises(SystemExit, match="train.batch_size=32 must be a multiple"):
        printed_plan(capsys, [*QWEN3_8B, "train.batch_size=32", "topology.target_ranks=3"])
    with pytest.raises(SystemExit, match="train.batch_size=7 must be a multiple"):
        printed_plan(capsys, [*QWEN3_8B, "train.batch_size=7", "train.micro_batch_size=2"])


def test_a_split_asked_of_the_layout_mode_suits_the_batch():
    """``topology.mode=disaggregated`` with ``target_ranks=auto`` splits by FLOPs, then moves to
    the nearest split the batch divides over; colocated with a number of target ranks is
    refused rather than run colocated."""
    job = build_job(compose_config(["target=qwen3_8b", "target.path=random", "train=paper",
                                    "topology.mode=disaggregated"]), 8)
    assert job.plan.batch_size == 32
    assert job.layout.targets == 4  # by FLOPs 3, whose 5 drafters do not divide 32
    with pytest.raises(TopologyError, match="topology.target_ranks=2 splits .* drop one of the two"):
        build_job(compose_config(["target=qwen3_8b", "target.path=random", "train=paper", "topology.mode=colocated",
                                  "topology.target_ranks=2"]), 8)


def test_bundle_bytes_are_those_of_a_real_bundle():
    job = build_job(compose_config(["loss.kl_topk=4", "loss.kl_weight=0.5", "train.micro_batch_size=2"]))
    plan = job.plan
    vocab = job.target_config.get_text_config().vocab_size
    seq_len = max(plan.buckets)
    batch = random_batch(plan.micro_batch_size, seq_len, vocab, plan.anchor_spec())
    prefill = random_prefill(plan.micro_batch_size, seq_len, plan.feature_dim, torch.float32, plan.topk, vocab, "cpu")
    real = sum(t.numel() * t.element_size() for t in flatten(batch, prefill))
    assert job.layout.taken.cost.bundle_bytes == real
    assert math.isnan(job.layout.taken.cost.target_rate), "no rate guess for a CPU run"


def test_evaluation_while_training_is_planned_on_target_rank_0(tmp_path):
    proc = dry_run(tmp_path, QWEN3_8B + ["train.batch_size=30", "eval.every=500"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2.0 evaluation drafter" in proc.stdout  # 1.049B parameters in bf16
    assert "every 500 steps on target rank 0" in proc.stdout


def test_sliding_layers_count_only_the_keys_in_their_window():
    """docs/DESIGN.md section 6 by hand: H=64, q=64, kv=32, I=128, L=2, B=4, 3 anchors
    (Tq=12, Td=9), S=20, V=96, n=3; the mean anchor sits at (S-B)/2 = 8."""
    def config(layer_types=None, window=None):
        return DrafterConfig(64, 128, 2, 4, 2, 16, 96, 6, [1, 2, 3], 95, 4, layer_types=layer_types,
                             sliding_window=window)

    rest = (6 * (2 * 64 * 64 + 2 * 64 * 32) * 2 * 12  # block attention projections
            + 6 * (3 * 64 * 128) * (12 + 9)  # MLPs, the last on the drafted slots
            + 6 * (2 * 64 * 32) * 2 * 20  # context K/V
            + 4 * (3 * 64 * 64) * 20  # fc
            + 4 * 64 * 96 * 9)  # LM head
    full_layer = 12 * 64 * 12 * (8 + 4)  # half the context and the whole block
    assert drafter_flops(config(), 20, 3, 96) == rest + 2 * full_layer
    # window 4: slot k at 8 + k sees keys (8 + k - 4, 8 + k], four of them
    assert drafter_flops(config(["sliding_attention", "full_attention"], 4), 20, 3, 96) == \
        rest + full_layer + 12 * 64 * 12 * 4 == 7_200_768
    # window 10: the slots see 9, 10, 10, 10 keys (slot 0 has only positions 0..8)
    assert drafter_flops(config(["sliding_attention"] * 2, 10), 20, 3, 96) == rest + 2 * 12 * 64 * 12 * 9.75


def test_layer_types_are_checked_before_anything_loads():
    with pytest.raises(ValueError, match="drafter.layer_types has 1 entries but the drafter has drafter.num_layers=5"):
        build_job(compose_config(["drafter.layer_types=[sliding_attention]"]))
    with pytest.raises(ValueError, match="drafter.sliding_window must be an integer >= 1"):
        build_job(compose_config(["drafter.num_layers=1", "drafter.layer_types=[sliding_attention]"]))


def test_a_faster_split_the_batch_does_not_divide_is_named_with_a_batch_that_would():
    """The paper shapes' rates on 8 ranks with 32 micro-batches per step: 3 target / 5
    drafter ranks would beat every split offered, and 35 (or 40) micro-batches allow it."""
    rates = Cost(32, 1, 0, 0, 0, 0, {}, {}, 140.0, 0.0, 0.0, target_rate=14.7, drafter_rate=8.12, rates_from="")

    def option(targets: int) -> Layout:
        return Layout(8, targets, 3, rates)

    offered = [option(t) for t in (0, 4, 6, 7)]
    targets, per_gpu, micro_batches = faster_split_barred_by_batch(offered)
    assert (targets, micro_batches) == (3, 35) and per_gpu == pytest.approx(5 * 8.12 / 8)
    text = format_options(offered, 0, micro_batch_size=1)
    assert "3 target / 5 drafter would predict" in text and "train.batch_size=35 would allow it" in text
    assert faster_split_barred_by_batch([option(t) for t in (0, 3, 4)]) is None  # the best split is offered


def test_estimate_device_plans_a_gpu_run_from_a_machine_without_one():
    """On a CPU-only machine a one-rank plan is the CPU run this command would start
    (float32 weights, no rate); ``estimate.device=cuda`` plans the one-GPU run instead."""
    def planned(device: str | None) -> Cost:
        return cost(["target=qwen3_8b", "target.path=random", "train=paper", f"estimate.device={device or 'null'}"])

    gpu, cpu = planned("cuda"), planned("cpu")
    assert gpu.target_gib["weights"] == pytest.approx(cpu.target_gib["weights"] / 2)
    assert gpu.target_gib["weights"] == pytest.approx(8.19e9 * 2 / 2**30, rel=1e-2)
    assert math.isfinite(gpu.drafter_rate) and math.isnan(cpu.drafter_rate)
    if not torch.cuda.is_available():
        assert planned(None).target_gib == cpu.target_gib
    with pytest.raises(ValueError, match="estimate.device='tpu'"):
        planned("tpu")


QWEN3_8B_ROWS = ["target=qwen3_8b", "target.path=random", "train=paper", "train.buckets=null"]
REFERENCE = ["train.max_len=768", "train.num_anchors=256"]
PACKED = ["train.packing=true", "data=synthetic", "data.mean_length=4500"]
SWA = ["drafter.layer_types=[sliding_attention,sliding_attention,sliding_attention,sliding_attention,full_attention]",
       "drafter.sliding_window=2048"]


def long_context(max_len: int, anchors: int) -> list[str]:
    """A GPU plan of Qwen3-8B shapes, packed rows of the synthetic mix, 4 sliding layers and one full."""
    return [*QWEN3_8B_ROWS, *PACKED, "estimate.device=cuda", f"train.max_len={max_len}", f"train.num_anchors={anchors}",
            *SWA]


# The drafter step's most allocated memory on one H200 plus its AdamW state (7.81 GiB, made
# after the warmup's peak), Qwen3-8B shapes, packed synthetic rows, 4 sliding layers (window
# 2,048) and one full, reduce-overhead (docs/benchmarks/2026-12-02-h200-long-context-memory-rates.md, "The drafter's memory at long context").
MEASURED_DRAFTER_GIB = {(65536, 5461): 90.95, (32768, 5461): 86.98, (16384, 5461): 84.99, (32768, 2730): 56.62,
                        (8192, 1365): 38.42}


@pytest.mark.parametrize(("max_len", "anchors"), list(MEASURED_DRAFTER_GIB))
def test_the_drafter_ranks_memory_is_planned_within_a_few_percent_above_the_h200s(max_len, anchors):
    planned = sum(cost(long_context(max_len, anchors)).drafter_gib.values())
    assert 1.0 <= planned / MEASURED_DRAFTER_GIB[max_len, anchors] <= 1.06


def test_a_colocated_rank_holds_one_working_set_at_a_time():
    """The prefill's activations are freed before the drafter step starts: a colocated rank
    needs both models' state and the larger working set, not their sum."""
    e = cost(["target=qwen3_8b", "target.path=random", "train=paper", "estimate.device=cuda"])
    state = e.target_gib["weights"] + sum(v for k, v in e.drafter_gib.items() if k != "activations")
    working = max(e.target_gib["activations"], e.drafter_gib["activations"])
    assert sum(e.colocated_gib.values()) == pytest.approx(state + working)
    assert e.drafter_gib["activations"] > e.target_gib["activations"] > 0


# Rows measured on one H200 by `dflash.bench` (BENCHMARKS.md): overrides, micro-batch, the rows'
# mean keys per prefill token or anchor context (packed rows; None: one sample per row), the
# attention's rate (`ATTENTION_FLOPS`), ms per row. The last two prefills ran flex attention on
# FlashAttention-4's kernels (`compile.attention=flash`).
MEASURED_PREFILLS = [([], 1, None, "causal", 68.06), (REFERENCE, 4, None, "causal", 64.38),
                     (PACKED + ["train.max_len=8192", "train.num_anchors=1365"], 1, 2663.59, "packed", 207.32),
                     (PACKED + ["train.max_len=32768", "train.num_anchors=5461"], 1, 2880.00, "packed", 842.68),
                     (PACKED + ["train.max_len=8192", "train.num_anchors=1365"], 1, 2663.59, "packed flash", 198.87),
                     (PACKED + ["train.max_len=32768", "train.num_anchors=5461"], 1, 2880.00, "packed flash", 799.87)]
MEASURED_DRAFTER_STEPS = [([], 1, None, 123.07), (REFERENCE, 4, None, 224.82),
                          (PACKED + ["train.max_len=32768", "train.num_anchors=5461"], 1, 3165.19, 1457.0)]


@pytest.mark.parametrize(("overrides", "micro", "keys", "attention", "ms"), MEASURED_PREFILLS)
def test_the_planned_prefill_time_is_the_h200s(overrides, micro, keys, attention, ms):
    job = build_job(compose_config(QWEN3_8B_ROWS + overrides))
    target, _ = meta_models(job.source, job.target_config, job.drafter)
    args = (target, job.plan.max_len, False, list(job.plan.layer_ids), keys)
    planned = micro * seconds_per_row(prefill_flops(*args), prefill_attention_flops(*args), "target", attention)
    assert 1e3 * planned == pytest.approx(ms, rel=0.02)


@pytest.mark.parametrize(("overrides", "micro", "context", "ms"), MEASURED_DRAFTER_STEPS)
def test_the_planned_drafter_step_time_is_the_h200s(overrides, micro, context, ms):
    job = build_job(compose_config(QWEN3_8B_ROWS + overrides))
    _, drafter = meta_models(job.source, job.target_config, job.drafter)
    vocab = job.target_config.get_text_config().vocab_size
    args = (drafter.config, job.plan.max_len, job.plan.num_anchors)
    flops = drafter_flops(*args, vocab, context)
    planned = micro * seconds_per_row(flops, drafter_attention_flops(*args, context), "drafter", "drafter")
    assert 1e3 * planned == pytest.approx(ms, rel=0.02)


# Drafter steps with flex attention on FlashAttention-4's kernels (`compile.attention=flash`), on
# one H200: ms against the Triton kernels' on the same machine (which ran the drafter 3-14% slower
# than the rows above).
MEASURED_FLASH_DRAFTER_STEPS = [([], None, 134.14 / 140.41),
                                (PACKED + ["train.max_len=8192", "train.num_anchors=1365"], 2920.0, 344.04 / 370.05)]


@pytest.mark.parametrize(("overrides", "context", "ratio"), MEASURED_FLASH_DRAFTER_STEPS)
def test_the_planned_drafter_step_on_flash_kernels_gains_what_the_h200_measured(overrides, context, ratio):
    job = build_job(compose_config(QWEN3_8B_ROWS + overrides))
    _, drafter = meta_models(job.source, job.target_config, job.drafter)
    args = (drafter.config, job.plan.max_len, job.plan.num_anchors)
    flops = drafter_flops(*args, job.target_config.get_text_config().vocab_size, context)
    attention = drafter_attention_flops(*args, context)
    planned = seconds_per_row(flops, attention, "drafter", "drafter flash") / seconds_per_row(flops, attention, "drafter", "drafter")
    assert planned == pytest.approx(ratio, abs=0.01)


def test_a_plan_for_flash_kernels_predicts_their_rates():
    """``compile.attention=flash`` (here on a machine without a GPU, as a dry run) plans the
    packed rows at FlashAttention-4's rates and says so."""
    if torch.cuda.is_available() and flash_unsupported(torch.device("cuda")):
        pytest.skip("this GPU cannot run FlashAttention-4's kernels, so compile.attention=flash is refused here")

    def planned(attention: str) -> Cost:
        return cost([*QWEN3_8B_ROWS, *PACKED, "estimate.device=cuda", f"compile.attention={attention}"])

    flash, triton = planned("flash"), planned("triton")
    assert flash.target_rate > triton.target_rate and flash.drafter_rate > triton.drafter_rate
    assert "FlashAttention-4" in flash.rates_from and "FlashAttention-4" not in triton.rates_from


def test_a_plan_that_fits_nowhere_is_refused_for_the_layout_nearest_to_fitting():
    """At 64k with the paper's anchor density no layout of 8 H200s fits: the refusal names
    the drafter rank of a split (152 GiB), not the colocated rank (168 GiB), and the keys
    that shrink a drafter rank."""
    with pytest.raises(DoesNotFit, match=r"a drafter rank needs an estimated 15\d\.\d GiB.*lower train.num_anchors"):
        build_job(compose_config(long_context(65536, 10922)), 8)


# The paper preset planned for one H200 in this process; the reference configuration's shapes
PAPER_ON_AN_H200 = ["target=qwen3_8b", "target.path=random", "train=paper", "estimate.device=cuda",
                    "estimate.device_gib=139.8"]
REFERENCE_CONFIGURATION = ["train.max_len=768", "train.num_anchors=256", "train.buckets=[768]"]


def printed_plan(capsys, overrides: list[str]) -> str:
    """What ``dry_run=true`` with these overrides prints, run in this process."""
    run_role(compose_config([*overrides, "dry_run=true"]))
    return capsys.readouterr().out


@pytest.mark.parametrize(("overrides", "micro_batch"), [([], "2 sequence(s) of up to 3072 tokens"),
                                                        (REFERENCE_CONFIGURATION, "8 sequence(s) of up to 768 tokens")])
def test_the_paper_preset_fills_8192_tokens_per_micro_batch(capsys, overrides, micro_batch):
    """Twice the sequences of a 4096-token budget: on one H200 at Qwen3-8B shapes they
    measured 5.34 against 5.29 samples/s (3072) and 13.99 against 13.90 (768), and fit."""
    plan = printed_plan(capsys, PAPER_ON_AN_H200 + overrides)
    assert (f"micro-batch: {micro_batch} (auto: the most that fit train.micro_batch_tokens=8192 and divide the "
            "batch of 32)\n") in plan


@pytest.mark.parametrize(("overrides", "usable"), [
    (["estimate.device_gib=60"], "54.0 GiB a rank may plan on (90% of estimate.device_gib=60.0)"),  # 63.0 GiB at 8
    (["estimate.nproc=8", "topology.target_ranks=4", "estimate.device_gib=45"],  # the drafter rank's 47.8 at 8
     "40.5 GiB a rank may plan on (90% of estimate.device_gib=45.0)"),
])
def test_auto_steps_down_to_the_largest_micro_batch_that_fits_a_rank(capsys, overrides, usable):
    """A device too small for the token budget's 8 sequences of 768 tokens, in the layout in
    force (colocated on one GPU; a split of 4 and 4): 4 fits, and the plan says why it took 4."""
    plan = printed_plan(capsys, PAPER_ON_AN_H200 + REFERENCE_CONFIGURATION + overrides)
    assert ("micro-batch: 4 sequence(s) of up to 768 tokens (auto: the most that fit train.micro_batch_tokens=8192 "
            f"and divide the batch of 32, stepped down from 8 to 4 to fit the {usable})") in plan


@pytest.mark.parametrize(("overrides", "why"), [
    ([], "to allow a faster layout, colocated data-parallel (13.84 samples/s per GPU predicted, against 8.90)"),
    (["topology.mode=colocated"], "to split the batch into whole micro-batches over the ranks"),
])
def test_auto_steps_down_where_8_would_bar_colocated_data_parallel(capsys, overrides, why):
    """On 8 ranks a batch of 32 holds 4 micro-batches of 8, too few for 8 colocated ranks:
    4 per micro-batch keeps colocated possible, which predicts 13.84 samples/s per GPU
    against the best split's 8.90 (and is the only layout topology.mode=colocated allows)."""
    plan = printed_plan(capsys, PAPER_ON_AN_H200 + REFERENCE_CONFIGURATION + ["estimate.nproc=8", *overrides])
    assert f"stepped down from 8 to 4 {why})" in plan
    assert "colocated data-parallel      51.4 GiB per rank,  13.84 samples/s per GPU  this run" in plan


def test_the_start_builds_the_meta_models_once_and_costs_each_micro_batch_once(capsys, monkeypatch):
    """The micro-batch sizes tried, the layouts and the one printed share one pair of
    meta-device models, and each size tried is costed once, whatever the count of splits
    arranged from it: a launch plans before any rank starts work."""
    built, costed = [], []
    real_models, real_costs = build_module.meta_models, layout_module.role_costs
    monkeypatch.setattr(build_module, "meta_models", lambda *args: built.append(args) or real_models(*args))
    monkeypatch.setattr(layout_module, "role_costs", lambda *args: costed.append(args[2]) or real_costs(*args))
    plan = printed_plan(capsys, PAPER_ON_AN_H200 + REFERENCE_CONFIGURATION + ["estimate.nproc=8"])
    assert "stepped down from 8 to 4" in plan and "colocated data-parallel" in plan
    assert len(built) == 1
    assert costed == [8, 4, 2, 1]  # the sizes that divide the batch of 32, from the budget's 8 down


def test_an_explicit_micro_batch_is_left_as_given(capsys):
    """Where auto would step down to 4 (above), 8 sequences asked for are planned as 8, and
    refused with the key to change."""
    small = PAPER_ON_AN_H200 + REFERENCE_CONFIGURATION + ["estimate.device_gib=60", "train.micro_batch_size=8"]
    assert build_job(compose_config(small)).plan.micro_batch_size == 8
    refused = r"colocated rank needs an estimated 63\.0 GiB.*lower .*train.micro_batch_size"
    with pytest.raises(SystemExit, match=refused):
        printed_plan(capsys, small)


@pytest.mark.parametrize(("card", "said"), [(None, False), ("NVIDIA H200", False), ("NVIDIA H100 80GB HBM3", True)])
def test_a_plan_on_another_card_says_it_extrapolates_the_h200s_rates(card, said):
    """The plan's rates are one H200's: on any other visible card it says so, naming the card
    and the way to plan from its own rates."""
    job = build_job(compose_config([*QWEN3_8B_ROWS, "estimate.device=cuda"]), 1)
    settings = dataclasses.replace(job.layout_settings, card=card)
    rates_from = estimate_module._rates(settings, job.plan, (1e12, 1e11), (1e12, 1e11), True)[2]
    assert rates_from.startswith("the rates measured on one H200")
    assert ("extrapolated to this NVIDIA H100 80GB HBM3, whose rates are not measured" in rates_from) is said
    assert ("estimate.rates=REPORT" in rates_from) is said
