"""What each kind of rank runs: the shared step loop, colocated, target and drafter.

Colocated, one process runs the target prefill then the drafter step for each
micro-batch. Disaggregated, target ranks produce bundles in schedule order and
drafter ranks train on them; both walk the phases of :class:`dflash.protocol.Protocol`
in one order. Each role returns its end-of-run summary.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from dflash.compile import (
    CompileGuard,
    share_compile_threads,
    staggered_warmup,
    warmup_turn,
)
from dflash.data.bundle import MicroBatch
from dflash.decode.live import (
    EvalServer,
    Evaluator,
    LocalEval,
    RemoteEval,
    check_held_out_prompts,
    evaluates_export,
    live_eval_settings,
    template_kwargs,
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
from dflash.model.export import save_export
from dflash.model.target import PrefillOutput, resolve_mask_token_id
from dflash.run.build import (
    Job,
    TargetSide,
    build_target_side,
    build_trainer,
    drafter_config,
    warm_drafter,
)
from dflash.run.checkpoint import resume_candidates, save_checkpoint
from dflash.run.metrics import MetricsLogger
from dflash.run.step import DrafterTrainer

log = logging.getLogger(__name__)

# a failing target waits this long for its abort flag to reach the drafters (behind at most
# topology.max_in_flight bundles) before it aborts its communicators
ABORT_DELIVERY_S = 10.0

Feed = Callable[[int], Iterator[tuple[MicroBatch, PrefillOutput]]]


def log_warmup(cfg: DictConfig, reports: list[dict]) -> None:
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
    (Path(cfg.output_dir) / "warmup.json").write_text(json.dumps(reports, indent=1))


class StopRequested:
    """SIGTERM flips a flag; training checkpoints at the next step boundary and exits."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        log.warning("SIGTERM: checkpointing at the end of this step")
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def agree(flag: bool, device: torch.device, group) -> bool:
    """True on every drafter rank if it is true on any (so all stop at one step)."""
    if group is None:
        return flag
    vote = torch.tensor([int(flag)], device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
    return bool(vote.item())


def run_steps(
    cfg: DictConfig,
    trainer: DrafterTrainer,
    feed: Feed,
    start: int,
    steps: int,
    metrics: MetricsLogger,
    guard: CompileGuard,
    proto: Protocol | None = None,
    pipeline: Callable[[], dict] | None = None,
    evaluator: LocalEval | RemoteEval | None = None,
) -> int:
    """The optimizer-step loop shared by the colocated and drafter roles; ``proto`` is
    None in one process. ``evaluator`` runs speculative decoding every ``eval.every``
    steps (:mod:`dflash.decode.live`). Returns the last completed step."""
    train, ckpt_root = cfg.train, Path(cfg.output_dir) / "checkpoints"
    group = proto.drafters if proto else None
    def bounded(what: str):
        return proto.phase(what, proto.timeouts.step_s, proto.other_drafters()) if proto else nullcontext()

    stop = StopRequested()
    metrics.begin()
    in_a_row, skipped = 0, 0
    step = start
    try:
        while step < steps:
            for batch, prefill in feed(step):
                trainer.micro_step(batch, prefill)
            with bounded(f"reducing the gradients of step {step + 1}"):
                result = trainer.finish(group)
                extra = pipeline() if pipeline else {}
                stopping = agree(stop.requested, trainer.device, group)
            step += 1
            extra.update(guard.check(f"step {step}"))
            if result is None:
                skipped += 1
                in_a_row += 1
                log.warning("step %d skipped: no valid anchor or a non-finite loss (%d in a row)", step, in_a_row)
                if in_a_row >= train.max_nonfinite:
                    raise RuntimeError(f"{in_a_row} steps in a row had no valid anchor or a non-finite loss")
            else:
                in_a_row = 0
                metrics.count(result)
                if step % train.log_every == 0 or step == steps:
                    metrics.log_step(step, steps, result, {"skipped_steps": skipped, **extra})
            for record in evaluator.after_step(step, trainer.drafter, lambda: stop.requested) if evaluator else ():
                metrics.log_eval(record)
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == steps or stopping:
                with bounded(f"saving the checkpoint of step {step}"):
                    save_checkpoint(ckpt_root, step, trainer.drafter, trainer.optimizer, trainer.scheduler,
                                    cfg.checkpoint.keep, group)
            if stopping:
                log.warning("stopped at step %d; run again with resume=auto to continue", step)
                break
    finally:
        stop.restore()
    return step


def resume_step(cfg: DictConfig, trainer: DrafterTrainer, group=None) -> int:
    """Load the newest readable checkpoint (``resume``) and return its step; 0 for none.
    Under ``resume=auto`` a checkpoint that is incomplete or unreadable is skipped
    with a warning, falling back to the one before."""
    candidates = resume_candidates(str(cfg.resume), Path(cfg.output_dir) / "checkpoints")
    for i, path in enumerate(candidates):
        try:
            step = trainer.restore(path, group)
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back alike
            if i + 1 == len(candidates):
                raise RuntimeError(
                    f"no readable checkpoint under {Path(cfg.output_dir) / 'checkpoints'} (last tried {path}: {e}); "
                    "resume=never starts over"
                ) from e
            log.warning("checkpoint %s is unreadable (%s: %s); falling back to %s", path, type(e).__name__, e,
                        candidates[i + 1])
            continue
        log.info("resumed from %s at step %d", path, step)
        return step
    return 0


def export_drafter(cfg: DictConfig, trainer: DrafterTrainer, device: torch.device) -> Path:
    export_dir = save_export(trainer.drafter, Path(cfg.output_dir) / "export", "bfloat16" if device.type == "cuda" else "float32")
    log.info("exported the drafter to %s", export_dir)
    return export_dir


def evaluate_export(cfg: DictConfig, side: TargetSide, export_dir: Path) -> dict:
    """Speculative decoding with the exported drafter on held-out prompts."""
    from dflash.decode.speculative import evaluate_datasets, format_table

    side.target.uncompile()
    report = evaluate_datasets(
        side.target.model, side.tokenizer, export_dir, side.target.head(), {"heldout": cfg.data.eval_path},
        cfg.eval.max_prompts, cfg.eval.max_new_tokens, Path(cfg.output_dir) / "eval.json", target_name=cfg.target.path,
        template_kwargs=template_kwargs(cfg),
    )
    log.info("speculative decoding with the export (%s):\n%s", Path(cfg.output_dir) / "eval.json", format_table(report))
    return report


def open_metrics(cfg: DictConfig, start: int, enabled: bool = True) -> MetricsLogger:
    """The metrics log of a run starting at ``start``, opened before the compile warmup
    (and with it the W&B run), so that a logging problem ends the run in seconds."""
    return MetricsLogger(Path(cfg.output_dir), OmegaConf.to_container(cfg.wandb),
                         OmegaConf.to_container(cfg, resolve=True), start, enabled)


def run_colocated(job: Job) -> dict:
    cfg, plan, device = job.cfg, job.plan, job.device
    side = build_target_side(job)
    check_held_out_prompts(cfg, side.tokenizer)
    live = live_eval_settings(cfg)
    head = side.target.head()
    mask_id = resolve_mask_token_id(side.tokenizer, head.vocab_size, cfg.target.mask_token_id)
    steps = plan.total_steps(len(side.dataset))
    trainer = build_trainer(job, head, mask_id, steps)
    start = resume_step(cfg, trainer)
    metrics = open_metrics(cfg, start)
    metrics.log_data(side.dataset.summary())

    def warm() -> None:
        if job.compile.target:
            side.warm()
        warm_drafter(plan, trainer, job.dtype)

    report = staggered_warmup(warm, 0, 1)
    log_warmup(cfg, [{"rank": 0, "role": "colocated", **report}])
    guard = CompileGuard(job.compile.strict)
    guard.arm()
    per_step = plan.micro_per_step

    def feed(step: int):
        return (side.produce(m) for m in range(step * per_step, (step + 1) * per_step))

    evaluator = LocalEval(Evaluator(side.target, side.tokenizer, head, trainer.drafter.config, live), steps) if live else None
    started = time.perf_counter()
    step = run_steps(cfg, trainer, feed, start, steps, metrics, guard, evaluator=evaluator)
    summary = {
        "steps": step, "train_s": round(time.perf_counter() - started, 1), "warmup_s": report["wall_s"],
        "peak_gib": peak_memory_gib(device),
    }
    if step == steps:
        export_dir = export_drafter(cfg, trainer, device)
        if evaluates_export(cfg):
            report = evaluate_export(cfg, side, export_dir)
            summary.update(eval_tau=report["tau"], lossless=report["lossless"])
    metrics.close(summary)
    return summary


def warm_in_turn(job: Job, topo: Topology, proto: Protocol, warm: Callable[[], None]) -> None:
    """This rank's turn in the staggered warmup, handing compiled artifacts on within a
    role that compiles; the metrics rank records what each rank compiled, loaded or received."""
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
        log_warmup(job.cfg, reports)


def run_target_rank(job: Job, topo: Topology, proto: Protocol) -> dict:
    """Produce this rank's micro-batches in schedule order and send each to its drafter,
    until the data ends or the drafters say training stopped."""
    cfg, plan, device = job.cfg, job.plan, job.device
    side = build_target_side(job)
    if topo.rank == 0:
        check_held_out_prompts(cfg, side.tokenizer)
    steps = proto.agree_steps(plan.total_steps(len(side.dataset)), side.dataset.summary())
    start = proto.agree_start(None)
    server = eval_server(job, topo, proto, side)
    warm_in_turn(job, topo, proto, lambda: warm_target_rank(job, side, server))
    guard = CompileGuard(job.compile.strict)
    guard.arm()
    sender = BundleSender(proto.pairs_of_target(), device, plan.block_size, cfg.topology.max_in_flight,
                          server.idle if server and server.sliced else None)
    first, last = start * plan.micro_per_step, steps * plan.micro_per_step

    def on_sigterm(*_: object) -> None:
        log.warning("SIGTERM: producing until the drafters have checkpointed")
        if server:
            server.interrupt()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        for m in topo.produced_by(topo.rank, first, last):
            if proto.stopped():
                break
            if server:
                server.serve()
            drafter = topo.consumer(m)
            with proto.phase(f"producing micro-batch {m} for drafter {drafter}", proto.timeouts.step_s, [drafter]):
                batch, prefill = side.produce(m)
                guard.check(f"target rank {topo.rank}, micro-batch {m}")
                sender.send(drafter, m, batch, prefill)
    except BaseException:
        for drafter in topo.drafter_ranks:
            sender.send_flag(drafter, -1, FLAG_ABORT)
        if not sender.deliver(ABORT_DELIVERY_S):
            log.warning("the abort flag did not reach every drafter within %g s", ABORT_DELIVERY_S)
        raise
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
    record_ranks(cfg, proto, summary, device)
    if topo.rank == 0 and final_step == steps and evaluates_export(cfg):
        report = evaluate_export(cfg, side, Path(cfg.output_dir) / "export")
        summary.update(eval_tau=report["tau"], lossless=report["lossless"])
    return summary


def warm_target_rank(job: Job, side: TargetSide, server: EvalServer | None) -> None:
    """Compile the prefill; on target rank 0 with evaluations while training, also run
    the evaluation's decoding once, while no bundle is in flight (``Evaluator.warm``)."""
    if job.compile.target:
        side.warm()
    if server:
        server.warm()


def run_drafter_rank(job: Job, topo: Topology, proto: Protocol) -> dict:
    """Receive bundles in schedule order, train, reduce over the drafter group."""
    cfg, plan, device = job.cfg, job.plan, job.device
    head = job.source.head(device, job.dtype)
    mask_id = resolve_mask_token_id(job.source.tokenizer(), head.vocab_size, cfg.target.mask_token_id)
    steps = proto.agree_steps(None)
    trainer = build_trainer(job, head, mask_id, steps)
    with proto.phase("reading the checkpoint to resume from", proto.timeouts.warmup_s, proto.other_drafters()):
        resumed = resume_step(cfg, trainer, proto.drafters)
    start = proto.agree_start(resumed)
    is_metrics = topo.rank == topo.metrics_rank
    metrics = open_metrics(cfg, start, is_metrics)
    if is_metrics:
        metrics.log_data(proto.data_summary())
    warm_in_turn(job, topo, proto, lambda: warm_drafter(plan, trainer, job.dtype))
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

    counters = PipelineCounters(receiver, topo.num_targets, proto.drafters, device)
    live = live_eval_settings(cfg) if is_metrics else None
    evaluator = RemoteEval(proto, live, head.embed_weight.dtype, steps) if live else None
    started = time.perf_counter()
    step = run_steps(cfg, trainer, feed, start, steps, metrics, guard, proto, counters.step, evaluator)
    if is_metrics:
        proto.announce_stop(step)
    for target in range(topo.num_targets):
        with proto.phase(f"receiving the end of data from target {target}", proto.timeouts.step_s, [target]):
            unused = receiver.drain(target)
        if step == steps and unused:
            raise RuntimeError(f"rank {topo.rank}: target {target} sent {unused} bundles past the last step")
    # after the drain: target rank 0 finishes its evaluation once its data ends
    for record in evaluator.finish(step == steps) if evaluator else ():
        metrics.log_eval(record)
    summary = {
        "role": "drafter", "steps": step, "train_s": round(time.perf_counter() - started, 1),
        "receive_wait_s": round(receiver.wait_s, 2), "bytes_received": receiver.bytes_received,
    }
    if is_metrics and step == steps:
        export_drafter(cfg, trainer, device)
    proto.export_written()
    record_ranks(cfg, proto, summary, device)
    metrics.close(summary)
    return summary


def eval_server(job: Job, topo: Topology, proto: Protocol, side: TargetSide) -> EvalServer | None:
    """Target rank 0 serves the evaluations while training, when ``eval.every`` asks."""
    live = live_eval_settings(job.cfg)
    if live is None or topo.rank != 0:
        return None
    head = side.target.head()
    config = drafter_config(job, resolve_mask_token_id(side.tokenizer, head.vocab_size, job.cfg.target.mask_token_id))
    evaluator = Evaluator(side.target, side.tokenizer, head, config, live)
    return EvalServer(proto, evaluator, sliced=job.device.type == "cuda")


def record_ranks(cfg: DictConfig, proto: Protocol, summary: dict, device: torch.device) -> None:
    """``ranks.json``: every rank's end-of-run summary and peak GPU memory, side by side."""
    summary.update(rank=proto.rank, peak_gib=peak_memory_gib(device))
    summaries = proto.summaries(summary)
    if proto.rank == proto.topo.metrics_rank:
        (Path(cfg.output_dir) / "ranks.json").write_text(json.dumps(summaries, indent=1))


