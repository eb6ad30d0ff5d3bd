"""Throughput of both roles at real shapes, side by side in one run.

    python -m dflash.bench [--steps N] [--out FILE] [key=value ...]
    python -m dflash.bench target=qwen3_8b train=paper          # the Qwen3-8B bars
    python -m dflash.bench --warmup-procs 4 compile.enabled=true train.buckets=[320]
    python -m dflash.bench --p2p target=qwen3_8b train=paper    # two GPUs: bundle bandwidth
    python -m dflash.bench --decode 64x256 target=qwen3_8b      # decoding speed: the live evaluation
    python -m dflash.bench --train-ranks 8 target=qwen3_8b target.path=random data=synthetic train=paper

Weights are random (speed does not depend on them): the target comes from the
``shape`` of its ``conf/target`` entry, or from the shipped model's config.json.
Reported: the drafter step (one micro-batch forward/backward plus the optimizer)
eager, compiled and compiled with CUDA graphs; the target prefill eager and
compiled; the colocated pipeline; peak memory and warmup time of each, with the
compile time per stage; last, the compiled drafter's warmup once more from the
compile cache on disk (a warm start, as a second launch). MFU uses
the FLOP count of docs/DESIGN.md section 6 (printed with the table) over
``--peak-tflops``. ``--warmup-procs N`` instead times the compile warmup of N
drafter processes on this machine, each with its own compile cache, all at once
against staggered (later turns receive the first rank's compiled code); ``--p2p``
sends bundles of the configured shapes between two local ranks (NCCL on two
GPUs, gloo on the CPU) against a raw send of the same bytes. ``--decode NxM`` (several,
comma-separated) instead times what an evaluation decodes: N random prompts of 64-512
tokens, M new tokens each (no stop token), speculative with a random drafter in batches
of ``eval.batch_size`` and at batch 1, and the plain greedy baseline; a random drafter
accepts about one token per cycle, the slowest case. ``--train-ranks N`` instead trains
under torchrun on N local ranks (one per GPU) in the layout the plan takes for them, and
reports the samples/s per GPU of the last ``--steps`` optimizer steps beside the plan's
prediction: the figure of a layout on several GPUs, step to step as training logs it.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.compile import (
    compile_counts,
    share_compile_threads,
    staggered_warmup,
    warmup_turn,
)
from dflash.data.bundle import MicroBatch, random_batch, random_prefill
from dflash.data.dataset import synthetic_dataset
from dflash.data.order import collate
from dflash.decode.batch import (
    default_batch_size,
    greedy_batch_steps,
    speculative_batch_steps,
)
from dflash.decode.evaluate import tau
from dflash.decode.speculative import run_to_end
from dflash.device import peak_memory_gib, synchronize
from dflash.distributed.protocol import free_port, get_bytes, put_bytes, set_rank_env
from dflash.distributed.transport import BundleReceiver, BundleSender
from dflash.model.drafter import DFlashDrafter, TargetHead
from dflash.model.target import RANDOM, PrefillOutput, Target, random_target
from dflash.run.build import (
    Job,
    build_job,
    build_trainer,
    drafter_config,
    prepare_packing,
    warm_drafter,
)
from dflash.run.checkpoint import CheckpointWriter, checkpoints
from dflash.run.config import compose_config
from dflash.run.estimate import (
    anchor_context,
    choose_layout,
    drafter_flops,
    keys_per_token,
    layout_name,
    prefill_flops,
)
from dflash.run.step import DrafterTrainer

log = logging.getLogger("dflash.bench")

MODES = {"eager": None, "compile": "default", "reduce-overhead": "reduce-overhead"}
ARTIFACTS_KEY = "compile_artifacts"  # where --warmup-procs hands compiled code on, in its store
# Packed rows differ in their samples' lengths, and attention's work with them: at 32k the first
# two rows of an epoch attend over 1.2k and 8.4k keys per token. Every row of the bench cycles
# over the same rows, so prefill, drafter and colocated figures count the same work.
PACKED_ROWS = 8
# --train-ranks: optimizer steps left out before the timed ones (the first step after the compile
# warmup still grows the allocator's pools and records CUDA graphs of the later buckets)
UNTIMED_STEPS = 2


def packed_batches(job: Job, vocab_size: int, count: int) -> tuple[list[MicroBatch], float]:
    """``count`` micro-batches of rows packed as training packs them, from synthetic samples
    of the configured length mix (``data=synthetic data.mean_length=N``), and the padding
    share of their epoch."""
    plan, data = job.plan, job.cfg.data
    if data.path != "synthetic" or not data.get("mean_length"):
        raise ValueError("a packed benchmark packs synthetic samples of a length mix: add data=synthetic "
                         "data.mean_length=N (e.g. 4500)")
    num_samples = int(1.3 * plan.batch_size * plan.max_len / data.mean_length) + 8
    dataset = synthetic_dataset(num_samples, plan.max_len, vocab_size, data.prompt_fraction, seed=plan.seed,
                                mean_length=data.mean_length)
    order = plan.sample_order(dataset.lengths())
    batches = [collate(dataset, *order.rows(m), list(plan.buckets), pad_id=0, spec=plan.anchor_spec())
               for m in range(count)]
    return batches, order.padding()


def bench_job(overrides: list[str]) -> Job:
    """The job of these overrides with random weights either way: at the preset's
    ``shape``, or at the shipped model's config.json."""
    cfg = compose_config(overrides)
    if cfg.target.get("shape"):
        cfg.target.path = RANDOM
    return build_job(cfg)


