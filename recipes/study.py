"""The recipe study's table and plot from its variants' directories (recipes/smollm2_study.sh):
per variant tau on HumanEval and on the held-out prompts (z-lab's count), the responses that ran
to the budget, the lossless check and the training time; and ``study.png``, tau of the
evaluations while training against the samples each variant had seen by then.

    python -m recipes.study runs/smollm2/study [--variants ce kl dflash2 sliding]
"""

from __future__ import annotations

import argparse
import json
from itertools import accumulate
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

from dflash.report import run_records  # noqa: E402

WHAT = {
    "ce": "cross-entropy alone, block 16",
    "kl": "with KL against the target's top-32, block 16",
    "dflash2": "DFlash2, block 8",
    "sliding": "4 sliding-window layers (256) + 1 full, block 16",
}


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tau_curve(run_dir: Path) -> tuple[list[int], list[float]]:
    """(samples seen, tau) at each evaluation while training: the samples of every step record
    up to the evaluation's step."""
    steps, evals = run_records(run_dir)
    seen = dict(zip((r["step"] for r in steps), accumulate(r["samples"] for r in steps)))
    points = [(seen[e["step"]], e["eval/tau"]) for e in evals if e["step"] in seen]
    return [p[0] for p in points], [p[1] for p in points]


def scored(path: Path) -> dict | None:
    """The one result of an evaluation report (one set each), or None where it is missing."""
    if not path.is_file():
        return None
    results = json.loads(path.read_text())["results"]
    return next(iter(results.values()))


def row(variant: str, directory: Path) -> str:
    cells = [variant, WHAT.get(variant, "")]
    for name in ("eval_humaneval.json", "eval_heldout.json"):
        r = scored(directory / name)
        lossless = "-" if r is None else {None: "-", True: "yes", False: "NO"}[r["lossless"]]
        cells += ["-", "-", "-", lossless] if r is None else [
            fmt(r["tau"]), f"{r.get('capped', '-')}/{r['prompts']}", fmt(r.get("tau_uncapped")), lossless]
    steps, _ = run_records(directory / "run")
    cells += [str(steps[-1]["step"]), f"{sum(r['samples'] for r in steps):,}",
              fmt(sum(r["samples"] / r["samples_per_s"] for r in steps) / 60, 1)]
    return "| " + " | ".join(cells) + " |"


def plot(study: Path, variants: list[str]) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for variant in variants:
        seen, tau = tau_curve(study / variant / "run")
        ax.plot(seen, tau, marker="o", markersize=3, label=f"{variant}: {WHAT.get(variant, '')}")
    ax.set_xlabel("samples seen")
    ax.set_ylabel("tau, held-out prompts (greedy)")
    ax.set_title("tau while training, one seed, one budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = study / "study.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def table(study: Path, variants: list[str]) -> str:
    lines = ["| variant | what | HumanEval tau | capped | tau without capped | lossless | held-out tau | capped "
             "| tau without capped | lossless | steps | samples | minutes training |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [row(v, study / v) for v in variants]
    counts = {json.loads(p.read_text()).get("tau_count") for v in variants for p in (study / v).glob("eval_*.json")}
    lines += ["", f"tau: {', '.join(sorted(c for c in counts if c)) or 'no report found'}; the held-out column of "
              "the plot is from the evaluations while training (eval.every), the table's from the export",
              f"![tau against samples seen]({plot(study, variants).name})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", type=Path, help="the study directory: one subdirectory per variant")
    parser.add_argument("--variants", nargs="+", default=list(WHAT), help="the variants to show, in order")
    args = parser.parse_args(argv)
    missing = [v for v in args.variants if not (args.study / v / "run" / "metrics.jsonl").is_file()]
    if missing:
        raise SystemExit(f"no trained run for {', '.join(missing)} under {args.study}")
    print(table(args.study, args.variants))


if __name__ == "__main__":
    main()
