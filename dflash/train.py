"""Train a DFlash drafter.

    python -m dflash.train [key=value ...]                        # colocated, one process
    torchrun --nproc_per_node=N -m dflash.train topology.target_ranks=T [key=value ...]

Colocated, one process runs the target prefill then the drafter step for each
micro-batch. Disaggregated, ranks ``0..T-1`` run the target and stream batch
bundles to the drafter ranks ``T..N-1``, which train and reduce gradients among
themselves. Both walk the same deterministic schedule, so they train
identically. At the end the drafter is exported in the z-lab HF layout and
evaluated with real speculative decoding on held-out prompts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from dflash.anchors import default_gamma
from dflash.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from dflash.compile import (
    CompileGuard,
    CompileSettings,
    assert_main_thread,
    resolve_settings,
    share_compile_threads,
    staggered_warmup,
    warmup_group,
)
from dflash.data import AnchorSpec, Dataset, MicroBatch, Schedule, collate, load_dataset, random_batch, synthetic_dataset
from dflash.export import save_export
from dflash.metrics import MetricsLogger
from dflash.model import DFlashDrafter, DrafterConfig, TargetHead, default_target_layer_ids
from dflash.step import DrafterTrainer, ObjectiveConfig, build_optimizer, cosine_schedule
from dflash.target import (
    PrefillOutput,
    Target,
    load_head,
    load_target,
    load_tokenizer,
    random_prefill,
    resolve_mask_token_id,
    target_config,
)
from dflash.protocol import Protocol, Timeouts
from dflash.topology import Topology, auto_target_ranks
from dflash.transport import FLAG_ABORT, FLAG_END, BundleReceiver, BundleSender, Expected, PipelineCounters

log = logging.getLogger("dflash.train")

Feed = Callable[[int], Iterator[tuple[MicroBatch, PrefillOutput]]]


def pick_device() -> tuple[torch.device, torch.dtype]:
    """CUDA in bf16 when present (each rank sees its GPU as ``cuda:0`` or by
    LOCAL_RANK), else the CPU in fp32."""
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index), torch.bfloat16
    return torch.device("cpu"), torch.float32


def build_topology(cfg: DictConfig) -> Topology | None:
    """``None`` for the colocated layout (one process, or ``topology.mode=colocated``)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1 or cfg.topology.mode == "colocated":
        if world > 1:
            raise ValueError(f"topology.mode=colocated runs in one process, but WORLD_SIZE={world}")
        return None
    targets = cfg.topology.target_ranks
    if targets == "auto":
        targets = auto_split(cfg, world)
    return Topology(world, int(os.environ["RANK"]), int(targets), cfg.train.micro_batch_size, cfg.train.batch_size)


def auto_split(cfg: DictConfig, world: int) -> int:
    """Target ranks from the FLOPs of both sides, counted on meta-device models."""
    config = target_config_of(cfg)
    layer_ids = target_layer_ids(cfg, config.get_text_config().num_hidden_layers)
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.target.trust_remote_code)
        drafter = DFlashDrafter(drafter_config(config, cfg, layer_ids, 0))
    target_params = sum(p.numel() for p in target.parameters())
    head_params = target.get_output_embeddings().weight.numel()
    drafter_params = sum(p.numel() for p in drafter.parameters()) + head_params
    split = auto_target_ranks(world, target_params, drafter_params, cfg.train.num_anchors, cfg.train.max_len)
    log.info("topology.target_ranks=auto: %d target and %d drafter ranks", split, world - split)
    return split


def target_config_of(cfg: DictConfig):
    t = cfg.target
    return target_config(t.path, t.get("shape"), t.trust_remote_code)


def length_buckets(cfg: DictConfig) -> list[int]:
    """The padded lengths: what targets pad to and what drafters accept."""
    return sorted(cfg.train.buckets or [cfg.train.max_len])


