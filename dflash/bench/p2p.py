"""``--p2p``: bundles of the configured shapes between two local ranks (NCCL on two GPUs,
gloo on the CPU) against a raw send of the same bytes."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.bench.timing import bench_job
from dflash.data.bundle import random_batch, random_prefill
from dflash.device import synchronize
from dflash.distributed.protocol import free_port, set_rank_env
from dflash.distributed.transport import BundleReceiver, BundleSender


def _p2p_worker(rank: int, port: int, overrides: list[str], rounds: int, result_dir: str) -> None:
    """Rank 0 sends ``rounds`` bundles of the configured shapes to rank 1 through the
    trainer's transport, then one raw buffer of the same size, the link's reference."""
    set_rank_env(rank, 2, port, local=True)
    job = bench_job(overrides)
    plan, device, dtype = job.plan, job.device, job.dtype
    if device.type == "cuda":
        if torch.cuda.device_count() < 2:
            raise RuntimeError("--p2p on CUDA needs two GPUs (NCCL cannot put two ranks on one GPU)")
        dist.init_process_group("nccl")  # lazy, as the trainer does (dflash.distributed.protocol says why)
    else:
        dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    vocab = job.target_config.get_text_config().vocab_size
    batch = random_batch(plan.micro_batch_size, plan.max_len, vocab, plan.anchor_spec())
    result = {}
    if rank == 0:
        prefill = random_prefill(plan.micro_batch_size, plan.max_len, plan.feature_dim, dtype, plan.topk, vocab, device)
        sender = BundleSender({1: group}, device, plan.block_size, job.cfg.topology.max_in_flight)
        for m in range(rounds + 1):
            sender.send(1, m, batch, prefill)
        sender.drain()
    else:
        receiver = BundleReceiver({0: group}, device, replace(plan, buckets=(plan.max_len,)).expected(dtype))
        receiver.receive(0, 0)  # first contact sets up the communicator
        synchronize(device)
        start, first_bytes = time.perf_counter(), receiver.bytes_received
        for m in range(1, rounds + 1):
            receiver.receive(0, m)
        synchronize(device)
        seconds = time.perf_counter() - start
        per_bundle = (receiver.bytes_received - first_bytes) / rounds
        result.update(bundle_mb=round(per_bundle / 1e6, 2), bundle_ms=round(1e3 * seconds / rounds, 3),
                      bundle_gb_per_s=round(per_bundle * rounds / seconds / 1e9, 2))
    size = int(result.get("bundle_mb", 0) * 1e6) or 1
    sizes = torch.tensor([size], device=device)
    dist.broadcast(sizes, src=1, group=group)
    raw = torch.empty(int(sizes.item()), dtype=torch.uint8, device=device)
    op = dist.isend if rank == 0 else dist.irecv
    for w in dist.batch_isend_irecv([dist.P2POp(op, raw, 1 - rank, group=group)]):  # warm
        w.wait()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(rounds):
        for w in dist.batch_isend_irecv([dist.P2POp(op, raw, 1 - rank, group=group)]):
            w.wait()
    synchronize(device)
    if rank == 1:
        result["raw_gb_per_s"] = round(raw.numel() * rounds / (time.perf_counter() - start) / 1e9, 2)
        result["fraction_of_raw"] = round(result["bundle_gb_per_s"] / result["raw_gb_per_s"], 3)
        result["backend"] = dist.get_backend()
        Path(result_dir, "p2p.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_p2p(overrides: list[str], rounds: int) -> dict:
    """Bundle bandwidth between two local ranks against a raw send of the same bytes."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_p2p_worker, args=(free_port(), overrides, rounds, out), nprocs=2, join=True, start_method="spawn")
        return {"p2p": json.loads(Path(out, "p2p.json").read_text()), "overrides": overrides}


def format_p2p(report: dict) -> str:
    r = report["p2p"]
    return (
        f"bundle of {r['bundle_mb']} MB over {r['backend']}: {r['bundle_ms']} ms, {r['bundle_gb_per_s']} GB/s; "
        f"a raw send of the same bytes: {r['raw_gb_per_s']} GB/s ({100 * r['fraction_of_raw']:.0f}% of it)"
    )
