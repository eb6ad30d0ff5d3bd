"""Nothing read back unchecked: every checkpoint and export carries the digests of its
files, each loader refuses files that differ from them (naming the file), and a write
that fails says so at the next save or at the end, leaving the previous checkpoint."""

import errno
import json
import logging
import shutil

import pytest
import torch
from helpers import tiny_drafter

import dflash.files as files_module
import dflash.run.checkpoint as checkpoint_module
from dflash.files import DIGESTS, DamagedFiles, verify_digests, write_digests
from dflash.model.export import init_from, load_export, save_export
from dflash.run.checkpoint import (
    CheckpointWriter,
    UnreadableCheckpoint,
    checkpoints,
    load_checkpoint,
)


def flip_byte(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def written(tmp_path, monkeypatch):
    """A directory of three files and their digests, in chunks of 1 KiB."""
    monkeypatch.setattr(files_module, "CHUNK_BYTES", 1024)
    (tmp_path / "sub").mkdir()
    (tmp_path / "big.bin").write_bytes(bytes(range(256)) * 20)  # 5,120 bytes: five chunks
    (tmp_path / "sub" / "small.json").write_text('{"a": 1}')
    (tmp_path / "empty").write_bytes(b"")
    write_digests(tmp_path)
    return tmp_path


def test_intact_files_verify(written):
    recorded = json.loads((written / DIGESTS).read_text())
    assert sorted(recorded["files"]) == ["big.bin", "empty", "sub/small.json"]
    assert len(recorded["files"]["big.bin"]["sha256"]) == 5 and recorded["files"]["empty"]["sha256"] == []
    assert verify_digests(written) is True


@pytest.mark.parametrize(("damage", "said"), [
    (lambda d: flip_byte(d / "big.bin", 3000), r"big.bin: bytes 2048-3072 differ from what was written"),
    (lambda d: (d / "big.bin").write_bytes((d / "big.bin").read_bytes()[:4000]),
     r"big.bin: truncated, 4000 bytes where 5120 were written"),
    (lambda d: (d / "sub" / "small.json").unlink(), r"small.json: missing"),
    (lambda d: (d / "empty").write_bytes(b"x"), r"empty: grown, 1 bytes where 0 were written"),
    (lambda d: (d / DIGESTS).write_text("{"), r"digests.json: unreadable digests"),
], ids=["changed", "truncated", "missing", "grown", "digests-unreadable"])
def test_each_kind_of_damage_is_named_with_its_file(written, damage, said):
    damage(written)
    with pytest.raises(DamagedFiles, match=said):
        verify_digests(written)


def test_a_directory_without_digests_is_unverified_not_damaged(written):
    (written / DIGESTS).unlink()
    assert verify_digests(written) is False


# checkpoints ----------------------------------------------------------------------------


def tiny_state():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return model, optimizer, scheduler


def test_a_checkpoint_with_a_changed_shard_is_refused_naming_the_shard(tmp_path):
    model, optimizer, scheduler = tiny_state()
    writer = CheckpointWriter(tmp_path, keep=3)
    writer.save(1, model, optimizer, scheduler)
    writer.close()
    path = checkpoints(tmp_path)[-1]
    assert (path / DIGESTS).is_file()
    assert load_checkpoint(path, *tiny_state()) == 1
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    flip_byte(shard, shard.stat().st_size // 2)
    with pytest.raises(UnreadableCheckpoint, match=rf"step_00000001 is damaged: .*{shard.name}: bytes .* differ"):
        load_checkpoint(path, *tiny_state())


def test_a_checkpoint_from_before_digests_loads_with_a_warning(tmp_path, caplog):
    model, optimizer, scheduler = tiny_state()
    writer = CheckpointWriter(tmp_path, keep=3)
    writer.save(2, model, optimizer, scheduler)
    writer.close()
    path = checkpoints(tmp_path)[-1]
    (path / DIGESTS).unlink()
    with caplog.at_level(logging.WARNING):
        assert load_checkpoint(path, *tiny_state()) == 2
    assert "has no digests" in caplog.text and "cannot be verified" in caplog.text


@pytest.mark.parametrize("failure", ["disk full", "path gone"])
def test_a_failed_write_is_raised_at_the_next_save_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch,
                                                                                          failure):
    model, optimizer, scheduler = tiny_state()
    root = tmp_path / "checkpoints"
    writer = CheckpointWriter(root, keep=3)
    writer.save(1, model, optimizer, scheduler)
    writer.wait()
    if failure == "disk full":
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(checkpoint_module.dcp, "save", full)
    else:
        monkeypatch.setattr(checkpoint_module, "write_digests", lambda tmp: shutil.rmtree(tmp))  # the path gone
    writer.save(2, model, optimizer, scheduler)  # fails in the background
    with pytest.raises(OSError, match=r"writing the checkpoint .*step_00000002 failed"):
        writer.save(3, model, optimizer, scheduler)
    monkeypatch.undo()
    assert [p.name for p in checkpoints(root)] == ["step_00000001"]
    assert verify_digests(root / "step_00000001")
    assert not list(root.glob(".tmp_*")), "what was written of the failed checkpoint is removed"
    writer.save(4, model, optimizer, scheduler)
    writer.close()
    assert [p.name for p in checkpoints(root)] == ["step_00000001", "step_00000004"]


def test_the_last_write_failing_is_raised_at_the_end(tmp_path, monkeypatch):
    model, optimizer, scheduler = tiny_state()
    writer = CheckpointWriter(tmp_path, keep=3)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoint_module.dcp, "save", full)
    writer.save(7, model, optimizer, scheduler)
    with pytest.raises(OSError, match=r"step_00000007 failed: .*No space left"):
        writer.close()


