"""What each kind of rank runs: colocated, target and drafter.

Colocated, one process runs the target prefill then the drafter step for each
micro-batch. Disaggregated, target ranks produce bundles in schedule order and
drafter ranks train on them; both walk the phases of :class:`dflash.distributed.protocol.Protocol`
in one order. The builders of :mod:`dflash.run.build` assemble each side; a role
only runs it, and returns its end-of-run summary.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from dflash.compile import (
    CompileGuard,
    share_compile_threads,
    staggered_warmup,
    warmup_turn,
)
from dflash.decode.evaluate import evaluate_datasets, format_table
from dflash.decode.live import (
    EvalServer,
    Evaluator,
    LocalEval,
    RemoteEval,
    check_held_out_prompts,
)
from dflash.device import peak_memory_gib
from dflash.distributed.protocol import Protocol
from dflash.distributed.topology import Topology
from dflash.distributed.transport import (
    FLAG_ABORT,
    FLAG_END,
    BundleReceiver,
    BundleSender,
    PipelineCounters,
)
from dflash.model.export import load_export, save_export
from dflash.run import garbage
from dflash.run.build import (
    Job,
    TargetSide,
    build_drafter_side,
    build_target_side,
    warm_drafter,
)
from dflash.run.loop import StepLoop
from dflash.run.settings import RunSettings
from dflash.run.startup import phases as startup
from dflash.run.step import DrafterTrainer
from dflash.run.warmup import choose_warmup

log = logging.getLogger(__name__)

# a failing target waits this long for its abort flag to reach the drafters (behind at most
# topology.max_in_flight bundles) before it aborts its communicators
ABORT_DELIVERY_S = 10.0


def log_warmup(settings: RunSettings, reports: list[dict]) -> None:
    """One line per rank and ``warmup.json``: who compiled, who loaded its cache from
    disk, who received its role's first rank's artifacts, and the bytes handed on."""
    lines = [
        f"  rank {r['rank']} ({r['role']}, turn {r['turn']}): {r['wall_s']:.1f} s, {r['cache']}, "
        f"artifacts {r['artifacts_received'] / 1e6:.1f} MB in / {r['artifacts_sent'] / 1e6:.1f} MB out, "
        f"{r['graphs']} graphs, FX cache {r['fx_cache_hits']} hits / {r['fx_cache_misses']} misses, "
        f"AOT cache {r['aot_cache_hits']} hits / {r['aot_cache_misses']} misses"
        for r in reports
    ]
    log.info("compile warmup:\n%s", "\n".join(lines))
    settings.run_dir.warmup.write_text(json.dumps(reports, indent=1))


def weigh_compile(job: Job, steps: int, buckets: tuple[int, ...]) -> tuple[Job, tuple[int, ...]]:
    """The job with its compile decided for a run of ``steps`` steps
    (:func:`~dflash.run.warmup.choose_warmup`), and the buckets its warmup covers."""
    choice = choose_warmup(job.compile, job.plan, job.layout.taken, steps, buckets, job.device.type == "cuda")
    log.info(choice.reason)
    return replace(job, compile=choice.compile), choice.buckets


def schedule(side: TargetSide, steps: int) -> tuple[dict, tuple[int, ...]]:
    """The data's summary for the metrics log and the other ranks, with the length buckets
    the run's ``steps`` steps meet (``buckets``), and those buckets."""
    buckets = side.buckets_met(steps)
    return {**side.dataset.summary(), "buckets": list(buckets)}, buckets


def export_drafter(settings: RunSettings, trainer: DrafterTrainer, device: torch.device) -> Path:
    export_dir = save_export(trainer.drafter, settings.run_dir.export, "bfloat16" if device.type == "cuda" else "float32")
    log.info("exported the drafter to %s", export_dir)
    return export_dir


def evaluate_export(settings: RunSettings, side: TargetSide, export_dir: Path) -> dict:
    """Speculative decoding with the exported drafter on held-out prompts."""
    side.target.uncompile()
    held_out, report_path = settings.export_eval, settings.run_dir.eval_report
    head = side.target.head()
    drafter = load_export(export_dir, head.embed_weight.device, head.embed_weight.dtype)
    report = evaluate_datasets(
        side.target.model, side.tokenizer, drafter, head, drafter_dir=export_dir,
        datasets={"heldout": held_out.prompts_path}, out_path=report_path, target_name=settings.target_name,
        settings=held_out.decode,
    )
    log.info("speculative decoding with the export (%s):\n%s", report_path, format_table(report))
    return report


