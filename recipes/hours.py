"""Training hours and GPU-hours from a dry run's plan, before anything starts.

    python -m dflash.train ... dry_run=true estimate.nproc=8 | python -m recipes.hours --data prompts.jsonl --epochs 6 --gpus 8

The plan gives samples/s for the whole run (its "expected:" line); the data gives the
samples per epoch (every record of the prompt set, each regenerated into one sample).
Regeneration and evaluation are not counted: they depend on reply lengths.
"""

from __future__ import annotations

import argparse
import re
import sys

from dflash.data.records import iter_records

RATE = re.compile(r"expected: .*: ([0-9.]+) (?:samples|rows)/s")


def plan_rate(plan: str) -> float | None:
    """The run's samples/s from a dry run's output, ``None`` when the plan gives none
    (no utilisation is known for the device, e.g. the CPU)."""
    match = RATE.search(plan)
    return float(match.group(1)) if match else None


def count_samples(path: str) -> int:
    """Records of the prompt set, in any format training reads."""
    return sum(1 for _ in iter_records(path, key="PROMPTS"))


def describe(samples: int, epochs: float, gpus: int, rate: float | None, bound: bool = False) -> str:
    """One line: hours and GPU-hours, or why there are none; ``bound``: ``samples`` is an
    upper bound (the prompts are not built yet), so are the hours."""
    count = f"at most {samples}" if bound else str(samples)
    if rate is None:
        return f"training: {count} samples x {epochs:g} epochs; the plan gives no samples/s on this device, so no hours"
    hours = samples * epochs / rate / 3600
    return (f"training: {count} samples x {epochs:g} epochs at {rate:g} samples/s (the plan's estimate) = "
            f"{'at most ' if bound else ''}{hours:.2f} h on {gpus} GPU(s), {hours * max(gpus, 1):.2f} GPU-hours")


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    given = ap.add_mutually_exclusive_group(required=True)
    given.add_argument("--data", help="the prompt set that will be regenerated and trained on")
    given.add_argument("--samples", type=int, help="at most this many samples per epoch (before the prompts exist)")
    ap.add_argument("--per-prompt", type=int, default=1, help="--data: samples each prompt becomes (regenerated so often)")
    ap.add_argument("--epochs", type=float, default=6.0, help="train.epochs (the paper's: 6)")
    ap.add_argument("--gpus", type=int, default=1)
    args = ap.parse_args(argv)
    samples = count_samples(args.data) * args.per_prompt if args.data else args.samples
    line = describe(samples, args.epochs, args.gpus, plan_rate(sys.stdin.read()), bound=args.data is None)
    print(line)
    return line


if __name__ == "__main__":
    main()