# exports ------------------------------------------------------------------------------


def test_a_damaged_export_is_refused_by_every_loader(tmp_path, caplog):
    drafter = tiny_drafter()
    out = save_export(drafter, tmp_path / "export")
    assert (out / DIGESTS).is_file()
    load_export(out)
    init_from(tiny_drafter(seed=1), out)
    weights = out / "model.safetensors"
    flip_byte(weights, weights.stat().st_size - 10)
    with pytest.raises(ValueError, match=r"export is damaged: .*model.safetensors: bytes .* differ"):
        load_export(out)
    with pytest.raises(ValueError, match=r"model.safetensors: bytes .* differ"):
        init_from(tiny_drafter(seed=1), out)
    shutil.rmtree(out)
    out = save_export(drafter, tmp_path / "export")
    (out / DIGESTS).unlink()  # a release, or an export from before digests: unverified, not refused
    with caplog.at_level(logging.WARNING):
        load_export(out)
    assert "has no digests" in caplog.text


def test_dflash_eval_refuses_a_damaged_export(tmp_path):
    from dflash.eval import main

    out = save_export(tiny_drafter(), tmp_path / "export")
    (out / "config.json").write_text((out / "config.json").read_text() + " ")
    with pytest.raises(ValueError, match=r"config.json: grown"):
        main(["--target", "demo", "--drafter", str(out), "--data", "demo_heldout", "--max-prompts", "1"])


def test_a_run_whose_checkpoint_cannot_be_written_fails_and_keeps_the_one_before(tmp_path, monkeypatch):
    """The step-8 checkpoint finds the disk full: the run ends with the error naming its
    path, not with success, and the step-4 checkpoint is still there, intact."""
    from runs import run_colocated

    real, calls = checkpoint_module.dcp.save, []

    def full_the_second_time(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_module.dcp, "save", full_the_second_time)
    with pytest.raises(OSError, match=r"writing the checkpoint .*step_00000008 failed: .*No space left on device"):
        run_colocated(tmp_path, ["train.max_steps=8", "checkpoint.every=4"])
    assert [p.name for p in checkpoints(tmp_path / "checkpoints")] == ["step_00000004"]
    assert verify_digests(tmp_path / "checkpoints" / "step_00000004")
