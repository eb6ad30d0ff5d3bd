"""``--warmup-procs N``: the compile warmup of N drafter processes on this machine, all at
once against staggered (later turns receive the first rank's compiled code)."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.bench.timing import bench_job
from dflash.compile import (
    share_compile_threads,
    staggered_warmup,
    warmup_turn,
)
from dflash.distributed.protocol import free_port, get_bytes, put_bytes
from dflash.model.drafter import TargetHead
from dflash.run.build import (
    build_trainer,
    warm_drafter,
)

ARTIFACTS_KEY = "compile_artifacts"  # where --warmup-procs hands compiled code on, in its store


def _warmup_worker(rank: int, world: int, port: int, overrides: list[str], turns: int, cache_root: str,
                   result_dir: str) -> None:
    # an inductor cache of its own, as on another node: what a later turn does not
    # receive from rank 0 it compiles
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache_root, f"rank{rank}"))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=900))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    job = bench_job(overrides)
    text = job.target_config.get_text_config()
    head = TargetHead(*(torch.randn(text.vocab_size, text.hidden_size, device=job.device, dtype=job.dtype) for _ in range(2)))
    trainer = build_trainer(job, head, 10**6)
    turn = warmup_turn(rank == 0, rank, turns)
    share_compile_threads(sum(warmup_turn(r == 0, r, turns) == turn for r in range(world)))

    report = staggered_warmup(
        lambda: warm_drafter(job.plan, trainer, job.dtype, job.plan.buckets), turn, turns, lambda _: dist.barrier(),
        (lambda: get_bytes(store, ARTIFACTS_KEY)) if turns > 1 and turn > 0 else None,  # the get waits for rank 0
        (lambda data: put_bytes(store, ARTIFACTS_KEY, data)) if turns > 1 and rank == 0 else None,
    )
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, **report}))
    dist.destroy_process_group()


def run_warmup(overrides: list[str], procs: int) -> dict:
    """``procs`` drafter processes on this machine warm up all at once, then staggered
    (the first compiles and hands its compiled artifacts to the rest through the
    store, as training does), each with an empty inductor cache of its own. The
    span runs from the first rank starting to the last rank done."""
    report = {"procs": procs, "overrides": overrides}
    for name, turns in (("all_at_once", 1), ("staggered", 2)):
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as out:
            args = (procs, free_port(), overrides, turns, cache, out)
            mp.start_processes(_warmup_worker, args=args, nprocs=procs, join=True, start_method="spawn")
            ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(procs)]
        span = max(r["ended"] for r in ranks) - min(r["began"] for r in ranks)
        report[name] = {"span_s": round(span, 2), "ranks": ranks}
    return report


def format_warmup(report: dict) -> str:
    lines = [f"compile warmup of {report['procs']} drafter processes"]
    for name in ("all_at_once", "staggered"):
        r = report[name]
        lines.append(f"  {name}: {r['span_s']:.1f} s from first start to last done")
        lines += [
            f"    rank {x['rank']} turn {x['turn']}: {x['wall_s']:.1f} s, {x['cache']}, artifacts "
            f"{x['artifacts_received'] / 1e6:.1f} MB in / {x['artifacts_sent'] / 1e6:.1f} MB out, FX cache "
            f"{x['fx_cache_hits']} hits / {x['fx_cache_misses']} misses, AOT cache {x['aot_cache_hits']} hits / "
            f"{x['aot_cache_misses']} misses"
            for x in r["ranks"]
        ]
    return "\n".join(lines)
