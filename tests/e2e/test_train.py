"""The trainer end to end on the shipped demo target: outputs, resume, end of data."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from runs import (
    RANDOM_TARGET,
    compose_cfg,
    read_metrics,
    read_records,
    run_colocated,
    run_disaggregated,
    starts,
)
from safetensors.torch import load_file

from dflash.run.metrics import require_wandb


def test_colocated_run_writes_every_output(tmp_path):
    summary = run_colocated(tmp_path, ["train.max_steps=4", "eval.enabled=true", "eval.max_prompts=2", "eval.max_new_tokens=24"])
    assert summary["steps"] == 4 and summary["lossless"] is True
    assert (tmp_path / "config.yaml").is_file()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"step", "loss", "tau_sim", "lr", "samples_per_s", "acc_1", "acc_7"} <= records[0].keys()
    assert (tmp_path / "export" / "config.json").is_file()
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["lossless"] is True and report["results"]["heldout"]["prompts"] == 2


def test_a_dflash2_drafter_trains_exports_decodes_and_trains_on(tmp_path):
    """DFlash2 through the trainer: the selector's term in the loss, the export in the
    released layout decoded losslessly by the path walk, and a second run started from it."""
    dflash2 = ["drafter.variant=dflash2", "drafter.selector_top_k=4", "drafter.selector_rank=8"]
    summary = run_colocated(tmp_path / "a", dflash2 + ["train.max_steps=3", "eval.enabled=true", "eval.max_prompts=2",
                                                       "eval.max_new_tokens=16"])
    assert summary["lossless"] is True
    export = tmp_path / "a" / "export"
    assert json.loads((export / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    first = read_metrics(tmp_path / "a")
    run_colocated(tmp_path / "b", dflash2 + ["train.max_steps=2", f"drafter.init_from={export}"])
    again = read_metrics(tmp_path / "b")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in first + again)
    assert again[0]["loss"] < first[0]["loss"]  # it starts where the first run's training left it


def test_resume_is_exact(tmp_path):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    run_colocated(straight, ["train.max_steps=8"])
    run_colocated(halves, ["train.max_steps=8", "checkpoint.every=4", "checkpoint.keep=10"])
    # forget everything after step 4, then resume from the step-4 checkpoint
    shutil.rmtree(halves / "export")
    shutil.rmtree(halves / "checkpoints" / "step_00000008")
    run_colocated(halves, ["train.max_steps=8", "checkpoint.every=4", "resume=auto"])
    assert starts(halves) == [0, 4]
    a = [r["loss"] for r in read_metrics(straight)]
    b = [r["loss"] for r in read_metrics(halves)]
    assert a == b
    wa = load_file(straight / "export" / "model.safetensors")
    wb = load_file(halves / "export" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_end_of_data_mid_epoch_with_uneven_shards(tmp_path):
    """22 samples in batches of 3: 7 steps and one sample left over; of the 21
    micro-batches target 0 makes 11 and target 1 makes 10. Every rank exits 0."""
    run_disaggregated(
        tmp_path, 3, 2, ["train.max_steps=null", "train.epochs=1", "data.max_samples=22", "train.batch_size=3"]
    )
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 8))


@pytest.mark.parametrize("world", [1, 2])
def test_skipped_input_is_counted_in_the_metrics(tmp_path, world):
    """Bad lines are skipped, and metrics.jsonl says how many, why and where, also when
    the metrics rank (a drafter) never read the data."""
    good = (Path(__file__).parents[2] / "dflash/assets/demo_data/train.jsonl").read_text().splitlines()[:40]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(good[:10] + ["{broken", json.dumps({"conversations": [{"role": "user", "content": "hi"}]})]
                              + good[10:]) + "\n")
    overrides = ["data=jsonl", f"data.path={data}", "data.eval_path=null", "data.min_loss_tokens=1", "train.max_steps=2",
                 f"data.cache_dir={tmp_path / 'cache'}"]
    if world == 1:
        run_colocated(tmp_path / "run", overrides)
    else:
        run_disaggregated(tmp_path / "run", world, 1, overrides)
    summary = next(r for r in read_records(tmp_path / "run") if "data/samples" in r)
    assert summary["data/samples"] > 0 and sum(summary["data/skipped"].values()) == 2
    assert any(p.startswith(f"{data}:11:") for p in summary["data/problems"]), summary["data/problems"]
    assert any(p.startswith(f"{data}:12:") for p in summary["data/problems"]), summary["data/problems"]


def test_unknown_keys_are_errors():
    with pytest.raises(ConfigCompositionException):
        compose_cfg(["train.no_such_key=1"])


def test_auto_split_counts_both_models():
    from dflash.run.build import build_job

    for world in (2, 4, 8):
        assert 1 <= build_job(compose_cfg([]), world).layout.taken.auto_targets <= world - 1


def test_a_missing_wandb_is_refused_at_start(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match="wandb.mode=offline needs the wandb package"):
        require_wandb("offline")
    require_wandb("disabled")


def test_a_wrong_held_out_path_is_refused_before_training(tmp_path):
    """Read at start, not after training, when the export is evaluated."""
    with pytest.raises(FileNotFoundError, match="data.eval_path='.*missing.jsonl' does not exist"):
        run_colocated(tmp_path, ["eval.enabled=true", f"data.eval_path={tmp_path / 'missing.jsonl'}"])
    assert not (tmp_path / "checkpoints").exists()


def test_held_out_prompts_without_a_tokenizer_are_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match="data.eval_path needs a tokenizer"):
        run_colocated(tmp_path, RANDOM_TARGET + ["eval.enabled=true", "data.eval_path=demo_heldout"])
    assert not (tmp_path / "checkpoints").exists()
