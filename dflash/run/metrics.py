"""Metrics: ``metrics.jsonl`` in the output directory, W&B, and a progress line.

Only the metrics rank writes (the first drafter rank; colocated: rank 0).
Per-slot accuracies ``acc_k`` and ``tau_sim`` are derived here from the step's
sums so every sink sees the same numbers.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import logging
import time
import uuid
from pathlib import Path

import torch

from dflash.objective.loss import tau_sim

log = logging.getLogger(__name__)


def wandb_run_id(output_dir: Path, start_step: int) -> str:
    """The W&B run id of this output directory: a resumed run continues the run it
    started as (its charts go on where they stopped), a fresh one gets a new id."""
    path = output_dir / "wandb_run_id"
    if start_step > 0 and path.is_file():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id + "\n")
    return run_id


def require_wandb(mode: str) -> None:
    """Refuse at start, on every rank, a W&B mode whose package is missing: the
    metrics rank first imports it after the compile warmup, minutes into a run."""
    if mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ValueError(f"wandb.mode={mode} needs the wandb package: pip install wandb, or set wandb.mode=disabled")


class MetricsLogger:
    """The metrics rank's sinks for one run: ``metrics.jsonl`` (cut back to the resume
    step on a restart), the W&B run (resumed under a stable id) and the progress line.
    On other ranks (``enabled=False``) every call does nothing."""

    def __init__(self, output_dir: Path, wandb_cfg: dict, run_config: dict, start_step: int, enabled: bool = True):
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.run = None
        if enabled:
            self._keep_until(start_step)
        if enabled and wandb_cfg["mode"] != "disabled":
            import wandb

            self.run = wandb.init(
                project=wandb_cfg["project"],
                name=wandb_cfg.get("name"),
                mode=wandb_cfg["mode"],
                dir=str(output_dir),
                config=run_config,
                id=wandb_run_id(output_dir, start_step),
                resume="allow",
            )
            # evaluations come back after later steps were logged: they get their own x-axis
            self.run.define_metric("eval/step")
            self.run.define_metric("eval/*", step_metric="eval/step")
        self.begin()
        self._start_step = start_step
        self._samples = self._tokens = 0
        self._tau_sim: dict[int, float] = {}
        self._acc: list[float] = []

    def begin(self) -> None:
        """Start the clock of samples/s and the ETA when training starts: the logger is
        opened before the compile warmup (:func:`dflash.run.build.build_drafter_side`)."""
        self._last = self._began = time.perf_counter()

    def _keep_until(self, step: int) -> None:
        """A fresh run starts an empty file; a resumed one drops records past its
        checkpoint, which a crash may have left, so every step appears once. A data
        record of an earlier start at this same step goes too: this start writes its own."""
        lines = self.path.read_text().splitlines() if self.path.is_file() else []
        records = [json.loads(line) for line in lines]
        kept = [line for line, r in zip(lines, records)
                if r["step"] < step or (r["step"] == step and not any(k.startswith("data/") for k in r))]
        self.path.write_text("".join(line + "\n" for line in kept))

    def count(self, m: dict) -> None:
        """Every step's samples and tokens, so throughput covers the whole logging interval."""
        self._samples += m["samples"]
        self._tokens += m["tokens"]

    def log_step(self, step: int, total_steps: int, m: dict, extra: dict | None = None) -> dict:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        samples, tokens, self._samples, self._tokens = self._samples, self._tokens, 0, 0
        acc: torch.Tensor = m["acc"]
        record = {
            "step": step,
            "loss": m["loss"],
            "tau_sim": tau_sim(acc),
            "lr": m["lr"],
            "grad_norm": m["grad_norm"],
            "samples": samples,  # since the last record: rows, or with packing the samples packed into them
            "samples_per_s": samples / elapsed,
            "tokens_per_s": tokens / elapsed,
            **{f"acc_{k}": float(a) for k, a in enumerate(acc.tolist()) if k >= 1},
            **(extra or {}),
        }
        self._tau_sim[step] = record["tau_sim"]
        self._acc = [record[f"acc_{k}"] for k in range(1, len(acc))]
        if self.enabled:
            self._append(record)
            if self.run is not None:
                self.run.log(record, step=step)
            per_step = (now - self._began) / max(1, step - self._start_step)
            eta = datetime.timedelta(seconds=round(per_step * (total_steps - step)))
            log.info(
                "step %d/%d loss %.4f tau_sim %.3f acc_1 %.3f lr %.2e %.1f samples/s ETA %s",
                step, total_steps, record["loss"], record["tau_sim"], record.get("acc_1", 0.0), record["lr"],
                record["samples_per_s"], eta,
            )
        return record

    def log_data(self, summary: dict) -> None:
        """What the data held at this start: trainable samples and every skip by reason,
        with the first of their ``file:line`` locations."""
        record = {"step": self._start_step, **{f"data/{k}": v for k, v in summary.items()}}
        if not self.enabled:
            return
        self._append(record)
        if self.run is not None:
            self.run.summary.update({"data/samples": summary["samples"],
                                     **{f"data/skipped/{k}": n for k, n in summary["skipped"].items()}})

    def log_eval(self, record: dict) -> None:
        """A speculative-decoding evaluation (:mod:`dflash.decode.live`) beside the
        ``tau_sim`` of its step; on W&B also the acceptance histogram and the latest
        per-position training acceptance as bar charts."""
        record = {**record, "eval/tau_sim": self._tau_sim.get(record["step"])}
        if not self.enabled:
            return
        self._append(record)
        log.info("step %d: speculative decoding tau %s (tau_sim %s), lossless %s, %.1f s", record["step"],
                 _rounded(record["eval/tau"]), _rounded(record["eval/tau_sim"]), _lossless(record), record["eval/s"])
        if self.run is not None:
            import wandb

            hist = [[int(k.removeprefix("eval/hist_")), n] for k, n in record.items() if k.startswith("eval/hist_")]
            charts = {
                "eval/histogram": wandb.plot.bar(wandb.Table(data=hist, columns=["accepted", "cycles"]), "accepted",
                                                 "cycles", title="Tokens accepted per drafting cycle"),
                "acc_by_position": wandb.plot.bar(
                    wandb.Table(data=[[k, a] for k, a in enumerate(self._acc, 1)], columns=["position", "acceptance"]),
                    "position", "acceptance", title="Training acceptance by block position"),
            }
            self.run.log({**{k: v for k, v in record.items() if k != "step"}, "eval/step": record["step"], **charts})

    def _append(self, record: dict) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def close(self, summary: dict | None = None) -> None:
        if self.run is not None:
            if summary:
                self.run.summary.update(summary)
            self.run.finish()


def _rounded(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _lossless(record: dict) -> str:
    """``yes``, or how many prompts departed from plain greedy and the largest margin."""
    if record["eval/lossless"] is None:
        return "-"
    if record["eval/lossless"]:
        return "yes"
    return (f"NO ({record['eval/divergent_prompts']} prompts depart from plain greedy; the target's logit margin "
            f"there is at most {record['eval/divergence_margin']:.3g})")
