"""The background checkpoint writer: a step waits only for the copy to host memory, the
checkpoint holds the state of its step whatever trains after it, a failed write is
raised, not lost; and a checkpoint of another drafter is refused."""

import contextlib
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import tiny_drafter
from torch import nn
from torch.utils._pytree import tree_leaves

from dflash.model.drafter import DFlashDrafter
from dflash.run import checkpoint as checkpoint_module
from dflash.run.checkpoint import (
    PAGE,
    CheckpointMismatch,
    CheckpointWriter,
    HostBuffers,
    checkpoints,
    free_bytes,
    load_checkpoint,
    save_checkpoint,
    snapshot,
    state_bytes,
    state_of,
)


def trainee(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))


def train_step(model, optimizer, scheduler) -> None:
    model(torch.randn(4, 8)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def test_a_checkpoint_holds_its_step_while_training_runs_past_it(tmp_path: Path):
    model, optimizer, scheduler = trainee()
    writer = CheckpointWriter(tmp_path, keep=2)
    train_step(model, optimizer, scheduler)
    writer.prepare(model, optimizer, scheduler)  # host buffers allocated in the background, as after a first step
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    writer.save(1, model, optimizer, scheduler)
    for _ in range(3):  # in place, while the write may still be running
        train_step(model, optimizer, scheduler)
    writer.save(4, model, optimizer, scheduler)
    writer.close()
    writer.abandon()
    assert [p.name for p in checkpoints(tmp_path)] == ["step_00000001", "step_00000004"]
    restored, r_optimizer, r_scheduler = trainee(seed=1)
    assert load_checkpoint(tmp_path / "step_00000001", restored, r_optimizer, r_scheduler) == 1
    for k, v in restored.state_dict().items():
        torch.testing.assert_close(v, at_save[k], rtol=0, atol=0)
    assert r_scheduler.last_epoch == 1 and r_optimizer.state_dict()["state"][0]["step"] == 1
    assert not list(tmp_path.glob(".tmp_*"))


def test_host_buffers_hold_the_state_each_tensor_on_its_own_pages():
    """One allocation carved per tensor at page boundaries: a tensor's pages are locked on
    their own, so no two tensors may share a page; scalars and empty tensors included."""
    model, optimizer, scheduler = trainee()
    train_step(model, optimizer, scheduler)
    state = state_of(model, optimizer, scheduler, 1)
    state["extra"] = {"empty": torch.empty(0, 3), "scalar": torch.tensor(2.5, dtype=torch.float64),
                      "flags": torch.tensor([True, False])}
    host = HostBuffers(state)
    copied = snapshot(state, host.state)
    leaves, buffers, outs = ([t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)] for tree in (state, host.state, copied))
    for original, buffer, out in zip(leaves, buffers, outs, strict=True):
        assert out is buffer and buffer.dtype == original.dtype and buffer.shape == original.shape
        torch.testing.assert_close(buffer, original, rtol=0, atol=0)
    starts = sorted(b.data_ptr() for b in buffers if b.numel())
    assert all(p % PAGE == 0 for p in starts) and len(set(starts)) == len(starts)
    assert host.pin().pinned == []  # nothing on a GPU, nothing to lock
    host.release()


def test_host_buffers_lock_their_pages_on_the_state_s_gpu_from_the_writer_thread(monkeypatch):
    """The writer's thread starts on GPU 0 whatever the rank's GPU (CUDA's current device is
    per thread): the pages are registered, and unregistered, with the state's GPU current.
    The driver is a fake here; which GPU is current when it is called is what counts."""
    current, calls = [0], []

    class Driver:
        class cudaError:  # the names torch.cuda.cudart() gives
            success = 0

        @staticmethod
        def cudaHostRegister(address, size, flags):
            calls.append(("register", current[0]))
            return 0

        @staticmethod
        def cudaHostUnregister(address):
            calls.append(("unregister", current[0]))
            return 0

    @contextlib.contextmanager
    def device(d):
        before, current[0] = current[0], d.index
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Driver)
    monkeypatch.setattr(torch.cuda, "device", device)
    host = HostBuffers({"w": torch.ones(5, 7), "m": torch.zeros(3)})
    host.to_pin, host.device = [t.view(-1).view(torch.uint8) for t in host.state.values()], torch.device("cuda", 3)
    with ThreadPoolExecutor(max_workers=1) as pool:
        assert len(pool.submit(host.pin).result().pinned) == 2
    host.release()
    assert calls == [("register", 3), ("register", 3), ("unregister", 3), ("unregister", 3)] and current == [0]


