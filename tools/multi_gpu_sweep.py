"""The multi-GPU figures in one command: NCCL parity, bundle bandwidth, a target:drafter
ratio sweep, the public reference configuration, staggered against all-at-once
warmup, peak memory per rank. Everything runs on a random-weight target at a
preset's shape with synthetic data, so nothing is downloaded.

    python tools/multi_gpu_sweep.py --out sweep.json [--stages parity,p2p,ratios,reference,warmup]
        [--ratios 1,2,3] [--steps 30] [key=value ...]

Run it on one node with two GPUs or more (``NPROC`` GPUs, default all). Each run
goes through ``launch.sh``; the summary (one JSON) holds per run the samples/s
per GPU, the drafter and target wait fractions, warmup times and cache hits,
and each rank's peak memory. Extra ``key=value`` overrides reach every run (a
CPU dry run: tiny ``target.shape.*`` values and ``NPROC=4``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# every synthetic sample is train.max_len long: one length bucket, one compiled graph
COMMON = ["target=qwen3_8b", "target.path=random", "data=synthetic", "train=paper", "train.buckets=null",
          "eval.enabled=false", "wandb.mode=disabled"]


def run(nproc: int, overrides: list[str], output_dir: Path, env: dict | None = None) -> dict:
    """One training run through launch.sh; its metrics, warmup and per-rank summaries."""
    command = ["./launch.sh", *overrides, f"output_dir={output_dir}"]
    if nproc == 1:
        command = [sys.executable, "-m", "dflash.train", *overrides, f"output_dir={output_dir}"]
    print("+", f"NPROC={nproc}", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "NPROC": str(nproc), **(env or {})})
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    read = lambda name: json.loads((output_dir / name).read_text()) if (output_dir / name).is_file() else None  # noqa: E731
    return {"metrics": metrics, "warmup": read("warmup.json"), "ranks": read("ranks.json")}


def throughput(result: dict, nproc: int, batch_size: int) -> dict:
    """Steady-state figures: the second half of the logged steps."""
    tail = result["metrics"][len(result["metrics"]) // 2 :]
    samples_per_s = sum(m["samples_per_s"] for m in tail) / len(tail)
    step_s = batch_size / samples_per_s
    out = {"samples_per_s": round(samples_per_s, 2), "samples_per_s_per_gpu": round(samples_per_s / nproc, 3)}
    if "drafter_wait_s" in tail[0]:
        out["drafter_wait_frac"] = round(sum(m["drafter_wait_s"] for m in tail) / len(tail) / step_s, 3)
        out["target_wait_frac"] = round(sum(m["target_wait_s"] for m in tail) / len(tail) / step_s, 3)
    if result["ranks"]:
        out["peak_gib"] = {f"{r['rank']}:{r['role']}": r["peak_gib"] for r in result["ranks"]}
    if result["warmup"]:
        out["warmup_s"] = {f"{r['rank']}:{r['role']}": r["wall_s"] for r in result["warmup"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", default="sweep.json")
    parser.add_argument("--stages", default="parity,p2p,ratios,reference,warmup")
    parser.add_argument("--ratios", default="1,2,3", help="target ranks to sweep")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import torch

    nproc = int(os.environ.get("NPROC") or max(1, torch.cuda.device_count()))
    stages, base = args.stages.split(","), COMMON + args.overrides
    report: dict = {"nproc": nproc, "overrides": base}
    work = Path(tempfile.mkdtemp(prefix="dflash-sweep-"))
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}  # shared: later runs load compiled code

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=1))

    if "parity" in stages:
        steps = ["train.max_steps=20", "train.batch_size=2", "train.micro_batch_size=1", "train.log_every=1"]
        one = run(1, base + steps, work / "parity_colocated", cache)
        two = run(2, base + steps + ["topology.target_ranks=1"], work / "parity_t1d1", cache)
        a, b = [m["loss"] for m in one["metrics"]], [m["loss"] for m in two["metrics"]]
        report["parity"] = {"colocated": a, "t1d1": b, "max_rel_diff": max(abs(x - y) / abs(x) for x, y in zip(a, b))}
        save()
    if "p2p" in stages:
        subprocess.run([sys.executable, "-m", "dflash.bench", "--p2p", "--out", str(work / "p2p.json"), *base],
                       cwd=ROOT, check=True, env={**os.environ, **cache})
        report["p2p"] = json.loads((work / "p2p.json").read_text())["p2p"]
        save()
    if "ratios" in stages:
        report["ratios"] = {}
        for targets in map(int, args.ratios.split(",")):
            batch = 4 * (nproc - targets)
            overrides = base + [f"topology.target_ranks={targets}", f"train.batch_size={batch}",
                                f"train.max_steps={args.steps}", "train.log_every=1"]
            result = run(nproc, overrides, work / f"ratio_{targets}", cache)
            report["ratios"][f"{targets}:{nproc - targets}"] = throughput(result, nproc, batch)
            save()
    if "reference" in stages:
        batch = 4 * (nproc - 1)
        overrides = base + ["topology.target_ranks=1", "train.num_anchors=256", "train.max_len=768",
                            f"train.batch_size={batch}", f"train.max_steps={args.steps}", "train.log_every=1"]
        result = run(nproc, overrides, work / "reference", cache)
        report["reference"] = {**throughput(result, nproc, batch), "reference_samples_per_s": 50.1}
        save()
    if "warmup" in stages:
        report["warmup"] = {}
        for name, groups in (("all_at_once", 1), ("staggered", 2)):
            fresh = {"TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor_{name}")}
            overrides = base + ["topology.target_ranks=1", f"compile.warmup_groups={groups}", "train.max_steps=2",
                                f"train.batch_size={nproc - 1}"]
            result = run(nproc, overrides, work / f"warmup_{name}", fresh)
            ranks = result["warmup"]
            report["warmup"][name] = {
                "span_s": round(max(r["ended"] for r in ranks) - min(r["began"] for r in ranks), 1),
                "ranks": [{k: r[k] for k in ("rank", "role", "group", "wall_s", "fx_cache_hits", "aot_cache_hits")}
                          for r in ranks],
            }
            save()
    save()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
