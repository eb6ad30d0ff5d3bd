"""Train a DFlash drafter.

    python -m dflash.train [key=value ...]                        # colocated, one process
    torchrun --nproc_per_node=N -m dflash.train topology.target_ranks=T [key=value ...]

Colocated, one process runs the target prefill then the drafter step for each
micro-batch. Disaggregated, ranks ``0..T-1`` run the target and stream batch
bundles to the drafter ranks ``T..N-1``, which train and reduce gradients among
themselves. Both walk the same deterministic schedule, so they train
identically. At the end the drafter is exported in the z-lab HF layout and
evaluated with real speculative decoding on held-out prompts.

This module only chooses the role: :mod:`dflash.run.build` turns the config into
parts, :mod:`dflash.run.roles` runs them.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from dflash.compile import assert_main_thread
from dflash.distributed.protocol import Protocol
from dflash.distributed.topology import Topology, TopologyError
from dflash.run.build import Job, build_job, build_topology, timeouts
from dflash.run.config import config_dir
from dflash.run.garbage import collected_between_steps
from dflash.run.layout import DoesNotFit, check_fits, format_layout, format_options
from dflash.run.metrics import require_wandb
from dflash.run.roles import run_colocated, run_drafter_rank, run_target_rank
from dflash.run.startup import phases as startup
from dflash.run.warmup import break_even

log = logging.getLogger("dflash.train")


def setup_logging(topo: Topology | None) -> None:
    """Hydra configures logging on rank 0; other ranks log warnings, and the
    metrics rank its progress lines too, tagged with the rank."""
    if topo is None or topo.rank == 0:
        return
    level = logging.INFO if topo.rank == topo.metrics_rank else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank {topo.rank}] %(asctime)s %(name)s: %(message)s", force=True)


def dry_run(cfg: DictConfig) -> dict:
    """Print the plan and return, touching neither weights nor the output directory."""
    try:
        job = build_job(cfg)
        check_fits(job.layout.taken)
    except (TopologyError, DoesNotFit) as e:
        raise SystemExit(f"dry run: the plan is refused: {e}") from None
    if int(os.environ.get("RANK", 0)) == 0:
        print(describe(job), flush=True)
    return {"dry_run": True}


def describe(job: Job) -> str:
    """The layout's cost, and on several ranks the layouts open to it."""
    text = format_layout(job.layout_settings, job.plan, job.layout)
    if job.cfg.compile.enabled == "auto" and (job.cfg.dry_run or job.device.type == "cuda"):
        # a run on the CPU says what it compiles once it starts (nothing, under auto)
        text += "\n  " + break_even(job.plan, job.layout.taken)
    if job.layout.taken.world_size > 1:
        text += "\n" + format_options(job.layout.options, job.layout.targets, job.plan.micro_batch_size,
                                      job.plan.packing)
    return text


def train(cfg: DictConfig) -> dict:
    """Run this process's role to the end; returns its summary. Python's garbage
    collection waits for step boundaries meanwhile (:mod:`dflash.run.garbage`)."""
    assert_main_thread()
    startup.mark("imports and the config")
    with collected_between_steps(int(cfg.train.gc_every)):
        return run_role(cfg)


def run_role(cfg: DictConfig) -> dict:
    """The plan (its micro-batch fitted to a rank's memory), the layout, the process
    groups, then this rank's role."""
    if cfg.dry_run:
        return dry_run(cfg)
    job = build_job(cfg)
    startup.mark("the plan and the layout")
    require_wandb(cfg.wandb.mode)
    topo = build_topology(job, job.layout.targets)
    setup_logging(topo)
    if topo is None or topo.rank == topo.metrics_rank:
        log.info("%s", describe(job))
        try:
            check_fits(job.layout.taken)
        except DoesNotFit as e:
            log.warning("%s (an estimate: the run goes on)", e)
    run_dir = job.settings.run_dir
    if topo is None or topo.rank == 0:
        run_dir.root.mkdir(parents=True, exist_ok=True)
        run_dir.config.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if topo is None:
        return run_colocated(job)
    proto = Protocol(topo, job.device, timeouts(cfg), eval_link=job.settings.live is not None and not topo.colocated)
    try:
        proto.start()
        startup.mark("process groups")
        if topo.colocated:
            summary = run_colocated(job, topo, proto)
        elif topo.is_target:
            summary = run_target_rank(job, topo, proto)
        else:
            run_dir.root.mkdir(parents=True, exist_ok=True)
            summary = run_drafter_rank(job, topo, proto)
    except BaseException:
        proto.abort()
        raise
    proto.close()
    return summary


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    if int(os.environ.get("RANK", 0)) > 0:
        sys.argv += ["hydra/job_logging=none", "hydra/hydra_logging=none"]
    if any(arg.lower() in ("dry_run=true", "dry_run=1") for arg in sys.argv[1:]):
        # Hydra creates its run directory (the output_dir) before the job starts: a dry
        # run leaves the output directory alone, so Hydra gets a scratch one instead
        sys.argv += [f"hydra.run.dir={Path(tempfile.gettempdir()) / 'dflash-dry-run'}", "hydra/job_logging=none"]
    main()
