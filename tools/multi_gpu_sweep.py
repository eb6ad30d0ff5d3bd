"""The multi-GPU figures in one command: NCCL parity, bundle bandwidth, a target:drafter
ratio sweep with its pipeline efficiency, the public reference configuration, the
layout the plan chooses on 1, 2, 4, ... GPUs, staggered against all-at-once warmup,
peak memory per rank. Everything runs on a random-weight target at a preset's shape
with synthetic data, so nothing is downloaded.

    python tools/multi_gpu_sweep.py --out sweep.json [--stages layouts,parity,ratios,reference,p2p,warmup]
        [--ratios 1,2,3] [--steps 30] [key=value ...]

Run it on one node with two GPUs or more (``NPROC`` GPUs, default all). Each run
goes through ``launch.sh``; the summary (one JSON) holds per run the samples/s
per GPU, the drafter and target wait fractions, warmup times and cache hits,
and each rank's peak memory. Pipeline efficiency is the measured samples/s over
``min(T x target samples/s, D x drafter samples/s)``, the two rates measured by
``dflash.bench`` at the same shapes in the same call (compiled prefill,
reduce-overhead drafter step). Extra ``key=value`` overrides reach every run (a
CPU dry run: tiny ``target.shape.*`` values and ``NPROC=4``). The inductor cache
is shared by every run (``--cache``), so only the first run of a shape compiles.
The layouts stage trains the reference configuration with nothing chosen by hand
(micro-batch and layout as the plan takes them) through ``dflash.bench --train-ranks``
on each rank count, beside the plan's prediction and the rate on one GPU.
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
sys.path.insert(0, str(ROOT))  # runs from a checkout, also where the package is not installed
# every synthetic sample is train.max_len long: one length bucket, one compiled graph (compiled
# however short the run: the sweep measures the compiled step)
COMMON = ["target=qwen3_8b", "target.path=random", "data=synthetic", "train=paper", "train.buckets=null",
          "eval.enabled=false", "wandb.mode=disabled", "compile.enabled=true"]


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


def rates(overrides: list[str], out: Path, env: dict, accumulation: int) -> dict:
    """Samples/s of one target rank (compiled prefill) and one drafter rank
    (reduce-overhead step, the run's accumulation per optimizer step) at these
    shapes, from ``dflash.bench``."""
    command = [sys.executable, "-m", "dflash.bench", "--modes", "reduce-overhead", "--steps", "8",
               "--accumulation", str(accumulation), "--out", str(out), *overrides]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, **env})
    from dflash.run.estimate import bench_rates  # imports torch: not needed for --help

    found = bench_rates(json.loads(out.read_text()))
    return {**found, "target_samples_per_s": round(found["target_samples_per_s"], 3)}


def efficiency(measured: dict, rate: dict, targets: int, drafters: int) -> float:
    bound = min(targets * rate["target_samples_per_s"], drafters * rate["drafter_samples_per_s"])
    return round(measured["samples_per_s"] / bound, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--out", default="sweep.json")
    parser.add_argument("--stages", default="layouts,parity,ratios,reference,p2p,warmup")
    parser.add_argument("--cache", help="TORCHINDUCTOR_CACHE_DIR shared by every run (default: a fresh one)")
    parser.add_argument("--ratios", default="1,2,3", help="target ranks to sweep")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import torch

    nproc = int(os.environ.get("NPROC") or max(1, torch.cuda.device_count()))
    stages, base = args.stages.split(","), COMMON + args.overrides
    report: dict = {"nproc": nproc, "overrides": base}
    work = Path(tempfile.mkdtemp(prefix="dflash-sweep-"))
    cache = {"TORCHINDUCTOR_CACHE_DIR": args.cache or str(work / "inductor")}  # shared: later runs load compiled code

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=1))

    if "layouts" in stages:
        report["layouts"] = {}
        for ranks in sorted({1, nproc, *(2**i for i in range(1, nproc.bit_length()))}):
            out = work / f"layouts_{ranks}.json"
            command = [sys.executable, "-m", "dflash.bench", "--train-ranks", str(ranks), "--steps", str(args.steps),
                       "--out", str(out), *COMMON, "train.num_anchors=256", "train.max_len=768", *args.overrides]
            print("+", " ".join(command), flush=True)
            subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, **cache})
            result = json.loads(out.read_text())
            one = report["layouts"].get("1", result)
            report["layouts"][str(ranks)] = {
                **{k: result[k] for k in ("layout", "micro_batch_size", "samples_per_s", "samples_per_s_per_gpu",
                                          "predicted_per_gpu", "ranks")},
                "times_one_gpu": round(result["samples_per_s"] / one["samples_per_s"], 3),
            }
            save()
    if "parity" in stages:
        report["parity"] = {}
        colocated: dict[int, list[float]] = {}
        for targets in range(1, nproc):
            batch = 2 * (nproc - targets)
            steps = ["train.max_steps=20", f"train.batch_size={batch}", "train.micro_batch_size=1", "train.log_every=1"]
            if batch not in colocated:
                one = run(1, base + steps, work / f"parity_colocated_{batch}", cache)
                colocated[batch] = [m["loss"] for m in one["metrics"]]
            split = run(nproc, base + steps + [f"topology.target_ranks={targets}"], work / f"parity_t{targets}", cache)
            a, b = colocated[batch], [m["loss"] for m in split["metrics"]]
            report["parity"][f"{targets}:{nproc - targets}"] = {
                "colocated": a, "split": b, "max_rel_diff": max(abs(x - y) / abs(x) for x, y in zip(a, b)),
            }
            save()
    if "p2p" in stages:
        subprocess.run([sys.executable, "-m", "dflash.bench", "--p2p", "--out", str(work / "p2p.json"), *base],
                       cwd=ROOT, check=True, env={**os.environ, **cache})
        report["p2p"] = json.loads((work / "p2p.json").read_text())["p2p"]
        save()
    if "ratios" in stages:
        report["rates"] = rates(base, work / "rates.json", cache, accumulation=4)  # batch 4 x D
        report["ratios"] = {}
        for targets in (t for t in map(int, args.ratios.split(",")) if t < nproc):
            batch = 4 * (nproc - targets)
            overrides = base + [f"topology.target_ranks={targets}", f"train.batch_size={batch}",
                                f"train.max_steps={args.steps}", "train.log_every=1"]
            result = throughput(run(nproc, overrides, work / f"ratio_{targets}", cache), nproc, batch)
            result["pipeline_efficiency"] = efficiency(result, report["rates"], targets, nproc - targets)
            report["ratios"][f"{targets}:{nproc - targets}"] = result
            save()
    if "reference" in stages:
        shapes = ["train.num_anchors=256", "train.max_len=768"]
        rate = rates(base + shapes, work / "rates_reference.json", cache, accumulation=4)
        batch = 4 * (nproc - 1)
        overrides = base + shapes + ["topology.target_ranks=1", f"train.batch_size={batch}",
                                     f"train.max_steps={args.steps}", "train.log_every=1"]
        result = throughput(run(nproc, overrides, work / "reference", cache), nproc, batch)
        report["reference"] = {**result, "rates": rate, "pipeline_efficiency": efficiency(result, rate, 1, nproc - 1),
                               "reference_samples_per_s_per_gpu": round(50.1 / 8, 3)}
        save()
    if "warmup" in stages and nproc < 3:
        report["warmup"] = "not run: with one target and one drafter both warm up in the first turn"
    elif "warmup" in stages:
        report["warmup"] = {}
        for name, groups in (("all_at_once", 1), ("staggered", 2)):
            fresh = {"TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor_{name}")}
            overrides = base + ["topology.target_ranks=1", f"compile.warmup_turns={groups}", "train.max_steps=2",
                                f"train.batch_size={nproc - 1}"]
            result = run(nproc, overrides, work / f"warmup_{name}", fresh)
            ranks = result["warmup"]
            report["warmup"][name] = {
                "span_s": round(max(r["ended"] for r in ranks) - min(r["began"] for r in ranks), 1),
                "ranks": [{k: r[k] for k in ("rank", "role", "turn", "wall_s", "fx_cache_hits", "aot_cache_hits")}
                          for r in ranks],
            }
            save()
    save()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