def timed(fn: Callable[[], None], steps: int, device: torch.device) -> float:
    """Seconds per call, over ``steps`` calls after the caller's warmup."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def timed_step(step: Callable[[], None], steps: int, device: torch.device) -> tuple[float, int]:
    """:func:`timed` for a training step: seconds per call, and the CUDA graphs recorded
    during the timed calls (after warmup, each is a re-recording that stalls the step)."""
    recorded = compile_counts()["cudagraph_recordings"]
    seconds = timed(step, steps, device)
    return seconds, compile_counts()["cudagraph_recordings"] - recorded


def profile_table(fn: Callable[[], None], device: torch.device, calls: int = 3) -> str:
    """Where the time of ``fn`` goes: the torch profiler's top operators by device time,
    under a line that says how much of the device's time ran kernels (the rest, gaps
    between them, is time the host or a wait left the device idle)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
    kernels = [e.time_range for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return table
    busy = sum(r.elapsed_us() for r in kernels) / 1e3
    span = (max(r.end for r in kernels) - min(r.start for r in kernels)) / 1e3
    return f"kernels ran {busy:.1f} ms of the device's {span:.1f} ms from the first to the last ({100 * busy / span:.1f}%)\n{table}"


def compile_breakdown(top: int = 10) -> dict[str, float]:
    """Seconds per compile stage since the last call (Dynamo's ``dynamo_timed`` regions,
    summed over graphs), largest first: where a cold warmup spends its time. Stages
    nest (the backend compile is inside Dynamo's), so they do not add up."""
    metrics = torch._dynamo.utils.compilation_time_metrics
    totals = sorted(((k, sum(v)) for k, v in metrics.items()), key=lambda kv: -kv[1])
    metrics.clear()
    return {k: round(v, 2) for k, v in totals[:top] if v >= 0.01}


def fx_cache(before: dict[str, int], after: dict[str, int]) -> str:
    """FX graph cache hits and misses between two :func:`compile_counts`."""
    return (f"{after['fx_cache_hits'] - before['fx_cache_hits']} hits / "
            f"{after['fx_cache_misses'] - before['fx_cache_misses']} misses")


def time_checkpoint(trainer: DrafterTrainer, root: Path) -> dict:
    """Checkpoint the drafter with its optimizer state as training does
    (:class:`dflash.run.checkpoint.CheckpointWriter`): the host buffers allocated in the
    background, the copy into them that a step waits for, the background write, a load."""
    writer = CheckpointWriter(root, keep=1)
    state = (trainer.drafter, trainer.optimizer, trainer.scheduler)
    began = time.perf_counter()
    writer.prepare(*state)
    writer.allocating.result()
    allocated = time.perf_counter()
    synchronize(trainer.device)
    writer.save(1, *state)
    copied = time.perf_counter()
    writer.wait()
    written = time.perf_counter()
    writer.abandon()
    path = checkpoints(root)[-1]
    trainer.restore(path)
    synchronize(trainer.device)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"role": "checkpoint", "mode": "dcp", "gib": round(size / 2**30, 2), "allocate_s": round(allocated - began, 2),
            "snapshot_s": round(copied - allocated, 2), "write_s": round(written - copied, 2),
            "load_s": round(time.perf_counter() - written, 2)}


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def with_mode(job: Job, mode: str | None, target: bool = False) -> Job:
    """The job with the drafter (and, with ``target``, the target) compiled in one bench
    ``mode``; ``None``: eager. No CUDA graphs on the CPU."""
    cuda_mode = mode if job.device.type == "cuda" else None
    settings = replace(job.compile, drafter=mode is not None, target=target and mode is not None, mode=cuda_mode,
                       strict=False, warmup_turns=1)
    return replace(job, compile=settings)


