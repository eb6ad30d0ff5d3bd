"""The command: its arguments and config, the work of this rank, the engine it runs, the
merge, and the summary."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict

import dflash.regenerate
from dflash.regenerate.local import load_local, regenerate_local, throughput
from dflash.regenerate.records import Sampling, find_work, keyed_records
from dflash.regenerate.server import Server, regenerate_server
from dflash.regenerate.shards import (
    MERGE_WAIT,
    Progress,
    ShardWriter,
    check_settings,
    finished_keys,
    merge,
    parts_dir,
)
from dflash.run.config import compose_config

log = logging.getLogger("dflash.regenerate")


def sampling_of(args: argparse.Namespace, cfg: DictConfig) -> Sampling:
    kwargs = OmegaConf.to_container(cfg.data.get("chat_template_kwargs") or OmegaConf.create({}))
    return Sampling(args.max_new_tokens, args.temperature, args.top_p, kwargs, args.seed)


def settings_of(args: argparse.Namespace, cfg: DictConfig, sampling: Sampling) -> dict:
    """What a restart must keep: the data, the model and how replies are drawn."""
    model = {"server": args.server, "model": args.model} if args.server else {"target": str(cfg.target.path)}
    return {"data": OmegaConf.to_container(cfg.data.path) if OmegaConf.is_config(cfg.data.path) else cfg.data.path,
            **model, "max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "chat_template_kwargs": dict(sampling.template_kwargs), "seed": sampling.seed}


def regenerate(args: argparse.Namespace, cfg: DictConfig) -> dict | None:
    """This rank's shard, then (rank 0, once every rank is done) the merge and the summary."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo", timeout=MERGE_WAIT)
    out = Path(args.out)
    directory = parts_dir(out)
    sampling = sampling_of(args, cfg)
    done = finished_keys(directory)
    work = find_work(cfg.data.path, cfg.data.max_samples, args.batch_size * args.window, rank, world=world, done=done)
    check_settings(directory, settings_of(args, cfg, sampling))  # after the input proved readable
    log.info("rank %d of %d: %d records, %d done before, %d to regenerate here, %d unreadable", rank, world,
             len(work.keys), len(done & set(work.keys)), work.pending, len(work.skipped))
    writer = ShardWriter(directory / f"rank{rank}-of-{world}.jsonl")
    writer.write(work.skipped)
    progress = Progress(work.pending, "regenerate" if world == 1 else f"rank 0 of {world}", enabled=rank == 0)
    began = time.perf_counter()
    try:
        if work.pending == 0:
            tokens = 0
        elif args.server:
            tokens = regenerate_server(Server(args.server, args.model, sampling), work, args.concurrency, writer,
                                       progress=progress)
        else:
            tokens = regenerate_local(load_local(cfg, sampling), work, args.batch_size, sampling.seed, writer=writer,
                                      progress=progress)
    finally:
        progress.close()
        writer.close()
    run = torch.tensor([tokens, time.perf_counter() - began], dtype=torch.float64)
    if world > 1:  # every shard is written once this returns
        dist.all_reduce(run[:1])
        dist.all_reduce(run[1:], op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
    if rank:
        return None
    summary = merge(work.keys, directory, out, args.keep_truncated)
    summary.update(run_tokens=int(run[0]), run_s=round(float(run[1]), 2))
    return summary


def format_summary(s: dict) -> str:
    skipped = sum(s["skipped"].values())
    reasons = ", ".join(f"{k}: {v}" for k, v in s["skipped"].items())
    fate = "kept" if s["keep_truncated"] else "dropped; --keep-truncated keeps them"
    lines = [
        f"records read:      {s['records']}",
        f"regenerated:       {s['regenerated']}",
        f"skipped:           {skipped}" + (f" ({reasons})" if reasons else ""),
        f"truncated:         {s['truncated']} ({fate})",
        f"tokens generated:  {s['tokens']}",
    ]
    if "run_tokens" in s:
        rate = s["run_tokens"] / s["run_s"] if s["run_s"] else 0.0
        lines.append(f"this run:          {s['run_tokens']} tokens in {s['run_s']:.1f} s, {rate:.1f} tokens/s")
    lines.append(f"wrote {s['written']} conversations to {s['out']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dflash.regenerate", description=dflash.regenerate.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides: target=..., target.path=..., data.path=...")
    ap.add_argument("--out", help="the regenerated JSONL; shards and progress go to <out>.parts/")
    ap.add_argument("--temperature", type=float, default=None, help="0: greedy; default: the target's generation config")
    ap.add_argument("--top-p", type=float, default=None, help="default: the target's generation config")
    ap.add_argument("--max-new-tokens", type=int, default=2048, help="per reply; a longer one is truncated")
    ap.add_argument("--batch-size", type=int, default=64, help="prompts per generate call (local target)")
    ap.add_argument("--window", type=int, default=16,
                    help="batches whose prompts are sorted by length together; also the unit of a rank's shard")
    ap.add_argument("--thinking", choices=["on", "off"], default=None,
                    help="data.chat_template_kwargs.enable_thinking, for templates that read it (Qwen3)")
    ap.add_argument("--keep-truncated", action="store_true",
                    help="keep replies that reached --max-new-tokens without the end-of-turn token")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (local target)")
    ap.add_argument("--server", default=None, help="URL of an OpenAI-compatible server (vLLM, SGLang) to ask instead")
    ap.add_argument("--model", default=None, help="model name on the server; default: the first it lists")
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight to the server")
    ap.add_argument("--merge", action="store_true", help="only write --out from finished shards")
    ap.add_argument("--throughput", type=int, default=0, metavar="N",
                    help="instead, time generation from N random-token prompts at the target's shape")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of --throughput")
    args = ap.parse_intermixed_args(argv)
    if not args.throughput and not args.out:
        ap.error("--out is required")
    return args


def config_of(args: argparse.Namespace) -> DictConfig:
    """The Hydra config of the overrides, with ``--thinking`` as a template argument."""
    cfg = compose_config(["wandb.mode=disabled", *args.overrides])
    if args.thinking is not None:
        with open_dict(cfg):
            if cfg.data.get("chat_template_kwargs") is None:
                cfg.data.chat_template_kwargs = {}
            cfg.data.chat_template_kwargs.enable_thinking = args.thinking == "on"
    return cfg


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = config_of(args)
    if (args.throughput or args.merge) and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise SystemExit("--throughput and --merge run in one process, not under torchrun")
    if args.throughput:
        report = throughput(cfg, args.throughput, args.batch_size, args.prompt_len, sampling=sampling_of(args, cfg))
        print(json.dumps(report, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        return report
    if args.merge:
        keys = [key for _, key, _ in keyed_records(cfg.data.path, cfg.data.max_samples)]
        summary = merge(keys, parts_dir(Path(args.out)), Path(args.out), args.keep_truncated)
    else:
        summary = regenerate(args, cfg)
    if summary is not None:
        print(format_summary(summary))
    return summary
