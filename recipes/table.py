"""The recipe's table from its evaluation reports: per set the responses, tau (z-lab's
count), the responses that ran to the budget and tau without them, the lossless check,
and decoding tokens/s of this loop against the target alone in the same loop.

    python -m recipes.table runs/smollm2 [--seconds S]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def rows(report: dict) -> list[str]:
    out = []
    for name, r in report["results"].items():
        spec = r["new_tokens"] / r["wall_s"] if r.get("wall_s") else None
        base = r["new_tokens"] / r["baseline_wall_s"] if r.get("baseline_wall_s") else None
        lossless = {None: "-", True: "yes", False: "NO"}[r["lossless"]]
        out.append(f"| {name} | {r['prompts']} | {fmt(r['tau'])} | {r.get('capped', '-')} "
                   f"| {fmt(r.get('tau_uncapped'))} | {lossless} | {fmt(spec, 1)} | {fmt(base, 1)} |")
    return out


def speed_row(r: dict) -> str:
    same = "-" if r["same_as_target"] is None else f"{r['same_as_target']}/{r['prompts']}"
    return f"| {r['mode']} | {r['batch']} | {fmt(r['tokens_per_s'], 1)} | {fmt(r['speedup'])}x | {same} |"


def table(work: Path, seconds: float | None = None) -> str:
    lines = ["| set | responses | tau | capped | tau without capped | lossless | tok/s speculative | tok/s target |",
             "|---|---|---|---|---|---|---|---|"]
    count = None
    for name in ("eval_humaneval.json", "eval_heldout.json"):
        path = work / name
        if path.is_file():
            report = json.loads(path.read_text())
            lines += rows(report)
            count = report.get("tau_count", count)
    heldout = work / "eval_heldout.json"
    speed = json.loads(heldout.read_text()).get("speed") if heldout.is_file() else None
    if speed:
        lines += ["", "| decoding (held-out prompts) | batch | tokens/s | vs the target alone | same as the target |",
                  "|---|---|---|---|---|"]
        lines += [speed_row(r) for r in speed["rows"]]
    notes = [f"tau: {count}" if count else "tau: no report found"]
    summary = work / "prompts" / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        notes.append(f"prompts: {s['train']} for training, {s['heldout']} held out ({s['by_source']}); dropped for a "
                     f"HumanEval function name or 10-token span: {sum(s['dropped_for_overlap'].values())}")
    notes.append("tok/s: this project's decoding loop at the evaluation's batch size, speculative against the target "
                 "alone (greedy); on a GPU the target's decoding forwards replay as CUDA graphs in both, and so does "
                 "the drafter's, the prefill runs eagerly; wall time includes the prefill")
    if seconds is not None:
        notes.append(f"recipe wall time: {seconds / 60:.1f} min")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work")
    ap.add_argument("--seconds", type=float, default=None, help="the recipe's wall time so far")
    args = ap.parse_args(argv)
    text = table(Path(args.work), args.seconds)
    print(text)
    return text


if __name__ == "__main__":
    main()