class Bench:
    def __init__(self, job: Job, steps: int, peak_tflops: float, profile: str | None = None, accumulation: int = 1):
        self.job, self.steps, self.peak, self.profile = job, steps, peak_tflops * 1e12, profile
        self.accumulation = accumulation
        self.profile_table: str | None = None
        self.device, self.dtype, plan = job.device, job.dtype, job.plan
        self.model = random_target(job.target_config, self.device, self.dtype, plan.seed)
        self.head = TargetHead.of(self.model)
        self.micro, self.seq_len, self.topk = plan.micro_batch_size, plan.max_len, plan.topk
        vocab = self.head.vocab_size
        self.padding = None
        if plan.packing:
            self.batches, self.padding = packed_batches(job, vocab, PACKED_ROWS)
        else:
            self.batches = [random_batch(self.micro, self.seq_len, vocab, plan.anchor_spec(), seed=i) for i in range(2)]
        self.target = Target(self.model, list(plan.layer_ids))
        if plan.packing:
            prepare_packing(self.target, self.device, self.dtype)
        self.tokens = sum(int(b.lengths.sum()) for b in self.batches) / len(self.batches)  # real tokens per micro-batch
        # the attention work of the rows every role cycles over, as their means: both FLOP counts are linear in them
        self.keys_per_token = sum(map(keys_per_token, self.batches)) / len(self.batches)
        self.anchor_context = sum(map(anchor_context, self.batches)) / len(self.batches)

    def positions(self, batch: MicroBatch) -> torch.Tensor | None:
        """What the prefill takes: a packed batch's position ids, else none (as training)."""
        return batch.position_ids.to(self.device) if self.job.plan.packing else None

    def mfu(self, flops: float, seconds: float) -> float:
        return round(100 * flops / seconds / self.peak, 1)

    def warmed_trainer(self, mode: str | None) -> tuple[DrafterTrainer, dict, dict]:
        """A fresh trainer in ``mode``, once Dynamo has forgotten every graph, warmed up;
        with the warmup's report and the compile counters from just before it."""
        torch._dynamo.reset()
        reset_memory(self.device)
        trainer = build_trainer(with_mode(self.job, mode), self.head, 10**6)
        before = compile_counts()
        compile_breakdown()
        warm = staggered_warmup(lambda: warm_drafter(self.job.plan, trainer, self.dtype), 0, 1)
        return trainer, warm, before

    def drafter(self, name: str, mode: str | None) -> dict:
        """One drafter step per call: ``accumulation`` micro-batch forward/backwards and the
        optimizer. Per-sample figures divide by the micro-batches of the call."""
        trainer, warm, before = self.warmed_trainer(mode)
        feature_dim = trainer.drafter.fc.in_features
        # one prefill serves every batch: all have one shape, and the drafter's work does not depend on the values
        prefill = random_prefill(self.micro, self.seq_len, feature_dim, self.dtype, self.topk, self.head.vocab_size,
                                 self.device)
        calls = iter(range(10**9))

        def step() -> None:
            for _ in range(self.accumulation):
                trainer.micro_step(self.batches[next(calls) % len(self.batches)], prefill)
            trainer.finish()

        step()  # the optimizer's state is created on its first step
        seconds, rerecords = timed_step(step, self.steps, self.device)
        seconds /= self.accumulation
        if name == self.profile:
            self.profile_table = profile_table(step, self.device)
        flops = self.micro * drafter_flops(trainer.drafter.config, self.seq_len, self.job.plan.num_anchors,
                                           self.head.vocab_size, self.anchor_context)
        after = compile_counts()
        result = {
            "role": "drafter",
            "mode": name,
            "step_ms": round(1e3 * seconds, 2),
            "samples_per_s": round(self.micro / seconds, 2),
            "tokens_per_s": round(self.tokens / seconds),
            "mfu_pct": self.mfu(flops, seconds),
            "tflop_per_step": round(flops / 1e12, 2),
            "peak_gib": peak_memory_gib(self.device),
            "warmup_s": warm["wall_s"],
            "graphs": after["graphs"] - before["graphs"],
            "cudagraph_skips": after["cudagraph_skips"] - before["cudagraph_skips"],
            "cudagraph_rerecords": rerecords,  # CUDA graphs recorded during the timed steps
            "fx_cache": fx_cache(before, after),
            "compile_s": compile_breakdown() if mode else {},
        }
        self.trainer = trainer
        return result

    def prefill(self, name: str, compiled: bool) -> dict:
        torch._dynamo.reset()
        reset_memory(self.device)
        target = self.target
        if compiled:
            target.compile(with_mode(self.job, "default", target=True).compile)
        else:
            target.uncompile()
        inputs = [(b.input_ids.to(self.device), self.positions(b)) for b in self.batches]
        start = time.perf_counter()
        target.prefill(inputs[0][0], self.topk, inputs[0][1])
        warmup_s = time.perf_counter() - start

        def every_batch() -> None:
            for ids, positions in inputs:
                target.prefill(ids, self.topk, positions)

        seconds = timed(every_batch, self.steps, self.device) / len(inputs)
        flops = self.micro * prefill_flops(self.model, self.seq_len, bool(self.topk), list(self.job.plan.layer_ids),
                                           self.keys_per_token)
        return {
            "role": "target",
            "mode": name,
            "step_ms": round(1e3 * seconds, 2),
            "tokens_per_s": round(self.tokens / seconds),
            "mfu_pct": self.mfu(flops, seconds),
            "tflop_per_step": round(flops / 1e12, 2),
            "peak_gib": peak_memory_gib(self.device),
            "warmup_s": round(warmup_s, 2),
        }

    def warm_start(self, name: str, mode: str) -> dict:
        """The drafter's warmup again after Dynamo forgets every graph, on a fresh trainer:
        what a second launch pays with the compile cache on disk. Last, since it
        replaces the trainer the other rows used."""
        del self.trainer
        self.trainer, warm, before = self.warmed_trainer(mode)
        return {
            "role": "drafter",
            "mode": f"{name}, warm start",
            "warmup_s": warm["wall_s"],
            "fx_cache": fx_cache(before, compile_counts()),
            "compile_s": compile_breakdown(),
        }

    def colocated(self) -> dict:
        """The last target and trainer in one process: per micro-batch a prefill and a
        drafter forward/backward, with the optimizer step amortised over ``accumulation``
        micro-batches as in the drafter rows (as in training)."""
        calls = iter(range(10**9))
        reset_memory(self.device)

        def micro_batch() -> tuple[MicroBatch, PrefillOutput]:
            batch = self.batches[next(calls) % len(self.batches)].to(self.device)
            return batch, self.target.prefill(batch.input_ids, self.topk, self.positions(batch))

        def step() -> None:
            for _ in range(self.accumulation):
                self.trainer.micro_step(*micro_batch())
            self.trainer.finish()

        step()
        seconds, rerecords = timed_step(step, self.steps, self.device)
        seconds /= self.accumulation
        if self.profile == "colocated":
            self.profile_table = profile_table(step, self.device)
        row = {
            "role": "colocated",
            "mode": "compiled" if self.trainer.compiled else "eager",
            "step_ms": round(1e3 * seconds, 2),
            "samples_per_s": round(self.micro / seconds, 2),
            "tokens_per_s": round(self.tokens / seconds),
            "peak_gib": peak_memory_gib(self.device),
            "cudagraph_rerecords": rerecords,
        }
        if self.device.type == "cuda":
            row.update(self.colocated_phases(micro_batch))
        return row

    def colocated_phases(self, micro_batch: Callable[[], tuple[MicroBatch, PrefillOutput]]) -> dict:
        """One more colocated step, cut by CUDA events: the device's milliseconds per
        micro-batch from the prefill's launch to the drafter's, from there to the end of
        its backward, and from there to the next prefill; and where the host waited for
        the device (each wait idles the device while the host catches up)."""
        marks = []
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as syncs:
                warnings.simplefilter("always")
                for _ in range(self.accumulation):
                    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                    events[0].record()
                    batch, prefill = micro_batch()
                    events[1].record()
                    self.trainer.micro_step(batch, prefill)
                    events[2].record()
                    marks.append(events)
                self.trainer.finish()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        n = len(marks)
        between = [a[2].elapsed_time(b[0]) for a, b in zip(marks, marks[1:])]
        return {
            "prefill_ms": round(sum(m[0].elapsed_time(m[1]) for m in marks) / n, 2),
            "drafter_ms": round(sum(m[1].elapsed_time(m[2]) for m in marks) / n, 2),
            "between_ms": round(sum(between) / max(1, len(between)), 2),
            "host_syncs": sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs if "synchroniz" in str(w.message)}),
        }


