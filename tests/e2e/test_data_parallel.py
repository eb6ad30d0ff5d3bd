"""Colocated data-parallel ranks (``topology.mode=colocated`` under torchrun) train as one
colocated process does, and a run may change between the layouts at a restart."""

import json
import shutil

import pytest
from runs import (
    RANDOM_TARGET,
    read_metrics,
    run_colocated,
    run_data_parallel,
    run_disaggregated,
    starts,
)

STEPS = ["train.max_steps=8", "checkpoint.every=4", "checkpoint.keep=10"]
BATCH = 4  # train.batch_size in runs.TINY


@pytest.fixture(scope="module")
def colocated(tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("colocated")
    run_colocated(out, STEPS)
    return [m["loss"] for m in read_metrics(out)]


@pytest.mark.parametrize("world", [2, 4])
def test_losses_match_one_colocated_process(colocated, tmp_path, world):
    """Each rank prefills and trains on its share of every step; the gradient and loss
    sums are reduced over all ranks, so only their order differs from one process. The
    loss, normalised by the reduced weight, would be the same if every rank trained the
    whole step: the samples per step and per rank tell the two apart."""
    run_data_parallel(tmp_path, world, STEPS)
    records = read_metrics(tmp_path)
    assert [m["loss"] for m in records] == pytest.approx(colocated, rel=1e-5, abs=1e-6)
    assert [m["samples"] for m in records] == [BATCH] * 8
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    assert [(r["rank"], r["role"], r["steps"]) for r in ranks] == [(r, "colocated", 8) for r in range(world)]
    assert [r["samples_trained"] for r in ranks] == [8 * BATCH // world] * world
    assert (tmp_path / "export" / "model.safetensors").is_file()


def test_resume_from_a_disaggregated_run_continues_exactly(colocated, tmp_path):
    """Three disaggregated ranks stop after their step-4 checkpoint; two colocated
    data-parallel ranks resume from it and end where one colocated process does."""
    run_disaggregated(tmp_path, 3, 1, STEPS)
    for late in ("export", "checkpoints/step_00000008"):
        shutil.rmtree(tmp_path / late)
    run_data_parallel(tmp_path, 2, STEPS)
    assert starts(tmp_path) == [0, 4]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["loss"] for r in records] == pytest.approx(colocated, rel=1e-5, abs=1e-6)


def test_random_target_with_a_batch_the_ranks_do_not_divide_is_refused(tmp_path):
    """A step's micro-batches must split evenly over the ranks, as over drafter ranks."""
    with pytest.raises(Exception, match="multiple of train.micro_batch_size"):
        run_data_parallel(tmp_path, 3, RANDOM_TARGET)
