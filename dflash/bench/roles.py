"""The drafter step, the target prefill and the colocated pipeline at real shapes, one
row each; then a warm start from the compile cache and, if asked, a checkpoint."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from dflash.bench.timing import profile_table, reset_memory, timed, timed_step
from dflash.compile import (
    compile_counts,
    staggered_warmup,
)
from dflash.data.bundle import MicroBatch, random_batch, random_prefill
from dflash.data.dataset import synthetic_dataset
from dflash.data.order import collate
from dflash.device import peak_memory_gib, synchronize
from dflash.model.drafter import TargetHead
from dflash.model.target import PrefillOutput, Target, random_target
from dflash.run.build import (
    Job,
    build_trainer,
    prepare_packing,
    quantize_target,
    warm_drafter,
)
from dflash.run.checkpoint import CheckpointWriter, checkpoints
from dflash.run.estimate import (
    anchor_context,
    drafter_flops,
    keys_per_token,
    prefill_flops,
)
from dflash.run.step import DrafterTrainer

log = logging.getLogger("dflash.bench")

MODES = {"eager": None, "compile": "default", "reduce-overhead": "reduce-overhead"}
# Packed rows differ in their samples' lengths, and attention's work with them: at 32k the first
# two rows of an epoch attend over 1.2k and 8.4k keys per token. Every row of the bench cycles
# over the same rows, so prefill, drafter and colocated figures count the same work.
PACKED_ROWS = 8


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


def with_mode(job: Job, mode: str | None, target: bool = False) -> Job:
    """The job with the drafter (and, with ``target``, the target) compiled in one bench
    ``mode``; ``None``: eager. No CUDA graphs on the CPU."""
    cuda_mode = mode if job.device.type == "cuda" else None
    settings = replace(job.compile, drafter=mode is not None, target=target and mode is not None, mode=cuda_mode,
                       strict=False, warmup_turns=1)
    return replace(job, compile=settings)


class RoleBench:
    """Each role of a run timed alone at the job's shapes, on random weights: the target,
    its head and the micro-batches are built once, and every row (:meth:`prefill`,
    :meth:`drafter` per mode, :meth:`colocated`, :meth:`warm_start`) cycles over the same
    micro-batches, so their figures count the same work. The target is built here, not by
    the trainer's builders: they would read the data the bench replaces with these rows."""

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
        quantize_target(job, self.model)
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
        warm = staggered_warmup(lambda: warm_drafter(self.job.plan, trainer, self.dtype, self.job.plan.buckets), 0, 1)
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
    bench = RoleBench(job, steps, peak_tflops, profile, accumulation)
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


def format_rows(report: dict) -> str:
    """The rows of :func:`run_bench` as a table, with their compile stages and phases."""
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