def check_evaluation(settings: RunSettings, side: TargetSide) -> None:
    """On the rank that evaluates the export, its held-out prompts are read at start."""
    if settings.export_eval:
        held_out = settings.export_eval
        check_held_out_prompts(held_out.prompts_path, side.tokenizer, held_out.decode.template_kwargs)


def run_colocated(job: Job, topo: Topology | None = None, proto: Protocol | None = None) -> dict:
    """Target and drafter in this process: each micro-batch is prefilled, then trained on.
    Under torchrun (``topo`` and ``proto``, ``topology.mode=colocated``) every rank does so
    on its share of each step's micro-batches, the share a drafter rank of the same count
    would train on, and the drafter's gradients are reduced over all ranks; rank 0 logs,
    checkpoints, exports and evaluates."""
    plan, device, settings = job.plan, job.device, job.settings
    first = topo is None or topo.rank == 0
    side = build_target_side(job)
    startup.mark("the target and the data")
    if first:
        check_evaluation(settings, side)
    steps = plan.total_steps(side.order)
    data, buckets = schedule(side, steps)
    if proto:
        steps = proto.agree_steps(steps, data)
    job, buckets = weigh_compile(job, steps, buckets)
    if job.compile.target:
        side.target.compile(job.compile)
    drafting = build_drafter_side(job, side.target.head(), steps, proto, logs=first)
    startup.mark("the drafter and its checkpoint")
    trainer = drafting.trainer
    if first:
        drafting.metrics.log_data(data)

    def warm() -> None:
        if job.compile.target:
            side.warm(buckets)
        warm_drafter(plan, trainer, job.dtype, buckets)

    if proto:
        reports = warm_in_turn(job, topo, proto, warm)
    else:
        reports = [{"rank": 0, "role": "colocated", **staggered_warmup(warm, 0, 1)}]
        log_warmup(settings, reports)
    startup.mark("the compile warmup")
    garbage.settle()
    guard = CompileGuard(job.compile.strict)
    guard.arm()
    per_step = plan.micro_per_step

    def feed(step: int):
        window = range(step * per_step, (step + 1) * per_step)
        mine = window if topo is None else topo.consumed_by(topo.rank, window.start, window.stop)
        return (side.produce(m) for m in mine)

    live = settings.live if first else None
    evaluator = LocalEval(Evaluator(side.target, side.tokenizer, drafting.head, trainer.drafter.config, live),
                          steps) if live else None
    started = time.perf_counter()
    loop = StepLoop(settings, trainer, drafting.metrics, guard, proto, evaluator=evaluator)
    step = loop.run(feed, drafting.start, steps)
    summary = {
        "role": "colocated", "steps": step, "samples_trained": int(trainer.samples_trained),
        "train_s": round(time.perf_counter() - started, 1),
        "warmup_s": reports[0 if topo is None else topo.rank]["wall_s"], "peak_gib": peak_memory_gib(device),
    }
    export_dir = export_drafter(settings, trainer, device) if first and step == steps else None
    if proto:
        proto.export_written()
        record_ranks(settings, proto, summary, device)
    if export_dir and settings.export_eval:
        report = evaluate_export(settings, side, export_dir)
        summary.update(eval_tau=report["tau"], lossless=report["lossless"])
    drafting.metrics.close(summary)
    return summary


def warm_in_turn(job: Job, topo: Topology, proto: Protocol, warm: Callable[[], None]) -> list[dict]:
    """This rank's turn in the staggered warmup, handing compiled artifacts on within a
    role that compiles; the metrics rank records what each rank compiled, loaded or
    received. Returns every rank's report, in rank order."""
    turns = job.compile.warmup_turns

    def turn(rank: int) -> int:
        index = rank if rank < topo.num_targets else rank - topo.num_targets
        return warmup_turn(index == 0, index, turns)

    mine = turn(topo.rank)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    node = range(topo.rank - topo.rank % per_node, topo.rank - topo.rank % per_node + per_node)
    share_compile_threads(sum(turn(r) == mine for r in node))
    compiles = job.compile.target if topo.is_target else job.compile.drafter
    reports = proto.warmup(warm, mine, turns, share=compiles)
    if topo.rank == topo.metrics_rank:
        log_warmup(job.settings, reports)
    return reports