def target_layer_ids(cfg: DictConfig, num_target_layers: int) -> list[int]:
    ids = cfg.drafter.target_layer_ids or default_target_layer_ids(num_target_layers, cfg.drafter.num_context_features)
    return list(ids)


def drafter_config(target_config, cfg: DictConfig, layer_ids: list[int], mask_token_id: int) -> DrafterConfig:
    """The drafter takes every shape but its depth from the target."""
    tc = target_config.get_text_config()
    rope = getattr(tc, "rope_parameters", None) or {}
    return DrafterConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=cfg.drafter.intermediate_size or tc.intermediate_size,
        num_layers=cfg.drafter.num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        vocab_size=tc.vocab_size,
        num_target_layers=tc.num_hidden_layers,
        target_layer_ids=layer_ids,
        mask_token_id=mask_token_id,
        block_size=cfg.drafter.block_size,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 1_000_000.0))),
        max_position_embeddings=tc.max_position_embeddings,
    )


@dataclass
class TargetSide:
    """What a target rank holds: the frozen target and the data it turns into bundles."""

    target: Target
    tokenizer: PreTrainedTokenizerBase | None
    dataset: Dataset
    schedule: Schedule
    anchors: AnchorSpec
    buckets: list[int]
    pad_id: int
    topk: int
    device: torch.device

    def produce(self, m: int) -> tuple[MicroBatch, PrefillOutput]:
        """Global micro-batch ``m``: collate (anchors drawn on the host), then prefill."""
        epoch, indices = self.schedule.micro_batch(m)
        batch = collate(self.dataset, epoch, indices, self.buckets, self.pad_id, self.anchors)
        prefill = self.target.prefill(batch.input_ids.to(self.device), self.topk)
        return batch, prefill

    def warm(self, micro_batch_size: int) -> None:
        """One prefill per length bucket, so every compiled shape exists before data flows."""
        vocab = self.target.head().vocab_size
        for seq_len in self.buckets:
            batch = random_batch(micro_batch_size, seq_len, vocab, self.anchors)
            self.target.prefill(batch.input_ids.to(self.device), self.topk)


def build_target_side(
    cfg: DictConfig, device: torch.device, dtype: torch.dtype, compile_settings: CompileSettings
) -> TargetSide:
    t = cfg.train
    tc = cfg.target
    model, tokenizer = load_target(tc.path, device, dtype, tc.trust_remote_code, tc.get("shape"), t.seed)
    layer_ids = target_layer_ids(cfg, model.config.get_text_config().num_hidden_layers)
    target = Target(model, layer_ids)
    if compile_settings.target:
        target.compile(compile_settings)
    if cfg.data.path == "synthetic":
        vocab = model.config.get_text_config().vocab_size
        dataset = synthetic_dataset(cfg.data.num_samples, t.max_len, vocab, cfg.data.prompt_fraction, t.seed)
    else:
        dataset = load_dataset(cfg.data.path, tokenizer, t.max_len, cfg.data.min_loss_tokens, cfg.data.strict, cfg.data.max_samples)
    log.info("%d conversations, %d skipped %s", len(dataset), sum(dataset.skipped.values()), dict(dataset.skipped))
    pad_id = 0 if tokenizer is None else tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return TargetSide(
        target=target,
        tokenizer=tokenizer,
        dataset=dataset,
        schedule=Schedule(len(dataset), t.batch_size, t.micro_batch_size, t.seed),
        anchors=AnchorSpec(t.num_anchors, cfg.drafter.block_size, t.seed),
        buckets=length_buckets(cfg),
        pad_id=pad_id,
        topk=cfg.loss.kl_topk,
        device=device,
    )


def total_steps(cfg: DictConfig, num_samples: int) -> int:
    schedule = Schedule(num_samples, cfg.train.batch_size, cfg.train.micro_batch_size, cfg.train.seed)
    return cfg.train.max_steps or cfg.train.epochs * schedule.steps_per_epoch


