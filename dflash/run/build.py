"""From the config to the parts of a run: the job, the topology, the target side, the
drafter side.

Everything here is construction: the layout is chosen by :mod:`dflash.run.layout`, and
:mod:`dflash.run.roles` runs the parts. Both sides
take every shared number from :class:`dflash.run.plan.Plan` and every other setting
from :class:`dflash.run.settings.RunSettings`; below this module nothing reads the
Hydra config.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerBase

from dflash.compile import CompileSettings, resolve_settings
from dflash.data.bundle import MicroBatch, random_batch, random_prefill
from dflash.data.dataset import Dataset, DataSettings, load_dataset, synthetic_dataset
from dflash.data.order import PackedOrder, SampleOrder, buckets_met, collate
from dflash.device import pick_device
from dflash.distributed import tensor_parallel
from dflash.distributed.protocol import Protocol, Timeouts
from dflash.distributed.topology import Topology, TopologyError
from dflash.model.drafter import (
    DFlashDrafter,
    DrafterConfig,
    TargetHead,
    check_layer_types,
    variant_config,
)
from dflash.model.export import init_from
from dflash.model.fp8 import check_fp8, quantize_prefill
from dflash.model.target import PrefillOutput, Target, TargetSource, decoder_layers
from dflash.run.checkpoint import CheckpointMismatch, resume_candidates
from dflash.run.config import target_source
from dflash.run.layout import LayoutChoice, choose_layout
from dflash.run.metrics import MetricsLogger
from dflash.run.plan import Plan, resolve_plan
from dflash.run.settings import (
    LayoutSettings,
    RunSettings,
    layout_settings,
    run_settings,
)
from dflash.run.step import DrafterTrainer, build_optimizer, cosine_schedule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """What this process resolved from the config before building anything. ``cfg`` is
    for the builders in this module; the roles read ``plan`` and ``settings``."""

    cfg: DictConfig
    source: TargetSource
    target_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None  # read once: the plan's mask id and the target side's data
    plan: Plan  # its micro-batch as the layout's choice fitted it
    drafter: DrafterConfig
    settings: RunSettings
    device: torch.device
    dtype: torch.dtype  # the target's weights and the drafter's autocast
    compile: CompileSettings
    layout_settings: LayoutSettings
    layout: LayoutChoice  # for the world size the job was planned for
    tensor_parallel: int = 1  # target ranks per target replica (target.tensor_parallel)


def planned_world_size(cfg: DictConfig) -> int:
    """The ranks a job is planned for: ``estimate.nproc`` in a dry run, else torchrun's."""
    launched = int(os.environ.get("WORLD_SIZE", 1))
    return int(cfg.estimate.nproc or launched) if cfg.dry_run else launched


def build_job(cfg: DictConfig, world_size: int | None = None) -> Job:
    """The job of ``cfg`` on ``world_size`` ranks (:func:`planned_world_size` if None): the
    plan, its layout and micro-batch chosen once (:func:`~dflash.run.layout.choose_layout`),
    the settings. Raises :class:`TopologyError` or :class:`~dflash.run.layout.DoesNotFit`
    for a plan no layout can run."""
    drafter = cfg.drafter  # checked on every rank, before anything loads
    check_layer_types(drafter.get("layer_types"), drafter.num_layers, drafter.get("sliding_window"))
    source = target_source(cfg)
    target_config, tokenizer = source.config(), source.tokenizer()
    plan = resolve_plan(cfg, target_config, tokenizer)
    device, dtype = pick_device()
    compile_settings = resolve_settings(OmegaConf.to_container(cfg.compile), device, len(plan.buckets))
    k = int(cfg.target.get("tensor_parallel", 1))
    check_fp8_settings(cfg, device, k)
    if k > 1:
        check_tensor_parallel(cfg, k)
        tensor_parallel.check_transformers()
        tensor_parallel.check_heads(target_config, k)
        # the sharded layers run collectives inside; the prefill runs eager
        compile_settings = replace(compile_settings, target=False)
    settings = run_settings(cfg)
    layout = layout_settings(cfg, flash=compile_settings.attention == "flash", tensor_parallel=k,
                             live_every=settings.live.every if settings.live else 0, target_path=str(source.path))
    drafter_cfg = drafter_config(cfg.drafter, target_config, plan)  # the micro-batch does not enter it
    models = meta_models(source, target_config, drafter_cfg)
    plan, choice = choose_layout(layout, plan, models, planned_world_size(cfg) if world_size is None else world_size)
    return Job(cfg, source, target_config, tokenizer, plan, drafter_cfg, settings, device, dtype, compile_settings,
               layout, choice, k)


