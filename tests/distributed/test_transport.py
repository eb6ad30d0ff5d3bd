"""Bundles over gloo: round trip, and a clear error for a bundle that does not fit."""

import os
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from runs import free_port

from dflash.data.bundle import MicroBatch
from dflash.distributed.transport import (
    BundleReceiver,
    BundleSender,
    Expected,
    PipelineCounters,
)
from dflash.model.target import PrefillOutput


def bundle(feature_dim=12, topk=3):
    g = torch.Generator().manual_seed(0)
    batch = MicroBatch(
        input_ids=torch.randint(0, 50, (2, 16), generator=g),
        loss_mask=torch.randint(0, 2, (2, 16), generator=g),
        lengths=torch.tensor([16, 11]),
        anchors=torch.tensor([[3, 5, 0], [2, 4, 6]]),
        keep=torch.tensor([[True, True, False], [True, True, True]]),
        epoch=4,
    )
    prefill = PrefillOutput(
        torch.randn(2, 16, feature_dim, generator=g).bfloat16(),
        torch.randn(2, 16, topk, generator=g),
        torch.randint(0, 50, (2, 16, topk), generator=g),
    )
    return batch, prefill


def _worker(rank, port, out, feature_dim):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    cpu = torch.device("cpu")
    sender = BundleSender({1: group}, cpu, block_size=4)  # alive until exit: it owns the buffers in flight
    if rank == 0:
        batch, prefill = bundle(feature_dim)
        sender.send(1, 7, batch, prefill)
    else:
        expected = Expected(max_batch=2, num_anchors=3, feature_dim=12, feature_dtype=torch.bfloat16, topk=3, buckets=[16],
                            block_size=4)
        try:
            _, batch, prefill = BundleReceiver({0: group}, cpu, expected).receive(0, 7)
            torch.save({"batch": batch.__dict__, "prefill": prefill.__dict__}, out)
        except Exception as e:  # noqa: BLE001 - the test inspects the message
            Path(out).write_text(f"{type(e).__name__}: {e}")
    dist.barrier()
    os._exit(0)  # leave unmatched sends behind without waiting on them


def run_pair(tmp_path, feature_dim):
    out = tmp_path / "received"
    mp.start_processes(_worker, args=(free_port(), str(out), feature_dim), nprocs=2, join=True, start_method="spawn")
    return out


def test_bundle_round_trip(tmp_path):
    got = torch.load(run_pair(tmp_path, 12), weights_only=False)
    batch, prefill = bundle()
    for k in ("input_ids", "loss_mask", "lengths", "anchors", "keep"):
        assert torch.equal(got["batch"][k], getattr(batch, k)), k
    assert got["batch"]["epoch"] == 4
    assert torch.equal(got["prefill"]["features"], prefill.features)
    assert torch.equal(got["prefill"]["topk_values"], prefill.topk_values)
    assert torch.equal(got["prefill"]["topk_indices"], prefill.topk_indices)


def test_wrong_shape_is_a_clear_error(tmp_path):
    message = run_pair(tmp_path, 20).read_text()
    assert message.startswith("BundleError")
    assert "feature dim 20, the drafter's fc takes 12" in message


def _counters_worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # two drafters fed by 4 target ranks in tensor-parallel pairs: only ranks 0 and 2 send,
    # and each header says how long its sender has waited so far
    seen = [{0: 2_000_000}, {0: 1_500_000, 2: 4_000_000}][rank]
    receiver = SimpleNamespace(wait_s=[1.0, 3.0][rank], bytes_received=[100, 50][rank], target_send_wait_us=seen)
    figures = PipelineCounters(receiver, [0, 2], dist.new_group([0, 1]), torch.device("cpu")).step()
    if rank == 0:
        torch.save(figures, out)
    dist.barrier()


def test_pipeline_waits_are_means_over_drafters_and_over_the_ranks_that_send(tmp_path):
    out = tmp_path / "figures"
    mp.start_processes(_counters_worker, args=(free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    # a sender's wait is the newest a drafter read (the larger), then the mean over the 2 senders
    assert torch.load(out) == {"drafter_wait_s": 2.0, "target_wait_s": 3.0, "bytes_per_step": 150}
