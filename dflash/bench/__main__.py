"""``python -m dflash.bench``: one mode per call (see :mod:`dflash.bench`)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import dflash.bench
from dflash.bench.decoding import format_decode, parse_decode, run_decode
from dflash.bench.p2p import format_p2p, run_p2p
from dflash.bench.roles import MODES, format_rows, run_bench
from dflash.bench.timing import bench_job
from dflash.bench.training import format_training, run_training
from dflash.bench.warmup import format_warmup, run_warmup


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash.bench", description=dflash.bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. target=qwen3_8b train=paper")
    parser.add_argument("--steps", type=int, default=10, help="timed calls per row")
    parser.add_argument("--modes", default="eager,compile,reduce-overhead", help="drafter modes, comma-separated")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak (H200 measured: 790)")
    parser.add_argument("--warmup-procs", type=int, default=0, help="time the warmup of N processes instead")
    parser.add_argument("--p2p", action="store_true", help="measure bundle bandwidth between two local ranks instead")
    parser.add_argument("--train-ranks", type=int, default=0,
                        help="train on N local ranks under torchrun instead; --steps optimizer steps are timed")
    parser.add_argument("--profile", choices=[*MODES, "colocated", "decode"],
                        help="also profile the drafter step of this mode, the colocated step, or (with --decode) "
                             "a batch of decoding")
    parser.add_argument("--accumulation", type=int, default=1,
                        help="micro-batches per optimizer step in the drafter and colocated rows")
    parser.add_argument("--decode", metavar="NxM", help="time decoding N prompts x M new tokens instead, e.g. 64x256")
    parser.add_argument("--batch-one", type=int, default=2, help="with --decode: prompts also decoded at batch 1")
    parser.add_argument("--checkpoint", metavar="DIR", help="also time a checkpoint save and load under DIR")
    parser.add_argument("--out", default="bench.json")
    args = parser.parse_intermixed_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    overrides = ["wandb.mode=disabled", *args.overrides]
    if args.decode:
        report = run_decode(bench_job(overrides), parse_decode(args.decode), args.batch_one,
                            32 if args.profile == "decode" else 0)
        text = format_decode(report)
    elif args.p2p:
        report = run_p2p(overrides, args.steps)
        text = format_p2p(report)
    elif args.train_ranks:
        report = run_training(overrides, args.train_ranks, args.steps)
        text = format_training(report)
    elif args.warmup_procs:
        report = run_warmup(overrides, args.warmup_procs)
        text = format_warmup(report)
    else:
        job = bench_job(overrides + ["train.buckets=null"])
        report = run_bench(job, args.steps, args.peak_tflops, args.modes.split(","), args.profile, args.accumulation,
                           args.checkpoint)
        text = format_rows(report)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(text)
    if report.get("profile"):
        what = {"colocated": "colocated step, over 3 steps", "decode": "decoding, one batch x 32 tokens"}.get(
            args.profile, f"drafter step, {args.profile}, over 3 steps")
        print(f"{what}, profiled:\n{report['profile']}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