def test_a_failed_write_is_raised_at_the_next_save(tmp_path: Path):
    model, optimizer, scheduler = trainee()
    blocked = tmp_path / "not_a_directory"
    blocked.write_text("")
    writer = CheckpointWriter(blocked, keep=2)
    writer.save(1, model, optimizer, scheduler)
    with pytest.raises(OSError, match="writing the checkpoint .*step_00000001 failed"):
        writer.save(2, model, optimizer, scheduler)
    writer.abandon()


def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_any_of_it_is_written(tmp_path: Path, monkeypatch,
                                                                                   caplog):
    """After the first step the writer knows the state's size: no room for one checkpoint
    stops the run there, saying what to do; no room for ``checkpoint.keep`` of them (one
    more while the next is written) is a warning. A later save that no longer fits is
    refused before a file is written."""
    model, optimizer, scheduler = trainee()
    train_step(model, optimizer, scheduler)
    size = state_bytes(state_of(model, optimizer, scheduler, 0))
    params = list(model.parameters())
    assert size == sum(3 * p.numel() * 4 + 4 for p in params)  # weights, AdamW's two moments and step count
    free = {"bytes": size - 1}
    monkeypatch.setattr(checkpoint_module, "free_bytes", lambda path: free["bytes"])
    root = tmp_path / "checkpoints"
    writer = CheckpointWriter(root, keep=2)
    with pytest.raises(OSError, match="has 0.0 GiB free: free some space, then resume=auto"):
        writer.prepare(model, optimizer, scheduler)
    free["bytes"] = 2 * size
    with caplog.at_level(logging.WARNING):
        writer.prepare(model, optimizer, scheduler)
    assert "checkpoint.keep=2 keeps up to 3 checkpoints" in caplog.text
    free["bytes"] = size - 1
    with pytest.raises(OSError, match="GiB free"):
        writer.save(1, model, optimizer, scheduler)
    assert not root.exists()
    free["bytes"] = 3 * size
    writer.save(1, model, optimizer, scheduler)
    writer.close()
    writer.abandon()
    assert [p.name for p in checkpoints(root)] == ["step_00000001"]


def test_free_bytes_are_those_of_the_nearest_existing_folder(tmp_path: Path):
    assert abs(free_bytes(tmp_path / "not" / "yet") - shutil.disk_usage(tmp_path).free) < 2**26


def test_a_checkpoint_of_another_drafter_is_refused_not_resumed(tmp_path: Path):
    """A layer turned from full to sliding attention keeps every parameter name and shape,
    so DCP would load the weights; the drafter config written beside them refuses it."""
    drafter = tiny_drafter()
    optimizer = torch.optim.AdamW(drafter.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    path = save_checkpoint(tmp_path, 3, drafter, optimizer, scheduler, keep=1)
    same = tiny_drafter(seed=1)
    same_optimizer = torch.optim.AdamW(same.parameters())
    assert load_checkpoint(path, same, same_optimizer, torch.optim.lr_scheduler.LambdaLR(same_optimizer, lambda s: 1.0)) == 3
    sliding = DFlashDrafter(replace(drafter.config, layer_types=["full_attention", "sliding_attention"], sliding_window=2))
    other_optimizer = torch.optim.AdamW(sliding.parameters())
    with pytest.raises(CheckpointMismatch, match=r"layer_types: None there, \['full_attention', 'sliding_attention'\] here"):
        load_checkpoint(path, sliding, other_optimizer, torch.optim.lr_scheduler.LambdaLR(other_optimizer, lambda s: 1.0))
