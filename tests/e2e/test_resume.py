"""Resume anywhere: on another split of the ranks, and past a checkpoint that cannot be read."""

import json
import logging
import re
import shutil

import pytest
from runs import read_metrics, read_records, run_colocated, run_disaggregated, starts

from dflash.run.metrics import MetricsLogger

STEPS = ["train.max_steps=8", "checkpoint.every=4", "checkpoint.keep=10"]


def forget_after_step_4(run_dir) -> None:
    """As if the job had died just after its step-4 checkpoint."""
    shutil.rmtree(run_dir / "export")
    shutil.rmtree(run_dir / "checkpoints" / "step_00000008")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("straight")
    run_colocated(out, STEPS)
    return [m["loss"] for m in read_metrics(out)]


@pytest.mark.parametrize(
    "first,then", [((3, 1), (2, 1)), ((3, 1), (3, 2))], ids=["drafters-2-to-1", "targets-1-to-2"]
)
def test_resume_on_another_split_continues_exactly(straight, tmp_path, first, then):
    """The data order and the anchors depend only on the seed and the step, and the
    checkpoint holds the whole drafter state, so the split may change at a restart."""
    run_disaggregated(tmp_path, *first, STEPS)
    forget_after_step_4(tmp_path)
    run_disaggregated(tmp_path, *then, STEPS)
    assert starts(tmp_path) == [0, 4]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["loss"] for r in records] == pytest.approx(straight, rel=1e-6, abs=1e-6)


def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(straight, tmp_path, caplog):
    run_colocated(tmp_path, STEPS)
    forget_after_step_4(tmp_path)
    shutil.copytree(tmp_path / "checkpoints" / "step_00000004", tmp_path / "checkpoints" / "step_00000006")
    (tmp_path / "checkpoints" / "step_00000006" / ".metadata").write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING):
        run_colocated(tmp_path, STEPS)
    assert "step_00000006 is unreadable" in caplog.text
    assert [m["loss"] for m in read_metrics(tmp_path)] == pytest.approx(straight, rel=1e-6, abs=1e-6)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 8 steps with checkpoints at 4 and 8, to copy and damage."""
    out = tmp_path_factory.mktemp("finished")
    run_colocated(out, STEPS)
    return out


def damage(checkpoint, how: str) -> str:
    """Damage a checkpoint as a bad disk or a careless hand would; what the refusal names."""
    shard = next(p for p in checkpoint.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    if how == "changed":
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        return rf"{shard.name}: bytes \d+-\d+ differ from what was written"
    if how == "truncated":
        shard.write_bytes(bytes(data[: len(data) // 2]))
        return rf"{shard.name}: truncated"
    (checkpoint / "drafter.json").unlink()
    return r"drafter.json: missing"


@pytest.mark.parametrize("how", ["changed", "truncated", "missing"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before_naming_the_file(straight, finished, tmp_path,
                                                                                     caplog, how):
    """A shard changed or cut after it was written, or a file of it gone, is found before
    anything loads: resume=auto names the file and why, and resumes from the one before."""
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "export")
    said = damage(tmp_path / "checkpoints" / "step_00000008", how)
    with caplog.at_level(logging.WARNING):
        run_colocated(tmp_path, STEPS)
    assert "step_00000008 is unreadable" in caplog.text and "falling back to" in caplog.text
    assert re.search(said, caplog.text), caplog.text[-2000:]
    assert starts(tmp_path) == [0, 4]
    assert [m["loss"] for m in read_metrics(tmp_path)] == pytest.approx(straight, rel=1e-6, abs=1e-6)


def test_a_damaged_checkpoint_named_to_resume_from_is_refused(finished, tmp_path):
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    named = tmp_path / "checkpoints" / "step_00000004"
    said = damage(named, "changed")
    with pytest.raises(RuntimeError, match=rf"resume={named} is refused: .*{said}"):
        run_colocated(tmp_path, [*STEPS, f"resume={named}"])


def test_a_checkpoint_without_digests_resumes_with_a_warning(straight, finished, tmp_path, caplog):
    """Checkpoints written before digests were kept still resume: they cannot be verified."""
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    forget_after_step_4(tmp_path)
    (tmp_path / "checkpoints" / "step_00000004" / "digests.json").unlink()
    with caplog.at_level(logging.WARNING):
        run_colocated(tmp_path, STEPS)
    assert "step_00000004 has no digests" in caplog.text and "cannot be verified" in caplog.text
    assert starts(tmp_path) == [0, 4]
    assert [m["loss"] for m in read_metrics(tmp_path)] == pytest.approx(straight, rel=1e-6, abs=1e-6)


def test_no_readable_checkpoint_is_an_error_that_says_what_to_do(tmp_path):
    run_colocated(tmp_path, ["train.max_steps=4"])
    shutil.rmtree(tmp_path / "export")
    (tmp_path / "checkpoints" / "step_00000004" / ".metadata").write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="no readable checkpoint.*resume=never starts over"):
        run_colocated(tmp_path, ["train.max_steps=8"])


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    from dflash.run.metrics import wandb_run_id

    first = wandb_run_id(tmp_path, start_step=0)
    assert wandb_run_id(tmp_path, start_step=4) == first
    assert wandb_run_id(tmp_path, start_step=0) != first  # a fresh start is a new run


def test_a_restart_at_the_same_step_keeps_one_data_record(tmp_path):
    """A start that failed after writing its data record (say in the compile warmup) and
    the restart at the same step leave one data record there, and every step record."""
    records = [{"step": 0, "data/samples": 5}, {"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9},
               {"step": 2, "data/samples": 5}, {"step": 3, "loss": 0.8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    MetricsLogger(tmp_path, {"mode": "disabled"}, {}, start_step=2).log_data({"samples": 5, "skipped": {}})
    assert [(r["step"], "data/samples" in r) for r in read_records(tmp_path)] == [(0, True), (1, False), (2, False),
                                                                                   (2, True)]


def test_a_dflash2_run_resumes_at_its_selector_weight(tmp_path):
    """The selector's loss weight follows the schedule of the step resumed at: off for
    two steps, ramped over two, then whole; the run resumed after step 4 logs the losses
    of the uninterrupted one (a weight left at its step-0 value, 0, would not)."""
    dflash2 = STEPS + ["drafter.variant=dflash2", "drafter.selector_rank=8", "drafter.selector_top_k=4",
                       "loss.selector_warmup=0.25", "loss.selector_ramp=0.25"]
    run_colocated(tmp_path / "straight", dflash2)
    straight = [m["loss"] for m in read_metrics(tmp_path / "straight")]
    run_colocated(tmp_path / "resumed", dflash2)
    forget_after_step_4(tmp_path / "resumed")
    run_colocated(tmp_path / "resumed", dflash2)
    assert starts(tmp_path / "resumed") == [0, 4]
    assert [m["loss"] for m in read_metrics(tmp_path / "resumed")] == pytest.approx(straight, rel=1e-6, abs=1e-6)