def check_fp8_settings(cfg: DictConfig, device: torch.device, k: int) -> None:
    """``train.fp8`` and ``target.fp8`` where they cannot run, refused before anything loads
    (a dry run plans them for any device)."""
    if cfg.target.fp8 and k > 1:
        raise ValueError(f"target.fp8=true quantizes a whole target's layers, and target.tensor_parallel={k} shards "
                         "them: set one of the two back")
    if cfg.dry_run:
        return
    for key, on in (("train.fp8", cfg.train.fp8), ("target.fp8", cfg.target.fp8)):
        if on:
            check_fp8(key, device)


def check_tensor_parallel(cfg: DictConfig, k: int) -> None:
    """What a tensor-parallel target cannot do, refused on every rank before anything
    loads: a colocated layout (each rank would hold a whole target) and evaluation while
    training (target rank 0 decodes alone, and its group's reductions need every rank)."""
    if cfg.topology.mode == "colocated":
        raise TopologyError(f"target.tensor_parallel={k} shards the target over target ranks of a split; "
                            "topology.mode=colocated holds a whole target on every rank: use topology.mode=auto "
                            "or disaggregated, or target.tensor_parallel=1")
    if cfg.eval.every:
        raise ValueError(f"eval.every={cfg.eval.every}: evaluation while training decodes on target rank 0 alone, "
                         f"which a target sharded over {k} ranks cannot do; set eval.every=0 (score the export "
                         "with dflash.eval or a serving engine)")


def timeouts(cfg: DictConfig) -> Timeouts:
    topology = cfg.topology
    return Timeouts(init_s=float(topology.init_timeout_s), warmup_s=float(topology.warmup_timeout_s),
                    step_s=float(topology.timeout_s))


def build_topology(job: Job, targets: int) -> Topology | None:
    """``None`` for one process; under torchrun, colocated data-parallel ranks
    (``targets`` 0) or a split into ``targets`` target ranks (in groups of
    ``target.tensor_parallel``, each on one node) and drafter ranks."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        if job.tensor_parallel > 1:
            raise TopologyError(f"target.tensor_parallel={job.tensor_parallel} needs torchrun with at least "
                                f"{job.tensor_parallel + 1} processes (the target group and a drafter rank)")
        return None
    plan = job.plan
    topo = Topology(world, int(os.environ["RANK"]), targets, plan.micro_batch_size, plan.batch_size, job.tensor_parallel)
    tensor_parallel.check_placement(topo.target_groups, tensor_parallel.ranks_per_node(world))
    return topo


def meta_models(source: TargetSource, target_config: PretrainedConfig, drafter: DrafterConfig
                ) -> tuple[nn.Module, DFlashDrafter]:
    """The target and the drafter on the meta device: shapes and parameter counts, no memory."""
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(target_config, trust_remote_code=source.trust_remote_code)
        return target, DFlashDrafter(drafter)


def drafter_config(drafter: DictConfig, target_config: PretrainedConfig, plan: Plan) -> DrafterConfig:
    """The drafter takes every shape but its depth (and each layer's attention) from the target;
    ``drafter.num_attention_heads``, ``num_key_value_heads`` and ``head_dim`` override the
    target's where released drafters differ from it (Qwen3.5/3.6-class hybrids: 32 heads
    of 128 against the target's 24 of 256)."""
    text = target_config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or {}
    layer_types = drafter.get("layer_types")
    return DrafterConfig(
        hidden_size=text.hidden_size,
        intermediate_size=drafter.intermediate_size or text.intermediate_size,
        num_layers=drafter.num_layers,
        num_attention_heads=drafter.get("num_attention_heads") or text.num_attention_heads,
        num_key_value_heads=drafter.get("num_key_value_heads") or text.num_key_value_heads,
        head_dim=drafter.get("head_dim") or getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        vocab_size=text.vocab_size,
        num_target_layers=text.num_hidden_layers,
        target_layer_ids=list(plan.layer_ids),
        mask_token_id=plan.mask_token_id,
        block_size=plan.block_size,
        rms_norm_eps=text.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(text, "rope_theta", 1_000_000.0))),
        max_position_embeddings=text.max_position_embeddings,
        layer_types=None if layer_types is None else list(layer_types),
        sliding_window=drafter.get("sliding_window"),
        sliding_causal=drafter.get("sliding_causal", True),
        dflash2=variant_config(drafter.get("variant", "dflash"), drafter),
    )


