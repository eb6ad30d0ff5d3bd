"""Packed training end to end: sliding-window drafter layers, the same losses on any
split of the ranks, an exact resume and an export."""

import json
import shutil

import pytest
from runs import read_metrics, run_colocated, run_disaggregated, starts

from dflash.model.export import load_export

PACKED = ["train.packing=true", "train.buckets=null", "train.max_len=320", "train.num_anchors=24",
          "drafter.num_layers=2", "drafter.layer_types=[sliding_attention,full_attention]", "drafter.sliding_window=24",
          "train.max_steps=6", "checkpoint.every=3", "checkpoint.keep=10"]


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    out = tmp_path_factory.mktemp("packed")
    run_colocated(out, PACKED)
    return out


def test_a_packed_run_trains_rows_of_several_samples_and_exports(colocated):
    records = read_metrics(colocated)
    assert [r["step"] for r in records] == list(range(1, 7))
    # 4 rows of 320 tokens a step, each holding several demo conversations
    assert all(r["samples"] > 4 for r in records)
    drafter = load_export(colocated / "export")
    assert drafter.config.layer_types == ["sliding_attention", "full_attention"]
    config = json.loads((colocated / "export" / "config.json").read_text())
    assert config["sliding_window"] == 24


def test_packed_losses_match_on_two_ranks_and_after_a_resume(colocated, tmp_path):
    """Target rank and drafter rank over gloo give the colocated losses; a restart from
    the step-3 checkpoint continues them exactly."""
    straight = [r["loss"] for r in read_metrics(colocated)]
    run_disaggregated(tmp_path, 2, 1, PACKED)
    assert [r["loss"] for r in read_metrics(tmp_path)] == pytest.approx(straight, rel=1e-6, abs=1e-6)
    shutil.rmtree(tmp_path / "export")
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000006")
    run_disaggregated(tmp_path, 2, 1, PACKED)
    assert starts(tmp_path) == [0, 3]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["loss"] for r in records] == pytest.approx(straight, rel=1e-6, abs=1e-6)
