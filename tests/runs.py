"""Run ``dflash.train`` in-process (colocated) or as a gloo process group, for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.multiprocessing as mp

from dflash.distributed.protocol import free_port, set_rank_env
from dflash.run.config import compose_config as compose_cfg

# Small enough for 2 CPU cores, big enough to exercise accumulation and every path.
TINY = [
    "wandb.mode=disabled",
    "compile.strict=true",
    "eval.enabled=false",
    "train.max_steps=10",
    "train.batch_size=4",
    "train.micro_batch_size=1",
    "train.num_anchors=8",
    "train.log_every=1",
    "drafter.num_layers=1",
    "drafter.block_size=8",
    "data.max_samples=64",
]


# A random-weight Qwen3-shaped target, tiny, with synthetic data: no tokenizer.
RANDOM_TARGET = [
    "target=qwen3_8b", "target.path=random", "target.mask_token_id=255", "data=synthetic", "data.num_samples=64",
    "target.shape.hidden_size=64", "target.shape.intermediate_size=128", "target.shape.num_hidden_layers=8",
    "target.shape.num_attention_heads=4", "target.shape.num_key_value_heads=2", "target.shape.head_dim=16",
    "target.shape.vocab_size=256", "train.max_len=64", "train.buckets=[64]",
]


def read_records(output_dir: Path) -> list[dict]:
    """Every record of ``metrics.jsonl``: steps, evaluations, the data summary."""
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def starts(output_dir: Path) -> list[int]:
    """The step each start of the run began at (its data record's step): ``[0, 4]`` for a
    run resumed from its step-4 checkpoint. Training is deterministic and a fresh start
    empties ``metrics.jsonl``, so a restart that ignored the checkpoints and trained from
    step 0 again would log the same steps and losses as an exact resume."""
    return [r["step"] for r in read_records(output_dir) if "data/samples" in r]


def read_metrics(output_dir: Path) -> list[dict]:
    """The optimizer steps' records."""
    return [r for r in read_records(output_dir) if "loss" in r]


def run_colocated(output_dir: Path, overrides: list[str]) -> dict:
    from dflash.train import train

    return train(compose_cfg(TINY + [f"output_dir={output_dir}"] + overrides))


def _worker(rank: int, world: int, port: int, overrides: list[str]) -> None:
    set_rank_env(rank, world, port, local=True)
    torch.set_num_threads(1)
    from dflash.train import train

    train(compose_cfg(overrides))


def run_disaggregated(output_dir: Path, world: int, targets: int, overrides: list[str]) -> None:
    """``world`` processes over gloo, ``targets`` of them target ranks; raises if any fails."""
    args = TINY + [f"output_dir={output_dir}", f"topology.target_ranks={targets}"] + overrides
    mp.start_processes(_worker, args=(world, free_port(), args), nprocs=world, join=True, start_method="spawn")


def run_data_parallel(output_dir: Path, world: int, overrides: list[str]) -> None:
    """``world`` colocated data-parallel processes over gloo (``topology.mode=colocated``)."""
    args = TINY + [f"output_dir={output_dir}", "topology.mode=colocated"] + overrides
    mp.start_processes(_worker, args=(world, free_port(), args), nprocs=world, join=True, start_method="spawn")