def run_bench(
    job: Job, steps: int, peak_tflops: float, modes: list[str], profile: str | None = None, accumulation: int = 1,
    checkpoint_dir: str | None = None,
) -> dict:
    bench = Bench(job, steps, peak_tflops, profile, accumulation)
    runs = [lambda: bench.prefill("eager", False)]
    if any(MODES[m] for m in modes):
        runs.append(lambda: bench.prefill("compile", True))
    runs += [lambda name=name: bench.drafter(name, MODES[name]) for name in modes]
    runs.append(bench.colocated)
    if checkpoint_dir:
        runs.append(lambda: time_checkpoint(bench.trainer, Path(checkpoint_dir)))
    compiled = [name for name in modes if MODES[name]]
    if compiled:
        runs.append(lambda: bench.warm_start(compiled[-1], MODES[compiled[-1]]))
    rows = []
    for run in runs:
        rows.append(run())
        log.info("%s", rows[-1])
    plan, drafter = job.plan, bench.trainer.drafter.config
    return {
        "target": job.cfg.target.name,
        "device": torch.cuda.get_device_name() if bench.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shapes": {
            "micro_batch_size": plan.micro_batch_size, "max_len": plan.max_len, "num_anchors": plan.num_anchors,
            "block_size": drafter.block_size, "drafter_layers": drafter.num_layers,
            "drafter_params": sum(p.numel() for p in bench.trainer.drafter.parameters()),
            "kl_topk": plan.topk, "dtype": str(bench.dtype).removeprefix("torch."), "accumulation": accumulation,
            "packing": plan.packing, "padding": bench.padding, "tokens_per_micro_batch": bench.tokens,
            "rows": len(bench.batches),
            "keys_per_token": round(bench.keys_per_token), "anchor_context": round(bench.anchor_context),
            "layer_types": drafter.layer_types, "sliding_window": drafter.sliding_window,
        },
        "peak_tflops": peak_tflops,
        "flop_count": "docs/DESIGN.md section 6: drafter 6*params*tokens (+ context K/V, fc, LM head fwd+input-grad, attention); "
        "target 2*params*tokens + causal attention over the layers that run (up to the last captured one "
        "without top-k logits)",
        "rows": rows,
        "profile": bench.profile_table,
    }


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
        lambda: warm_drafter(job.plan, trainer, job.dtype), turn, turns, lambda _: dist.barrier(),
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


