"""Train a DFlash drafter.

    python -m dflash.train [key=value ...]                        # colocated, one process
    torchrun --nproc_per_node=N -m dflash.train topology.target_ranks=T [key=value ...]

Colocated, one process runs the target prefill then the drafter step for each
micro-batch. Disaggregated, ranks ``0..T-1`` run the target and stream batch
bundles to the drafter ranks ``T..N-1``, which train and reduce gradients among
themselves. Both walk the same deterministic schedule, so they train
identically. At the end the drafter is exported in the z-lab HF layout and
evaluated with real speculative decoding on held-out prompts.

This module only chooses the role: :mod:`dflash.build` turns the config into
parts, :mod:`dflash.roles` runs them.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from dflash.build import build_job, build_topology, timeouts
from dflash.compile import assert_main_thread
from dflash.protocol import Protocol
from dflash.roles import run_colocated, run_drafter_rank, run_target_rank
from dflash.topology import Topology


def setup_logging(topo: Topology | None) -> None:
    """Hydra configures logging on rank 0; other ranks log warnings, and the
    metrics rank its progress lines too, tagged with the rank."""
    if topo is None or topo.rank == 0:
        return
    level = logging.INFO if topo.rank == topo.metrics_rank else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank {topo.rank}] %(asctime)s %(name)s: %(message)s", force=True)


def train(cfg: DictConfig) -> dict:
    """Run this process's role to the end; returns its summary."""
    assert_main_thread()
    job = build_job(cfg)
    topo = build_topology(job)
    setup_logging(topo)
    output_dir = Path(cfg.output_dir)
    if topo is None or topo.rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if topo is None:
        return run_colocated(job)
    proto = Protocol(topo, job.device, timeouts(cfg))
    proto.start()
    try:
        if topo.is_target:
            summary = run_target_rank(job, topo, proto)
        else:
            output_dir.mkdir(parents=True, exist_ok=True)
            summary = run_drafter_rank(job, topo, proto)
    except BaseException:
        dist.destroy_process_group()
        raise
    proto.close()
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    if int(os.environ.get("RANK", 0)) > 0:
        sys.argv += ["hydra/job_logging=none", "hydra/hydra_logging=none"]
    main()