def run_target_rank(job: Job, topo: Topology, proto: Protocol) -> dict:
    """Produce this rank's micro-batches in schedule order and send each to its drafter,
    until the data ends or the drafters say training stopped. The ranks of a
    tensor-parallel group prefill each of their group's micro-batches together; only
    the group's leader sends."""
    plan, device, settings = job.plan, job.device, job.settings
    side = build_target_side(job, proto.target_group)
    startup.mark("the target and the data")
    if topo.rank == 0:
        check_evaluation(settings, side)
    steps = plan.total_steps(side.order)
    steps = proto.agree_steps(steps, schedule(side, steps)[0] if topo.rank == 0 else None)
    job, buckets = weigh_compile(job, steps, tuple(proto.data_summary()["buckets"]))
    if job.compile.target:
        side.target.compile(job.compile)
    start = proto.agree_start(None)
    server = eval_server(job, topo, proto, side)
    warm_in_turn(job, topo, proto, lambda: warm_target_rank(job, side, server, buckets))
    startup.mark("the compile warmup")
    garbage.settle()
    guard = CompileGuard(job.compile.strict)
    guard.arm()
    sender = BundleSender(proto.pairs_of_target(), device, plan.block_size, settings.max_in_flight,
                          server.idle if server and server.sliced else None)
    first, last = start * plan.micro_per_step, steps * plan.micro_per_step

    def on_sigterm(*_: object) -> None:
        log.warning("SIGTERM: producing until the drafters have checkpointed")
        if server:
            server.interrupt()

    signal.signal(signal.SIGTERM, on_sigterm)
    sends = topo.is_sender
    collector = garbage.StepCollector(start)
    try:
        for m in topo.produced_by(topo.rank, first, last):
            collector.before(m // plan.micro_per_step)
            if not proto.proceed(m):
                break
            if server:
                server.serve()
            drafter = topo.consumer(m)
            peers = [drafter] + [r for r in topo.group_of(topo.rank) if r != topo.rank]
            with proto.phase(f"producing micro-batch {m} for drafter {drafter}", proto.timeouts.step_s, peers):
                batch, prefill = side.produce(m)
                guard.check(f"target rank {topo.rank}, micro-batch {m}")
                if sends:
                    sender.send(drafter, m, batch, prefill)
    except BaseException:
        if sends:
            for drafter in topo.drafter_ranks:
                sender.send_flag(drafter, -1, FLAG_ABORT)
            if not sender.deliver(ABORT_DELIVERY_S):
                log.warning("the abort flag did not reach every drafter within %g s", ABORT_DELIVERY_S)
        raise
    if sends:
        for drafter in topo.drafter_ranks:
            sender.send_flag(drafter, last, FLAG_END)
        with proto.phase("delivering the last bundles", proto.timeouts.step_s, topo.drafter_ranks):
            sender.drain()
    if server:
        server.until_stopped(steps)
    final_step = proto.final_step()
    proto.export_written()
    summary = {"role": "target", "steps": final_step, "send_wait_s": round(sender.wait_s, 2), "bytes_sent": sender.bytes_sent}
    if server:
        summary.update(eval_s=round(server.eval_s, 2), eval_warm_s=round(server.warm_s, 2))
    record_ranks(settings, proto, summary, device)
    if topo.rank == 0 and final_step == steps and settings.export_eval and topo.tensor_parallel > 1:
        log.warning("the export is not evaluated here: target rank 0 decodes alone, and its target is sharded over "
                    "%d ranks; score it with dflash.eval or a serving engine", topo.tensor_parallel)
    elif topo.rank == 0 and final_step == steps and settings.export_eval:
        report = evaluate_export(settings, side, settings.run_dir.export)
        summary.update(eval_tau=report["tau"], lossless=report["lossless"])
    return summary


def warm_target_rank(job: Job, side: TargetSide, server: EvalServer | None, buckets: tuple[int, ...]) -> None:
    """Compile the prefill at ``buckets``; on target rank 0 with evaluations while training,
    also run the evaluation's decoding once, while no bundle is in flight (``Evaluator.warm``)."""
    if job.compile.target:
        side.warm(buckets)
    if server:
        server.warm()


def run_drafter_rank(job: Job, topo: Topology, proto: Protocol) -> dict:
    """Receive bundles in schedule order, train, reduce over the drafter group."""
    plan, device, settings = job.plan, job.device, job.settings
    is_metrics = topo.rank == topo.metrics_rank
    head = job.source.head(device, job.dtype)
    steps = proto.agree_steps(None)
    data = proto.data_summary()
    job, buckets = weigh_compile(job, steps, tuple(data["buckets"]))
    drafting = build_drafter_side(job, head, steps, proto, logs=is_metrics)
    startup.mark("the head, the drafter and its checkpoint")
    trainer, steps, metrics = drafting.trainer, drafting.steps, drafting.metrics
    if is_metrics:
        metrics.log_data(data)
    warm_in_turn(job, topo, proto, lambda: warm_drafter(plan, trainer, job.dtype, buckets))
    startup.mark("the compile warmup")
    garbage.settle()
    guard = CompileGuard(job.compile.strict)
    guard.arm()
    receiver = BundleReceiver(proto.pairs_of_drafter(), device, plan.expected(job.dtype))
    per_step = plan.micro_per_step

    def feed(step: int):
        for m in topo.consumed_by(topo.rank, step * per_step, (step + 1) * per_step):
            producer = topo.producer(m)
            with proto.phase(f"receiving micro-batch {m}", proto.timeouts.step_s, [producer]):
                _, batch, prefill = receiver.receive(producer, m)
            yield batch, prefill

    counters = PipelineCounters(receiver, topo.senders, proto.drafters, device)
    live = settings.live if is_metrics else None
    evaluator = RemoteEval(proto, live, head.embed_weight.dtype, steps) if live else None
    started = time.perf_counter()
    loop = StepLoop(settings, trainer, metrics, guard, proto, counters.step, evaluator)
    step = loop.run(feed, drafting.start, steps)
    if is_metrics:
        proto.announce_stop(step)
    for target in topo.senders:
        with proto.phase(f"receiving the end of data from target {target}", proto.timeouts.step_s, [target]):
            unused = receiver.drain(target)
        if step == steps and unused:
            raise RuntimeError(f"rank {topo.rank}: target {target} sent {unused} bundles past the last step")
    # after the drain: target rank 0 finishes its evaluation once its data ends
    for record in evaluator.finish(step == steps) if evaluator else ():
        metrics.log_eval(record)
    summary = {
        "role": "drafter", "steps": step, "samples_trained": int(trainer.samples_trained),
        "train_s": round(time.perf_counter() - started, 1),
        "receive_wait_s": round(receiver.wait_s, 2), "bytes_received": receiver.bytes_received,
    }
    if is_metrics and step == steps:
        export_drafter(settings, trainer, device)
    proto.export_written()
    record_ranks(settings, proto, summary, device)
    metrics.close(summary)
    return summary


def eval_server(job: Job, topo: Topology, proto: Protocol, side: TargetSide) -> EvalServer | None:
    """Target rank 0 serves the evaluations while training, when ``eval.every`` asks."""
    live = job.settings.live
    if live is None or topo.rank != 0:
        return None
    evaluator = Evaluator(side.target, side.tokenizer, side.target.head(), job.drafter, live)
    return EvalServer(proto, evaluator, sliced=job.device.type == "cuda")


def record_ranks(settings: RunSettings, proto: Protocol, summary: dict, device: torch.device) -> None:
    """``ranks.json``: every rank's end-of-run summary and peak GPU memory, side by side."""
    summary.update(rank=proto.rank, peak_gib=peak_memory_gib(device))
    summaries = proto.summaries(summary)
    if proto.rank == proto.topo.metrics_rank:
        settings.run_dir.ranks.write_text(json.dumps(summaries, indent=1))