def run_training(overrides: list[str], ranks: int, steps: int) -> dict:
    """``ranks`` local processes train :data:`UNTIMED_STEPS` + ``steps`` optimizer steps under
    torchrun (``dflash.train`` as a user launches it, its layout as the plan chooses or the
    overrides ask), then the samples/s of the last ``steps`` from the metrics they logged,
    per GPU, beside the plan's prediction for the same layout."""
    run = [*overrides, f"train.max_steps={UNTIMED_STEPS + steps}", "train.log_every=1", "eval.enabled=false"]
    layout = choose_layout(build_job(compose_config(run)), ranks)
    with tempfile.TemporaryDirectory() as out:
        # as launch.sh starts a node: each rank sees its own GPU as cuda:0, NVLink multicast off
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   "--virtual-local-rank", "-m", "dflash.train", *run, f"output_dir={out}"]
        log.info("%s", " ".join(command))
        subprocess.run(command, check=True, env={"NCCL_NVLS_ENABLE": "0", **os.environ})
        records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
        ranks_file = Path(out, "ranks.json")
        summaries = json.loads(ranks_file.read_text()) if ranks_file.is_file() else []
    timed = [r for r in records if "loss" in r][UNTIMED_STEPS:]
    if len(timed) < steps:
        raise RuntimeError(f"the run logged {len(timed) + UNTIMED_STEPS} steps, {UNTIMED_STEPS + steps} asked: too "
                           "few samples for that many steps? (data.num_samples with data=synthetic)")
    samples = sum(r["samples"] for r in timed)
    rate = samples / sum(r["samples"] / r["samples_per_s"] for r in timed)
    cost = layout.cost
    predicted = cost.samples_per_s / ranks if torch.cuda.is_available() else math.nan  # the rates are a GPU's
    return {
        "train_ranks": ranks,
        "overrides": overrides,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "layout": layout_name(cost) if ranks > 1 else "colocated, one process",
        "micro_batch_size": layout.job.plan.micro_batch_size,
        "steps": len(timed),
        "samples_per_step": samples // len(timed),
        "samples_per_s": round(rate, 3),
        "samples_per_s_per_gpu": round(rate / ranks, 3),
        "predicted_per_gpu": None if math.isnan(predicted) else round(predicted, 3),
        "rates_from": cost.rates_from,
        "step_samples_per_s": [round(r["samples_per_s"], 3) for r in timed],
        "ranks": [{k: r.get(k) for k in ("rank", "role", "steps", "peak_gib")} for r in summaries],
    }