@dataclass
class TargetSide:
    """What a target rank holds: the frozen target and the data it turns into bundles."""

    target: Target
    tokenizer: PreTrainedTokenizerBase | None
    dataset: Dataset
    order: SampleOrder | PackedOrder
    plan: Plan
    pad_id: int
    device: torch.device

    def produce(self, m: int) -> tuple[MicroBatch, PrefillOutput]:
        """Global micro-batch ``m``: collate (anchors drawn on the host), move it to the
        device once (the prefill, the send and the drafter step all read it there), then
        prefill (a packed one with its samples kept apart)."""
        epoch, rows = self.order.rows(m)
        batch = collate(self.dataset, epoch, rows, list(self.plan.buckets), pad_id=self.pad_id,
                        spec=self.plan.anchor_spec())
        batch = batch.to(self.device)
        return batch, self.target.prefill(batch.input_ids, self.plan.topk, self.packed_positions(batch))

    def packed_positions(self, batch: MicroBatch) -> torch.Tensor | None:
        """The position ids the prefill needs: a packed batch's, else none (the fast causal path)."""
        return batch.position_ids if self.plan.packing else None

    def buckets_met(self, steps: int) -> tuple[int, ...]:
        """The length buckets the micro-batches of ``steps`` steps are padded to."""
        return buckets_met(self.order, self.dataset.lengths(), self.plan.buckets, steps * self.plan.micro_per_step)

    def warm(self, buckets: tuple[int, ...]) -> None:
        """One prefill per length bucket the run meets, so every compiled shape exists
        before data flows."""
        vocab = self.target.head().vocab_size
        for seq_len in buckets:
            batch = random_batch(self.plan.micro_batch_size, seq_len, vocab, self.plan.anchor_spec(),
                                 samples_per_row=2 if self.plan.packing else 1).to(self.device)
            self.target.prefill(batch.input_ids, self.plan.topk, self.packed_positions(batch))


def check_packing(target: Target, dtype: torch.dtype) -> None:
    """``train.packing`` needs a target whose packed samples never see each other; one
    that does (recurrent or linear-attention layers, attention that ignores position
    ids) would hand the drafter features of the wrong context, so it is refused."""
    error = target.packing_error()
    limit = 1e-4 if dtype == torch.float32 else 0.1
    if error > limit:
        raise ValueError(
            f"train.packing: {type(target.model).__name__} does not keep packed samples apart (their features "
            f"differ from each sample's alone by {error:.1%}), so its context features would mix samples; "
            "train with train.packing=false"
        )
    log.info("train.packing: %s keeps packed samples apart (features within %.1e of each sample alone)",
             type(target.model).__name__, error)


def prepare_packing(target: Target, device: torch.device, dtype: torch.dtype) -> None:
    """A target for packed rows: on CUDA attending with flex attention where its family has
    it, then checked to keep its packed samples apart (:func:`check_packing`)."""
    if device.type == "cuda" and target.attend_packed_with_flex():
        log.info("train.packing: the target attends with flex attention, skipping other samples' tiles")
    check_packing(target, dtype)


