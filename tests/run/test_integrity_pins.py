"""Regression pins of digests and resume: a directory is checked in the chunks it was written
in, every refusal of a digest file is taken, and ``resume`` stops at a checkpoint of another
drafter instead of trying the older ones. Digests are compared with SHA-256 computed here,
byte ranges with ones counted by hand."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_drafter

import dflash.files as files_module
from dflash.files import DIGESTS, DamagedFiles, verify_digests, write_digests
from dflash.model.drafter import DFlashDrafter
from dflash.run.build import resume_step
from dflash.run.checkpoint import CheckpointMismatch, load_checkpoint, resume_candidates, save_checkpoint, step_dir

DATA = bytes(range(256)) * 19 + bytes(136)  # 5,000 bytes: four chunks of 1 KiB and one of 904


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def written_in_1k(tmp_path, monkeypatch) -> Path:
    """A directory whose digests were written in 1 KiB chunks, the constant back at its
    value (64 MiB) once they are: as a directory written by another version reads here."""
    (tmp_path / "data.bin").write_bytes(DATA)
    with monkeypatch.context() as m:
        m.setattr(files_module, "CHUNK_BYTES", 1024)
        write_digests(tmp_path)
    assert files_module.CHUNK_BYTES > len(DATA)  # one chunk, were the file read in this version's
    return tmp_path


def test_digests_record_the_chunk_size_and_each_chunks_sha256(written_in_1k):
    recorded = json.loads((written_in_1k / DIGESTS).read_text())
    chunks = [DATA[at:at + 1024] for at in (0, 1024, 2048, 3072, 4096)]
    assert [len(c) for c in chunks] == [1024, 1024, 1024, 1024, 904]
    assert recorded == {"algorithm": "sha256", "chunk_bytes": 1024,
                        "files": {"data.bin": {"bytes": 5000, "sha256": [hashlib.sha256(c).hexdigest()
                                                                          for c in chunks]}}}


def test_a_directory_verifies_in_the_chunk_size_it_was_written_with(written_in_1k):
    assert verify_digests(written_in_1k) is True


@pytest.mark.parametrize(("at", "said"), [(0, "bytes 0-1024"), (3000, "bytes 2048-3072"), (4999, "bytes 4096-5000")])
def test_a_changed_byte_is_named_by_its_recorded_chunk(written_in_1k, at, said):
    flip_byte(written_in_1k / "data.bin", at)
    with pytest.raises(DamagedFiles, match=rf"data.bin: {said} differ from what was written"):
        verify_digests(written_in_1k)


def rewrite(directory: Path, change) -> None:
    recorded = json.loads((directory / DIGESTS).read_text())
    change(recorded)
    (directory / DIGESTS).write_text(json.dumps(recorded))


@pytest.mark.parametrize(("change", "said"), [
    (lambda r: r.update(algorithm="md5"), r"digests of algorithm 'md5', not sha256"),
    (lambda r: r.pop("algorithm"), r"digests of algorithm None, not sha256"),
    (lambda r: r.pop("chunk_bytes"), r"unreadable digests \('chunk_bytes'\)"),
    (lambda r: r.update(files=[1, 2]), r"unreadable digests"),
    (lambda r: r["files"]["data.bin"]["sha256"].pop(), r"4 chunk digests for data.bin, whose 5000 bytes make 5"),
], ids=["algorithm", "no-algorithm", "no-chunk-size", "files-not-a-mapping", "chunk-count"])
def test_each_refusal_of_a_digest_file_is_taken(written_in_1k, change, said):
    rewrite(written_in_1k, change)
    with pytest.raises(DamagedFiles, match=said):
        verify_digests(written_in_1k)


# resume ---------------------------------------------------------------------------------


def optimizer_and_scheduler(model: torch.nn.Module):
    optimizer = torch.optim.AdamW(model.parameters())
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


class Restoring:
    """The trainer's part ``resume_step`` uses: ``restore``, here loading into ``model``
    (or failing as ``fail`` says for a path), with every path it was asked for."""

    def __init__(self, model: torch.nn.Module, fail: dict | None = None):
        self.model, self.fail, self.tried = model, fail or {}, []

    def restore(self, path: Path, group=None) -> int:
        self.tried.append(path.name)
        if path.name in self.fail:
            raise self.fail[path.name]
        return load_checkpoint(path, self.model, *optimizer_and_scheduler(self.model), group)


def settings(root: Path, resume: str = "auto") -> SimpleNamespace:
    return SimpleNamespace(run_dir=SimpleNamespace(checkpoints=root), resume=resume)


@pytest.fixture
def two_checkpoints(tmp_path) -> Path:
    """Steps 2 and 4 of a drafter with full attention in both layers."""
    drafter = tiny_drafter()
    for step in (2, 4):
        save_checkpoint(tmp_path, step, drafter, *optimizer_and_scheduler(drafter), keep=5)
    return tmp_path


def test_resume_auto_stops_at_the_newest_checkpoint_of_another_drafter(two_checkpoints):
    """Every checkpoint of the run is of the same other drafter: the mismatch names the
    newest and the field, and no older one is tried (nor is the user told to start over)."""
    sliding = DFlashDrafter(replace(tiny_drafter().config, layer_types=["full_attention", "sliding_attention"],
                                    sliding_window=2))
    trainer = Restoring(sliding)
    with pytest.raises(CheckpointMismatch, match=r"step_00000004 is a checkpoint of another drafter \(drafter "
                                                 r"layer_types: None there, \['full_attention', 'sliding_attention'\] "
                                                 r"here; drafter sliding_window: None there, 2 here\)"):
        resume_step(settings(two_checkpoints), trainer)
    assert trainer.tried == ["step_00000004"]


def test_resume_auto_falls_back_past_an_unreadable_checkpoint_to_the_one_before(two_checkpoints, caplog):
    trainer = Restoring(tiny_drafter(seed=1), fail={"step_00000004": OSError("disk error")})
    with caplog.at_level(logging.WARNING):
        assert resume_step(settings(two_checkpoints), trainer) == 2
    assert trainer.tried == ["step_00000004", "step_00000002"]
    newest, before = step_dir(two_checkpoints, 4), step_dir(two_checkpoints, 2)
    assert f"checkpoint {newest} is unreadable (OSError: disk error); falling back to {before}" in caplog.text


def test_resume_auto_with_no_readable_checkpoint_says_so_naming_the_last_tried(two_checkpoints):
    fail = {"step_00000004": OSError("one"), "step_00000002": ValueError("two")}
    trainer = Restoring(tiny_drafter(), fail=fail)
    with pytest.raises(RuntimeError, match=rf"no readable checkpoint under {two_checkpoints} \(last tried "
                                           rf"{step_dir(two_checkpoints, 2)}: two\); resume=never starts over"):
        resume_step(settings(two_checkpoints), trainer)
    assert trainer.tried == ["step_00000004", "step_00000002"]


def test_a_named_checkpoint_that_cannot_be_read_is_refused_not_passed_over(two_checkpoints):
    named = str(step_dir(two_checkpoints, 4))
    trainer = Restoring(tiny_drafter(), fail={"step_00000004": OSError("disk error")})
    with pytest.raises(RuntimeError, match=rf"resume={named} is refused: disk error"):
        resume_step(settings(two_checkpoints, named), trainer)
    assert trainer.tried == ["step_00000004"]


def test_resume_never_and_an_empty_run_start_at_step_zero(two_checkpoints, tmp_path):
    trainer = Restoring(tiny_drafter())
    assert resume_step(settings(two_checkpoints, "never"), trainer) == 0
    assert resume_step(settings(tmp_path / "absent"), trainer) == 0
    assert trainer.tried == []
    assert resume_step(settings(two_checkpoints), trainer) == 4


def test_resume_candidates_in_order():
    assert resume_candidates("never", Path("/nonexistent")) == []
    assert resume_candidates("auto", Path("/nonexistent")) == []
    with pytest.raises(FileNotFoundError, match=r"resume='/nonexistent/step_1' is not a checkpoint directory"):
        resume_candidates("/nonexistent/step_1", Path("/nonexistent"))
