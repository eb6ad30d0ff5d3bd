"""Train a DFlash drafter: ``python -m dflash.train [key=value ...]``.

Reads top-down: pick the device, load the frozen target, build the drafter on
the target's shapes, load the data, then loop: target prefill -> drafter
forward/backward per micro-batch, one optimizer step per global batch. At the
end the drafter is exported in the z-lab HF layout and evaluated with real
speculative decoding on held-out prompts.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from dflash.anchors import default_gamma
from dflash.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from dflash.data import Schedule, collate, load_dataset
from dflash.export import save_export
from dflash.metrics import MetricsLogger
from dflash.model import DFlashDrafter, DrafterConfig, default_target_layer_ids
from dflash.step import DrafterTrainer, ObjectiveConfig, build_optimizer, cosine_schedule
from dflash.target import Target, load_target, resolve_mask_token_id

log = logging.getLogger("dflash.train")


def pick_device() -> tuple[torch.device, torch.dtype]:
    """CUDA in bf16 when present, else the CPU in fp32."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    return torch.device("cpu"), torch.float32


def drafter_config(target_config, cfg: DictConfig, layer_ids: list[int], mask_token_id: int) -> DrafterConfig:
    """The drafter takes every shape but its depth from the target."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
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


class StopRequested:
    """SIGTERM flips a flag; the loop checkpoints at the next step boundary and exits."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        log.warning("SIGTERM: checkpointing at the end of this step")
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def train(cfg: DictConfig) -> dict:
    device, dtype = pick_device()
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    torch.manual_seed(cfg.train.seed)

    # Target: frozen, capturing only the chosen layers.
    target_model, tokenizer = load_target(cfg.target.path, device, dtype, cfg.target.trust_remote_code)
    num_target_layers = target_model.config.get_text_config().num_hidden_layers
    layer_ids = list(cfg.drafter.target_layer_ids or default_target_layer_ids(num_target_layers, cfg.drafter.num_context_features))
    target = Target(target_model, layer_ids)
    head = target.head()
    mask_token_id = resolve_mask_token_id(tokenizer, head.vocab_size, cfg.target.mask_token_id)

    # Drafter: fp32 master weights; bf16 autocast on GPU.
    dcfg = drafter_config(target_model.config, cfg, layer_ids, mask_token_id)
    drafter = DFlashDrafter(dcfg)
    drafter.reset_parameters(cfg.drafter.init_std)
    drafter.to(device)
    log.info(
        "target %s: %d layers, features from %s; drafter %d layers, %.1fM trainable params, mask id %d",
        cfg.target.path, num_target_layers, layer_ids, dcfg.num_layers,
        sum(p.numel() for p in drafter.parameters()) / 1e6, mask_token_id,
    )

    # Data and the deterministic schedule of micro-batches.
    t = cfg.train
    dataset = load_dataset(cfg.data.path, tokenizer, t.max_len, cfg.data.min_loss_tokens, cfg.data.strict, cfg.data.max_samples)
    schedule = Schedule(len(dataset), t.batch_size, t.micro_batch_size, t.seed)
    total_steps = t.max_steps or t.epochs * schedule.steps_per_epoch
    buckets = list(t.buckets or [t.max_len])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    log.info(
        "%d conversations (%d skipped), %d steps of %d sequences (%d micro-batches of %d)",
        len(dataset), sum(dataset.skipped.values()), total_steps, t.batch_size, schedule.micro_per_step, t.micro_batch_size,
    )

    optimizer = build_optimizer(drafter, t.lr, t.weight_decay, tuple(t.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(total_steps, t.warmup_ratio, t.min_lr_ratio))
    objective = ObjectiveConfig(
        num_anchors=t.num_anchors,
        block_size=dcfg.block_size,
        mask_token_id=mask_token_id,
        gamma=cfg.loss.gamma or default_gamma(dcfg.block_size),
        seed=t.seed,
        ce_weight=cfg.loss.ce_weight,
        kl_weight=cfg.loss.kl_weight,
        chunk_size=cfg.loss.chunk_size,
    )
    trainer = DrafterTrainer(
        drafter, head, objective, optimizer, scheduler, t.grad_clip, dtype if device.type == "cuda" else None
    )

    ckpt_root = output_dir / "checkpoints"
    start_step = 0
    resume_from = resolve_resume(str(cfg.resume), ckpt_root)
    if resume_from is not None:
        start_step, _ = load_checkpoint(resume_from, drafter, optimizer, scheduler)
        log.info("resumed from %s at step %d", resume_from, start_step)

    metrics = MetricsLogger(output_dir, OmegaConf.to_container(cfg.wandb), OmegaConf.to_container(cfg, resolve=True))
    stop = StopRequested()
    nonfinite_in_a_row, skipped_steps, last = 0, 0, {}
    started = time.perf_counter()
    try:
        step = start_step
        while step < total_steps and not stop.requested:
            for m in range(step * schedule.micro_per_step, (step + 1) * schedule.micro_per_step):
                epoch, indices = schedule.micro_batch(m)
                batch = collate(dataset, epoch, indices, buckets, pad_id)
                prefill = target.prefill(batch.input_ids.to(device), batch.attention_mask.to(device), cfg.loss.kl_topk)
                trainer.micro_step(batch, prefill)
            result = trainer.finish()
            step += 1
            if result is None:
                skipped_steps += 1
                nonfinite_in_a_row += 1
                if nonfinite_in_a_row >= t.max_nonfinite:
                    raise RuntimeError(f"{nonfinite_in_a_row} steps in a row had no valid anchor or a non-finite loss")
                continue
            nonfinite_in_a_row = 0
            if step % t.log_every == 0 or step == total_steps:
                last = metrics.log_step(step, total_steps, result, {"skipped_steps": skipped_steps, "epoch": epoch})
            else:
                metrics.reset_clock()
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                save_checkpoint(ckpt_root, step, drafter, optimizer, scheduler, cfg.checkpoint.keep)
        save_checkpoint(ckpt_root, step, drafter, optimizer, scheduler, cfg.checkpoint.keep)
    finally:
        stop.restore()
    train_s = time.perf_counter() - started
    summary = {"steps": step, "train_s": train_s, "skipped_steps": skipped_steps, **{k: last[k] for k in ("loss", "tau_sim") if k in last}}
    if stop.requested and step < total_steps:
        log.warning("stopped by SIGTERM at step %d; resume with resume=auto", step)
        metrics.close(summary)
        return summary

    export_dir = save_export(drafter, output_dir / "export", "bfloat16" if device.type == "cuda" else "float32")
    log.info("exported the drafter to %s (%.0f s of training)", export_dir, train_s)
    if cfg.eval.enabled and cfg.data.eval_path:
        from dflash.eval import evaluate_datasets

        report = evaluate_datasets(
            target_model, tokenizer, export_dir, head, {"heldout": cfg.data.eval_path},
            cfg.eval.max_prompts, cfg.eval.max_new_tokens, output_dir / "eval.json",
        )
        summary.update({"eval_tau": report["tau"], "lossless": report["lossless"]})
    metrics.close(summary)
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