def parse_decode(spec: str) -> list[tuple[int, int]]:
    """``"64x256,32x2048"`` as [(prompts, new tokens), ...]."""
    try:
        return [(int(n), int(m)) for n, m in (part.split("x") for part in spec.split(","))]
    except ValueError:
        raise SystemExit(f"--decode takes PROMPTSxNEW_TOKENS[,...], e.g. 64x256, not {spec!r}") from None


def timed_decode(steps, device: torch.device) -> tuple[object, float]:
    """Run a sliced decoding to its end, the device synchronised before and after: its
    result and wall seconds."""
    synchronize(device)
    start = time.perf_counter()
    result = run_to_end(steps)
    synchronize(device)
    return result, time.perf_counter() - start


def run_decode(job: Job, specs: list[tuple[int, int]], batch_one: int = 2, profile: int = 0) -> dict:
    """Decoding speed at the target's shapes: per spec, the speculative decoding of the
    prompts (``eval.batch_size`` at a time), the first ``batch_one`` of them at batch 1
    (the loop before batching), and the plain greedy baseline in batches. ``profile > 0``:
    then one batch of the last spec's prompts, ``profile`` new tokens each, speculative and
    greedy, under the torch profiler."""
    device, dtype = job.device, job.dtype
    model = random_target(job.target_config, device, dtype, job.plan.seed)
    head = TargetHead.of(model)
    torch.manual_seed(job.plan.seed)
    with torch.device(device):
        drafter = DFlashDrafter(drafter_config(job))
    drafter.reset_parameters(job.cfg.drafter.init_std)
    drafter = drafter.to(dtype).eval().requires_grad_(False)
    batch_size = int(job.cfg.eval.batch_size or default_batch_size(device))
    generator = torch.Generator().manual_seed(job.plan.seed)
    rows = []
    for prompts, new_tokens in specs:
        lengths = torch.randint(64, 513, (prompts,), generator=generator).tolist()
        ids = [torch.randint(0, head.vocab_size, (1, n), generator=generator).to(device) for n in lengths]

        def speculative(batch: int, count: int) -> dict:
            decoded, seconds = timed_decode(speculative_batch_steps(
                model, drafter, head, ids[:count], max_new_tokens=new_tokens, batch_size=batch), device)
            cycles = sum(len(a) for _, a in decoded)
            tokens = sum(len(t) for t, _ in decoded)
            return {"role": "decode", "mode": f"speculative, batch {batch}", "prompts": count,
                    "new_tokens": tokens, "cycles": cycles, "wall_s": round(seconds, 2),
                    "tokens_per_s": round(tokens / seconds), "tau": round(tau([a for _, a in decoded]), 3),
                    "outputs": [t for t, _ in decoded]}

        run_to_end(speculative_batch_steps(model, drafter, head, ids[:2], max_new_tokens=2, batch_size=2))  # kernels
        batched = speculative(batch_size, prompts)
        single = speculative(1, min(batch_one, prompts)) if batch_one else None
        baseline, seconds = timed_decode(greedy_batch_steps(model, ids, new_tokens, batch_size=batch_size), device)
        tokens = sum(map(len, baseline))
        outputs = batched.pop("outputs")
        batched["evaluation_s"] = round(batched["wall_s"] + seconds, 2)
        if single:
            single.pop("outputs")
            rows.append(single)
        rows += [batched, {
            "role": "decode", "mode": f"greedy baseline, batch {batch_size}", "prompts": prompts,
            "new_tokens": tokens, "wall_s": round(seconds, 2), "tokens_per_s": round(tokens / seconds),
            "lossless_prompts": sum(a == b for a, b in zip(outputs, baseline)),
        }]
        log.info("%s", rows[-2:])
    report = {"decode": rows, "target": job.cfg.target.name, "dtype": str(dtype).removeprefix("torch."),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    if profile:
        batch = ids[:batch_size]
        speculative_table = profile_table(lambda: run_to_end(speculative_batch_steps(
            model, drafter, head, batch, max_new_tokens=profile, batch_size=batch_size)), device, calls=1)
        greedy_table = profile_table(lambda: run_to_end(greedy_batch_steps(
            model, batch, profile, batch_size=batch_size)), device, calls=1)
        report["profile"] = f"speculative decoding:\n{speculative_table}\ngreedy baseline:\n{greedy_table}"
    return report


def format_report(report: dict) -> str:
    if "decode" in report:
        lines = [f"decoding, {report['target']} (random weights, {report['dtype']}) and a random drafter on "
                 f"{report['device']} (torch {report['torch']})"]
        for r in report["decode"]:
            extra = "".join(f", {k} {r[k]}" for k in ("cycles", "tau", "evaluation_s", "lossless_prompts") if k in r)
            lines.append(f"  {r['mode']}: {r['prompts']} prompts, {r['new_tokens']} new tokens in {r['wall_s']} s, "
                         f"{r['tokens_per_s']} tokens/s{extra}")
        return "\n".join(lines)
    if "train_ranks" in report:
        predicted = report["predicted_per_gpu"]
        versus = (f", predicted {predicted} ({report['rates_from']}): {report['samples_per_s_per_gpu'] / predicted:.2f}x"
                  if predicted else ", no prediction (the plan's rates are for GPUs)")
        peaks = ", ".join(f"{r['role']} {r['peak_gib']}" for r in report["ranks"] if r["peak_gib"] is not None)
        return (f"training on {report['train_ranks']} rank(s) of {report['device']} (torch {report['torch']}), "
                f"{report['layout']}, micro-batch {report['micro_batch_size']}: {report['samples_per_s']} samples/s over "
                f"{report['steps']} steps of {report['samples_per_step']}, {report['samples_per_s_per_gpu']} per GPU"
                f"{versus}\n  per step: {report['step_samples_per_s']}" + (f"\n  peak GiB: {peaks}" if peaks else ""))
    if "p2p" in report:
        r = report["p2p"]
        return (
            f"bundle of {r['bundle_mb']} MB over {r['backend']}: {r['bundle_ms']} ms, {r['bundle_gb_per_s']} GB/s; "
            f"a raw send of the same bytes: {r['raw_gb_per_s']} GB/s ({100 * r['fraction_of_raw']:.0f}% of it)"
        )
    if "procs" in report:
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
    s = report["shapes"]
    head = (
        f"{report['target']} on {report['device']} (torch {report['torch']}): micro-batch {s['micro_batch_size']}, "
        f"max_len {s['max_len']}, {s['num_anchors']} anchors x block {s['block_size']}, "
        f"{s['drafter_params'] / 1e9:.3f}B drafter params, {s['dtype']}\n"
        + (f"{s['rows']} packed rows, cycled by every row: a prefill token attends to {s['keys_per_token']} keys and "
           f"an anchor's context holds {s['anchor_context']} positions on average\n" if s["packing"] else "")
        + f"MFU over {report['peak_tflops']:.0f} TFLOP/s; FLOPs per step: {report['flop_count']}"
    )
    cols = ("role", "mode", "step_ms", "samples_per_s", "tokens_per_s", "tflop_per_step", "mfu_pct", "peak_gib", "warmup_s")
    table = [cols] + [tuple("" if r.get(c) is None else str(r[c]) for c in cols) for r in report["rows"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in table]
    for r in report["rows"]:
        if r.get("compile_s"):
            stages = ", ".join(f"{k} {v} s" for k, v in r["compile_s"].items())
            lines.append(f"drafter {r['mode']} warmup {r['warmup_s']} s (FX cache {r['fx_cache']}); compile stages: {stages}")
        if r["role"] == "colocated" and "prefill_ms" in r:
            syncs = ", ".join(r["host_syncs"]) or "none"
            lines.append(f"colocated, per micro-batch on the device: prefill {r['prefill_ms']} ms, drafter "
                         f"{r['drafter_ms']} ms, to the next prefill {r['between_ms']} ms; host waits: {syncs}")
        if r["role"] == "checkpoint":
            lines.append(f"checkpoint of drafter + optimizer, {r['gib']} GiB: host buffers allocated in the background "
                         f"in {r['allocate_s']} s, then a step waits {r['snapshot_s']} s for the copy to them, written "
                         f"in the background in {r['write_s']} s; load {r['load_s']} s")
    return head + "\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. target=qwen3_8b train=paper")
    parser.add_argument("--steps", type=int, default=10, help="timed calls per row")
    parser.add_argument("--modes", default="eager,compile,reduce-overhead", help="drafter modes, comma-separated")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak (H200 measured: 790)")
    parser.add_argument("--warmup-procs", type=int, default=0, help="time the warmup of N processes instead")
    parser.add_argument("--p2p", action="store_true", help="measure bundle bandwidth between two local ranks instead")
    parser.add_argument("--train-ranks", type=int, default=0,
                        help="train on N local ranks under torchrun instead; --steps optimizer steps are timed")
    parser.add_argument("--profile", choices=[*MODES, "colocated", "decode"],
                        help="also profile the drafter step of this mode, the colocated step, or (with --decode) "
                             "a batch of decoding")
    parser.add_argument("--accumulation", type=int, default=1,
                        help="micro-batches per optimizer step in the drafter and colocated rows")
    parser.add_argument("--decode", metavar="NxM", help="time decoding N prompts x M new tokens instead, e.g. 64x256")
    parser.add_argument("--batch-one", type=int, default=2, help="with --decode: prompts also decoded at batch 1")
    parser.add_argument("--checkpoint", metavar="DIR", help="also time a checkpoint save and load under DIR")
    parser.add_argument("--out", default="bench.json")
    args = parser.parse_intermixed_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    overrides = ["wandb.mode=disabled", *args.overrides]
    if args.decode:
        report = run_decode(bench_job(overrides), parse_decode(args.decode), args.batch_one,
                            32 if args.profile == "decode" else 0)
    elif args.p2p:
        report = run_p2p(overrides, args.steps)
    elif args.train_ranks:
        report = run_training(overrides, args.train_ranks, args.steps)
    elif args.warmup_procs:
        report = run_warmup(overrides, args.warmup_procs)
    else:
        job = bench_job(overrides + ["train.buckets=null"])
        report = run_bench(job, args.steps, args.peak_tflops, args.modes.split(","), args.profile, args.accumulation,
                           args.checkpoint)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(format_report(report))
    if report.get("profile"):
        what = {"colocated": "colocated step, over 3 steps", "decode": "decoding, one batch x 32 tokens"}.get(
            args.profile, f"drafter step, {args.profile}, over 3 steps")
        print(f"{what}, profiled:\n{report['profile']}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