def build_trainer(
    cfg: DictConfig,
    target_config,
    head: TargetHead,
    mask_token_id: int,
    steps: int,
    device: torch.device,
    dtype: torch.dtype,
    compile_settings: CompileSettings,
) -> DrafterTrainer:
    """The drafter on the target's shapes (fp32 master weights, bf16 autocast on GPU)
    with AdamW and a cosine schedule."""
    t = cfg.train
    layer_ids = target_layer_ids(cfg, target_config.get_text_config().num_hidden_layers)
    dcfg = drafter_config(target_config, cfg, layer_ids, mask_token_id)
    torch.manual_seed(t.seed)
    drafter = DFlashDrafter(dcfg)
    drafter.reset_parameters(cfg.drafter.init_std)
    drafter.to(device)
    log.info(
        "drafter: %d layers at hidden %d, %.1fM trainable params, features from target layers %s, mask id %d",
        dcfg.num_layers, dcfg.hidden_size, sum(p.numel() for p in drafter.parameters()) / 1e6, layer_ids, mask_token_id,
    )
    optimizer = build_optimizer(drafter, t.lr, t.weight_decay, tuple(t.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(steps, t.warmup_ratio, t.min_lr_ratio))
    objective = ObjectiveConfig(
        block_size=dcfg.block_size,
        mask_token_id=mask_token_id,
        gamma=cfg.loss.gamma or default_gamma(dcfg.block_size),
        ce_weight=cfg.loss.ce_weight,
        kl_weight=cfg.loss.kl_weight,
        chunk_size=cfg.loss.chunk_size,
    )
    autocast = dtype if device.type == "cuda" else None
    return DrafterTrainer(drafter, head, objective, optimizer, scheduler, t.grad_clip, autocast, compile_settings)


def warm_drafter(cfg: DictConfig, trainer: DrafterTrainer, dtype: torch.dtype) -> None:
    """Compile and record the drafter step for every length bucket on random data."""
    if not trainer.compiled and trainer.device.type == "cpu":
        return  # nothing to compile
    t, head = cfg.train, trainer.head
    spec = AnchorSpec(t.num_anchors, trainer.obj.block_size, t.seed)
    batches = [
        (
            random_batch(t.micro_batch_size, seq_len, head.vocab_size, spec),
            random_prefill(
                t.micro_batch_size, seq_len, trainer.drafter.fc.in_features, dtype, cfg.loss.kl_topk,
                head.vocab_size, trainer.device,
            ),
        )
        for seq_len in length_buckets(cfg)
    ]
    trainer.warmup(batches)


def log_warmup(cfg: DictConfig, reports: list[dict]) -> None:
    """One line per rank and ``warmup.json``: who compiled, who loaded from the cache."""
    lines = [
        f"  rank {r['rank']} ({r['role']}, group {r['group']}): {r['wall_s']:.1f} s, {r['graphs']} graphs, "
        f"FX cache {r['fx_cache_hits']} hits / {r['fx_cache_misses']} misses, "
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
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


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
) -> int:
    """The optimizer-step loop shared by the colocated and drafter roles; ``proto`` is
    None in one process. Returns the last completed step."""
    t, ckpt_root = cfg.train, Path(cfg.output_dir) / "checkpoints"
    group = proto.drafters if proto else None
    others = [r for r in proto.topo.drafter_ranks if r != proto.rank] if proto else []

    def bounded(what: str):
        return proto.phase(what, proto.timeouts.step_s, others) if proto else nullcontext()

    stop = StopRequested()
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
                if in_a_row >= t.max_nonfinite:
                    raise RuntimeError(f"{in_a_row} steps in a row had no valid anchor or a non-finite loss")
            else:
                in_a_row = 0
                metrics.count(result)
                if step % t.log_every == 0 or step == steps:
                    metrics.log_step(step, steps, result, {"skipped_steps": skipped, **extra})
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == steps or stopping:
                with bounded(f"saving the checkpoint of step {step}"):
                    save_checkpoint(ckpt_root, step, trainer.drafter, trainer.optimizer, trainer.scheduler, cfg.checkpoint.keep, group)
            if stopping:
                log.warning("stopped at step %d; run again with resume=auto to continue", step)
                break
    finally:
        stop.restore()
    return step


def resume_step(cfg: DictConfig, trainer: DrafterTrainer, group=None) -> int:
    path = resolve_resume(str(cfg.resume), Path(cfg.output_dir) / "checkpoints")
    if path is None:
        return 0
    step = load_checkpoint(path, trainer.drafter, trainer.optimizer, trainer.scheduler, group)
    log.info("resumed from %s at step %d", path, step)
    return step


def finish_run(cfg: DictConfig, trainer: DrafterTrainer, device: torch.device) -> Path:
    export_dir = save_export(trainer.drafter, Path(cfg.output_dir) / "export", "bfloat16" if device.type == "cuda" else "float32")
    log.info("exported the drafter to %s", export_dir)
    return export_dir


def evaluate(cfg: DictConfig, side: TargetSide, export_dir: Path) -> dict:
    """Speculative decoding with the exported drafter on held-out prompts."""
    from dflash.eval import evaluate_datasets, format_table

    side.target.uncompile()
    report = evaluate_datasets(
        side.target.model, side.tokenizer, export_dir, side.target.head(), {"heldout": cfg.data.eval_path},
        cfg.eval.max_prompts, cfg.eval.max_new_tokens, Path(cfg.output_dir) / "eval.json", target_name=cfg.target.path,
    )
    log.info("speculative decoding with the export (%s):\n%s", Path(cfg.output_dir) / "eval.json", format_table(report))
    return report


def run_colocated(cfg: DictConfig, device: torch.device, dtype: torch.dtype, settings: CompileSettings) -> dict:
    side = build_target_side(cfg, device, dtype, settings)
    head = side.target.head()
    mask_id = resolve_mask_token_id(side.tokenizer, head.vocab_size, cfg.target.mask_token_id)
    steps = total_steps(cfg, len(side.dataset))
    trainer = build_trainer(cfg, side.target.model.config, head, mask_id, steps, device, dtype, settings)
    start = resume_step(cfg, trainer)

    def warm() -> None:
        if settings.target:
            side.warm(cfg.train.micro_batch_size)
        warm_drafter(cfg, trainer, dtype)

    report = staggered_warmup(warm, 0, 1)
    log_warmup(cfg, [{"rank": 0, "role": "colocated", **report}])
    guard = CompileGuard(settings.strict)
    guard.arm()
    per_step = side.schedule.micro_per_step

    def feed(step: int):
        return (side.produce(m) for m in range(step * per_step, (step + 1) * per_step))

    metrics = MetricsLogger(
        Path(cfg.output_dir), OmegaConf.to_container(cfg.wandb), OmegaConf.to_container(cfg, resolve=True), start
    )
    started = time.perf_counter()
    step = run_steps(cfg, trainer, feed, start, steps, metrics, guard)
    summary = {
        "steps": step, "train_s": round(time.perf_counter() - started, 1), "warmup_s": report["wall_s"],
        "peak_gib": peak_memory_gib(device),
    }
    if step == steps:
        export_dir = finish_run(cfg, trainer, device)
        if cfg.eval.enabled and cfg.data.eval_path:
            report = evaluate(cfg, side, export_dir)
            summary.update(eval_tau=report["tau"], lossless=report["lossless"])
    metrics.close(summary)
    return summary


def warm_in_turn(cfg: DictConfig, topo: Topology, proto: Protocol, settings: CompileSettings, warm: Callable[[], None]) -> None:
    """This rank's turn in the staggered warmup; the metrics rank records what each rank
    compiled or loaded."""

    def turn(rank: int) -> int:
        index = rank if rank < topo.num_targets else rank - topo.num_targets
        return warmup_group(rank, index == 0, index, settings.warmup_groups)

    mine = turn(topo.rank)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    node = range(topo.rank - topo.rank % per_node, topo.rank - topo.rank % per_node + per_node)
    share_compile_threads(sum(turn(r) == mine for r in node))
    reports = proto.warmup(warm, mine, settings.warmup_groups)
    if topo.rank == topo.metrics_rank:
        log_warmup(cfg, reports)


def run_target_rank(
    cfg: DictConfig, topo: Topology, proto: Protocol, device: torch.device, dtype: torch.dtype, settings: CompileSettings
) -> dict:
    """Produce this rank's micro-batches in schedule order and send each to its drafter,
    until the data ends or the drafters say training stopped."""
    side = build_target_side(cfg, device, dtype, settings)
    steps = proto.agree_steps(total_steps(cfg, len(side.dataset)))
    start = proto.agree_start(None)
    warm_in_turn(cfg, topo, proto, settings, lambda: side.warm(cfg.train.micro_batch_size) if settings.target else None)
    guard = CompileGuard(settings.strict)
    guard.arm()
    sender = BundleSender(proto.pairs_of_target(), device, cfg.topology.max_in_flight)
    first, last = start * topo.micro_per_step, steps * topo.micro_per_step
    signal.signal(signal.SIGTERM, lambda *_: log.warning("SIGTERM: producing until the drafters have checkpointed"))
    try:
        for m in topo.produced_by(topo.rank, first, last):
            if proto.stopped():
                break
            drafter = topo.consumer(m)
            with proto.phase(f"producing micro-batch {m} for drafter {drafter}", proto.timeouts.step_s, [drafter]):
                batch, prefill = side.produce(m)
                guard.check(f"target rank {topo.rank}, micro-batch {m}")
                sender.send(drafter, m, batch, prefill)
    except BaseException:
        for drafter in topo.drafter_ranks:
            sender.send_flag(drafter, -1, FLAG_ABORT)
        raise
    for drafter in topo.drafter_ranks:
        sender.send_flag(drafter, last, FLAG_END)
    with proto.phase("delivering the last bundles", proto.timeouts.step_s, topo.drafter_ranks):
        sender.drain()
    final_step = proto.final_step()
    proto.export_written()
    summary = {"role": "target", "steps": final_step, "send_wait_s": round(sender.wait_s, 2), "bytes_sent": sender.bytes_sent}
    record_ranks(cfg, proto, summary, device)
    if topo.rank == 0 and final_step == steps and cfg.eval.enabled and cfg.data.eval_path:
        report = evaluate(cfg, side, Path(cfg.output_dir) / "export")
        summary.update(eval_tau=report["tau"], lossless=report["lossless"])
    return summary


def run_drafter_rank(
    cfg: DictConfig, topo: Topology, proto: Protocol, device: torch.device, dtype: torch.dtype, settings: CompileSettings
) -> dict:
    """Receive bundles in schedule order, train, reduce over the drafter group."""
    tc = cfg.target
    config = target_config_of(cfg)
    head = load_head(tc.path, device, dtype, tc.trust_remote_code, tc.get("shape"), cfg.train.seed)
    mask_id = resolve_mask_token_id(load_tokenizer(tc.path, tc.trust_remote_code), head.vocab_size, tc.mask_token_id)
    steps = proto.agree_steps(None)
    trainer = build_trainer(cfg, config, head, mask_id, steps, device, dtype, settings)
    others = [r for r in topo.drafter_ranks if r != topo.rank]
    with proto.phase("reading the checkpoint to resume from", proto.timeouts.warmup_s, others):
        resumed = resume_step(cfg, trainer, proto.drafters)
    start = proto.agree_start(resumed)
    warm_in_turn(cfg, topo, proto, settings, lambda: warm_drafter(cfg, trainer, dtype))
    guard = CompileGuard(settings.strict)
    guard.arm()
    expected = Expected(
        max_batch=cfg.train.micro_batch_size,
        num_anchors=cfg.train.num_anchors,
        feature_dim=trainer.drafter.fc.in_features,
        feature_dtype=dtype,
        topk=cfg.loss.kl_topk,
        buckets=length_buckets(cfg),
    )
    receiver = BundleReceiver(proto.pairs_of_drafter(), device, expected)
    per_step = topo.micro_per_step

    def feed(step: int):
        for m in topo.consumed_by(topo.rank, step * per_step, (step + 1) * per_step):
            producer = topo.producer(m)
            with proto.phase(f"receiving micro-batch {m}", proto.timeouts.step_s, [producer]):
                _, batch, prefill = receiver.receive(producer, m)
            yield batch, prefill

    is_metrics = topo.rank == topo.metrics_rank
    metrics = MetricsLogger(
        Path(cfg.output_dir), OmegaConf.to_container(cfg.wandb), OmegaConf.to_container(cfg, resolve=True), start, is_metrics
    )
    counters = PipelineCounters(receiver, topo.num_targets, proto.drafters, device)
    started = time.perf_counter()
    step = run_steps(cfg, trainer, feed, start, steps, metrics, guard, proto, counters.step)
    if is_metrics:
        proto.announce_stop(step)
    for target in range(topo.num_targets):
        with proto.phase(f"receiving the end of data from target {target}", proto.timeouts.step_s, [target]):
            unused = receiver.drain(target)
        if step == steps and unused:
            raise RuntimeError(f"rank {topo.rank}: target {target} sent {unused} bundles past the last step")
    summary = {
        "role": "drafter", "steps": step, "train_s": round(time.perf_counter() - started, 1),
        "receive_wait_s": round(receiver.wait_s, 2), "bytes_received": receiver.bytes_received,
    }
    if is_metrics and step == steps:
        finish_run(cfg, trainer, device)
    proto.export_written()
    record_ranks(cfg, proto, summary, device)
    metrics.close(summary)
    return summary


def peak_memory_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def record_ranks(cfg: DictConfig, proto: Protocol, summary: dict, device: torch.device) -> None:
    """``ranks.json``: every rank's end-of-run summary and peak GPU memory, side by side."""
    summary.update(rank=proto.rank, peak_gib=peak_memory_gib(device))
    summaries = proto.summaries(summary)
    if proto.rank == proto.topo.metrics_rank:
        (Path(cfg.output_dir) / "ranks.json").write_text(json.dumps(summaries, indent=1))


def setup_logging(topo: Topology | None) -> None:
    """Hydra configures logging on rank 0; other ranks log warnings, and the
    metrics rank its progress lines too, tagged with the rank."""
    if topo is None or topo.rank == 0:
        return
    level = logging.INFO if topo.rank == topo.metrics_rank else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank {topo.rank}] %(asctime)s %(name)s: %(message)s", force=True)


def train(cfg: DictConfig) -> dict:
    assert_main_thread()
    topo = build_topology(cfg)
    setup_logging(topo)
    device, dtype = pick_device()
    settings = resolve_settings(cfg, device, len(length_buckets(cfg)))
    output_dir = Path(cfg.output_dir)
    if topo is None or topo.rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if topo is None:
        return run_colocated(cfg, device, dtype, settings)
    proto = Protocol(topo, device, timeouts(cfg))
    proto.start()
    try:
        if topo.is_target:
            summary = run_target_rank(cfg, topo, proto, device, dtype, settings)
        else:
            output_dir.mkdir(parents=True, exist_ok=True)
            summary = run_drafter_rank(cfg, topo, proto, device, dtype, settings)
    except BaseException:
        dist.destroy_process_group()
        raise
    proto.close()
    return summary


def timeouts(cfg: DictConfig) -> Timeouts:
    t = cfg.topology
    return Timeouts(init_s=float(t.init_timeout_s), warmup_s=float(t.warmup_timeout_s), step_s=float(t.timeout_s))


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    if int(os.environ.get("RANK", 0)) > 0:
        sys.argv += ["hydra/job_logging=none", "hydra/hydra_logging=none"]
    main()