def read_data(job: Job) -> Dataset:
    """The training samples: ``data=synthetic``'s drawn, else read and tokenised (or loaded
    from the token cache)."""
    cfg, plan = job.cfg, job.plan
    if cfg.data.path == "synthetic":
        vocab = job.target_config.get_text_config().vocab_size
        return synthetic_dataset(cfg.data.num_samples, plan.max_len, vocab, cfg.data.prompt_fraction, seed=plan.seed,
                                 mean_length=cfg.data.get("mean_length"))
    return load_dataset(DataSettings(
        cfg.data.path, plan.max_len, cfg.data.min_loss_tokens, strict=cfg.data.strict, max_samples=cfg.data.max_samples,
        cache_dir=cfg.data.cache_dir or None, wait_s=cfg.topology.warmup_timeout_s, weights=cfg.data.weights,
        seed=plan.seed, template_kwargs=cfg.data.chat_template_kwargs), job.tokenizer)


def in_background(fn: Callable[[], object], name: str) -> Future:
    """``fn()`` on a daemon thread, for work that touches no model: reading and tokenising
    the data while the main thread loads the target's weights. Its ``result()`` raises
    what ``fn`` raised. A daemon rather than an executor's worker, which the interpreter
    joins at exit: an error on the main thread ends the process at once instead of
    waiting for the data."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - raised on the main thread by result()
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def quantize_target(job: Job, model: nn.Module) -> None:
    """``target.fp8``: the decoder layers' linear layers in FP8; the embedding and LM head,
    which the drafter reads, stay bf16."""
    if job.cfg.target.fp8:
        count = quantize_prefill(decoder_layers(model))
        log.info("target.fp8: %d linear layers of the target's decoder layers prefill in FP8 (weights per output "
                 "channel, activations per token; torchao)", count)


def build_target_side(job: Job, group: dist.ProcessGroup | None = None) -> TargetSide:
    """The target (this rank's shard of it over ``group``, a tensor-parallel target
    group), the data and the sample order. The data is read on a background thread while
    the weights load; the target's layers are compiled later, once the run has weighed
    the compile (:func:`dflash.run.warmup.choose_warmup`)."""
    plan = job.plan
    reading = in_background(lambda: read_data(job), "dflash-data")
    if group is None:
        model = job.source.model(job.device, job.dtype)
    else:
        model = tensor_parallel.load_target(job.source, job.device, job.dtype, group)
        log.info("target sharded over ranks %s with transformers' tensor-parallel plan",
                 dist.get_process_group_ranks(group))
    target = Target(model, list(plan.layer_ids))
    quantize_target(job, model)
    if plan.packing:
        prepare_packing(target, job.device, job.dtype)
    dataset = reading.result()
    skipped = dataset.skipped
    log.info("%d training samples, %d records skipped %s", len(dataset), sum(skipped.values()), dict(skipped))
    tokenizer = job.tokenizer
    pad_id = 0 if tokenizer is None else tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    order = plan.sample_order(dataset.lengths())
    if plan.packing:
        log.info("train.packing: %d samples in %d rows of %d tokens, %.1f%% padding", len(dataset), order.num_rows,
                 plan.max_len, 100 * order.padding())
    return TargetSide(target, tokenizer, dataset, order, plan, pad_id, job.device)


def build_trainer(job: Job, head: TargetHead, steps: int) -> DrafterTrainer:
    """The drafter on the target's shapes (fp32 master weights, bf16 autocast on GPU)
    with AdamW and a cosine schedule over ``steps``."""
    train = job.cfg.train
    config = job.drafter
    torch.manual_seed(job.plan.seed)
    with torch.device(job.device):  # drawn where it trains: 14 s of host init for 1B parameters otherwise
        drafter = DFlashDrafter(config)
    drafter.reset_parameters(job.cfg.drafter.init_std)
    if job.cfg.drafter.get("init_from"):
        init_from(drafter, job.cfg.drafter.init_from)
        log.info("drafter weights from %s", job.cfg.drafter.init_from)
    log.info(
        "drafter: %d layers at hidden %d, %.1fM trainable params, features from target layers %s, mask id %d",
        config.num_layers, config.hidden_size, sum(p.numel() for p in drafter.parameters()) / 1e6,
        list(job.plan.layer_ids), config.mask_token_id,
    )
    optimizer = build_optimizer(drafter, train.lr, train.weight_decay, tuple(train.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(steps, train.warmup_ratio, train.min_lr_ratio))
    autocast = job.dtype if job.device.type == "cuda" else None
    trainer = DrafterTrainer(drafter, head, replace(job.plan.objective, total_steps=steps), optimizer, scheduler,
                             train.grad_clip, autocast, job.compile, fp8=bool(train.fp8))
    if trainer.fp8_layers:
        log.info("train.fp8: %d linear layers train with FP8 matmuls at rowwise scaling (torchao)",
                 len(trainer.fp8_layers))
    return trainer


def warm_drafter(plan: Plan, trainer: DrafterTrainer, dtype: torch.dtype, buckets: tuple[int, ...]) -> None:
    """Compile and record the drafter step for every length bucket the run meets, on random data."""
    if not trainer.compiled and trainer.device.type == "cpu":
        return  # nothing to compile
    vocab, micro = trainer.head.vocab_size, plan.micro_batch_size
    batches = [
        (
            random_batch(micro, seq_len, vocab, plan.anchor_spec(), samples_per_row=2 if plan.packing else 1),
            random_prefill(micro, seq_len, plan.feature_dim, dtype, plan.topk, vocab, trainer.device),
        )
        for seq_len in buckets
    ]
    trainer.warmup(batches)


@dataclass
class DrafterSide:
    """What trains the drafter on a drafter rank or in the colocated process: the
    trainer on the frozen head, the step range it runs, and its metrics log."""

    trainer: DrafterTrainer
    head: TargetHead
    start: int  # the step resumed from, agreed by every rank
    steps: int
    metrics: MetricsLogger


def resume_step(settings: RunSettings, trainer: DrafterTrainer, group=None) -> int:
    """Load the newest readable checkpoint (``resume``) and return its step; 0 for none.
    Under ``resume=auto`` a checkpoint that is damaged (its files differ from their
    digests), incomplete or unreadable is skipped with a warning that names the file and
    why, falling back to the one before; a checkpoint named by ``resume`` is refused."""
    root = settings.run_dir.checkpoints
    candidates = resume_candidates(settings.resume, root)
    for i, path in enumerate(candidates):
        try:
            step = trainer.restore(path, group)
        except CheckpointMismatch:
            raise  # an older checkpoint of the same run is of the same other drafter
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back alike
            if settings.resume != "auto":
                raise RuntimeError(f"resume={settings.resume} is refused: {e}") from e
            if i + 1 == len(candidates):
                raise RuntimeError(
                    f"no readable checkpoint under {root} (last tried {path}: {e}); resume=never starts over"
                ) from e
            log.warning("checkpoint %s is unreadable (%s: %s); falling back to %s", path, type(e).__name__, e,
                        candidates[i + 1])
            continue
        log.info("resumed from %s at step %d", path, step)
        return step
    return 0


def build_drafter_side(job: Job, head: TargetHead, steps: int, proto: Protocol | None = None,
                       logs: bool = True) -> DrafterSide:
    """The trainer resumed from the newest checkpoint, and the metrics log opened at that
    step before the compile warmup (and with it the W&B run), so that a logging problem
    ends the run in seconds. With ``proto`` the drafter ranks read their checkpoint under
    a deadline and agree on the step; ``logs`` is false on all but the metrics rank."""
    trainer = build_trainer(job, head, steps)
    if proto is None:
        start = resume_step(job.settings, trainer)
    else:
        with proto.phase("reading the checkpoint to resume from", proto.timeouts.warmup_s, proto.other_drafters()):
            resumed = resume_step(job.settings, trainer, proto.drafters)
        start = proto.agree_start(resumed)
    settings = job.settings
    metrics = MetricsLogger(settings.run_dir.root, settings.wandb, settings.config, start, logs)
    return DrafterSide(trainer, head, start, steps, metrics)
