"""``--train-ranks N``: ``dflash.train`` under torchrun on N local ranks, the layout the plan
takes for them, and the samples/s per GPU of its last steps beside the plan's prediction."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dflash.run.build import (
    build_job,
)
from dflash.run.config import compose_config

log = logging.getLogger("dflash.bench")

# optimizer steps left out before the timed ones (the first step after the compile warmup still
# grows the allocator's pools and records CUDA graphs of the later buckets)
UNTIMED_STEPS = 2


def run_training(overrides: list[str], ranks: int, steps: int) -> dict:
    """``ranks`` local processes train :data:`UNTIMED_STEPS` + ``steps`` optimizer steps under
    torchrun (``dflash.train`` as a user launches it, its layout as the plan chooses or the
    overrides ask), then the samples/s of the last ``steps`` from the metrics they logged,
    per GPU, beside the plan's prediction for the same layout. On a GPU compiled unless the
    overrides say otherwise: a run this short would train eager under ``compile.enabled=auto``,
    and the plan's rates are the compiled step's."""
    compiled = torch.cuda.is_available() and not any(o.startswith("compile.enabled=") for o in overrides)
    run = [*(["compile.enabled=true"] if compiled else []), *overrides, f"train.max_steps={UNTIMED_STEPS + steps}",
           "train.log_every=1", "eval.enabled=false"]
    job = build_job(compose_config(run), ranks)
    with tempfile.TemporaryDirectory() as out:
        # as launch.sh starts a node: each rank sees its own GPU as cuda:0, NVLink multicast off
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   "--virtual-local-rank", "-m", "dflash.train", *run, f"output_dir={out}"]
        log.info("%s", " ".join(command))
        subprocess.run(command, check=True, env={"NCCL_NVLS_ENABLE": "0", **os.environ})
        records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
        ranks_file = Path(out, "ranks.json")
        summaries = json.loads(ranks_file.read_text()) if ranks_file.is_file() else []
    timed = [r for r in records if "loss" in r][UNTIMED_STEPS:]
    if len(timed) < steps:
        raise RuntimeError(f"the run logged {len(timed) + UNTIMED_STEPS} steps, {UNTIMED_STEPS + steps} asked: too "
                           "few samples for that many steps? (data.num_samples with data=synthetic)")
    samples = sum(r["samples"] for r in timed)
    rate = samples / sum(r["samples"] / r["samples_per_s"] for r in timed)
    layout = job.layout.taken
    predicted = layout.samples_per_s / ranks if torch.cuda.is_available() else math.nan  # the rates are a GPU's
    return {
        "train_ranks": ranks,
        "overrides": overrides,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "layout": layout.name if ranks > 1 else "colocated, one process",
        "micro_batch_size": job.plan.micro_batch_size,
        "steps": len(timed),
        "samples_per_step": samples // len(timed),
        "samples_per_s": round(rate, 3),
        "samples_per_s_per_gpu": round(rate / ranks, 3),
        "predicted_per_gpu": None if math.isnan(predicted) else round(predicted, 3),
        "rates_from": layout.cost.rates_from,
        "step_samples_per_s": [round(r["samples_per_s"], 3) for r in timed],
        "ranks": [{k: r.get(k) for k in ("rank", "role", "steps", "peak_gib")} for r in summaries],
    }


def format_training(report: dict) -> str:
    predicted = report["predicted_per_gpu"]
    versus = (f", predicted {predicted} ({report['rates_from']}): {report['samples_per_s_per_gpu'] / predicted:.2f}x"
              if predicted else ", no prediction (the plan's rates are for GPUs)")
    peaks = ", ".join(f"{r['role']} {r['peak_gib']}" for r in report["ranks"] if r["peak_gib"] is not None)
    return (f"training on {report['train_ranks']} rank(s) of {report['device']} (torch {report['torch']}), "
            f"{report['layout']}, micro-batch {report['micro_batch_size']}: {report['samples_per_s']} samples/s over "
            f"{report['steps']} steps of {report['samples_per_step']}, {report['samples_per_s_per_gpu']} per GPU"
            f"{versus}\n  per step: {report['step_samples_per_s']}" + (f"\n  peak GiB: {peaks}" if peaks else ""))
