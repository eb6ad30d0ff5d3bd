"""Pictures of a run: ``python -m dflash.report RUN_DIR``.

Reads what a run leaves in its output directory (``metrics.jsonl``, and where
present ``eval.json``, ``ranks.json``, ``warmup.json``) and writes PNG plots
next to it under ``report/``, with a one-page ``report.md`` that links them:

- ``loss.png``: loss and learning rate over steps;
- ``acceptance.png``: simulated acceptance ``tau_sim`` against the real
  speculative-decoding ``tau`` of the export;
- ``positions.png``: per-position accuracy ``acc_1..acc_{B-1}`` at a few points in
  training (where a drafter's acceptance is lost, position by position);
- ``histogram.png``: how many tokens each drafting cycle of the eval accepted;
- ``throughput.png``: samples/s, and the fractions of each step the drafters
  and the targets spent waiting on each other;
- ``health.png``: recompiles and CUDA-graph skips after warmup, and peak memory per rank.

Plots need no display (matplotlib's Agg backend).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend
from omegaconf import OmegaConf  # noqa: E402

SNAPSHOTS = 4  # training points shown in the per-position plot


def _read(run_dir: Path, name: str):
    path = run_dir / name
    return json.loads(path.read_text()) if path.is_file() else None


def run_records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The training steps and the evaluations while training (``eval.every``), each by step."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: not a dflash output directory")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = sorted((r for r in records if "loss" in r), key=lambda r: r["step"])
    evals = sorted((r for r in records if "eval/tau" in r), key=lambda r: r["step"])
    if not steps:
        raise ValueError(f"{path} holds no step yet")
    return steps, evals


def _eval_results(report: dict | None) -> list[tuple[str, dict]]:
    return [] if report is None else list(report["results"].items())


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(records: list[dict], out: Path) -> Path:
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [r["loss"] for r in records], color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    lr = ax.twinx()
    lr.plot(steps, [r["lr"] for r in records], color="tab:gray", linestyle="--")
    lr.set_ylabel("learning rate", color="tab:gray")
    ax.set_title("loss and learning rate")
    return _save(fig, out / "loss.png")


def plot_acceptance(records: list[dict], evals: list[dict], evaluation: dict | None, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([r["step"] for r in records], [r["tau_sim"] for r in records], label="tau_sim (training)")
    periodic = [r for r in evals if r["eval/tau"] is not None]
    if periodic:
        ax.plot([r["step"] for r in periodic], [r["eval/tau"] for r in periodic], "o-", label="tau (speculative decoding)")
    for name, result in _eval_results(evaluation):
        if result["tau"] is not None:
            ax.scatter([records[-1]["step"]], [result["tau"]], marker="*", s=140, zorder=3,
                       label=f"tau of the export, {name}")
    ax.set_xlabel("step")
    ax.set_ylabel("accepted tokens per cycle")
    ax.set_title("simulated against real acceptance")
    ax.legend(loc="upper left", fontsize=8)
    return _save(fig, out / "acceptance.png")


def plot_positions(records: list[dict], out: Path) -> Path:
    positions = sorted(int(k.split("_")[1]) for k in records[-1] if k.startswith("acc_"))
    picks = sorted({records[round(i * (len(records) - 1) / (SNAPSHOTS - 1))]["step"] for i in range(SNAPSHOTS)})
    by_step = {r["step"]: r for r in records}
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for step in picks:
        ax.plot(positions, [by_step[step][f"acc_{k}"] for k in positions], "o-", label=f"step {step}")
    ax.set_xlabel("block position k")
    ax.set_ylabel("acc_k")
    ax.set_ylim(0, 1)
    ax.set_title("per-position accuracy")
    ax.legend(fontsize=8)
    return _save(fig, out / "positions.png")


def plot_histogram(evaluation: dict | None, out: Path) -> Path | None:
    results = _eval_results(evaluation)
    if not results:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(results)
    for i, (name, result) in enumerate(results):
        lengths = sorted(int(k) for k in result["histogram"])
        counts = [result["histogram"][str(k)] for k in lengths]
        ax.bar([k + i * width for k in lengths], counts, width=width, label=f"{name} (tau {result['tau']})")
    ax.set_xlabel("tokens accepted in a drafting cycle (bonus included)")
    ax.set_ylabel("cycles")
    ax.set_title("acceptance histogram of the export")
    ax.legend(fontsize=8)
    return _save(fig, out / "histogram.png")


def plot_throughput(records: list[dict], batch_size: int | None, out: Path) -> Path:
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [r["samples_per_s"] for r in records], color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s", color="tab:green")
    if "drafter_wait_s" in records[-1] and batch_size:
        wait = ax.twinx()
        step_s = [batch_size / r["samples_per_s"] if r["samples_per_s"] else None for r in records]
        for key, color in (("drafter_wait_s", "tab:red"), ("target_wait_s", "tab:purple")):
            fractions = [r[key] / s if s else 0.0 for r, s in zip(records, step_s)]
            wait.plot(steps, fractions, color=color, linestyle="--", label=key.replace("_s", " fraction"))
        wait.set_ylabel("fraction of the step spent waiting")
        wait.set_ylim(0, 1)
        wait.legend(loc="upper right", fontsize=8)
    ax.set_title("throughput and waiting")
    return _save(fig, out / "throughput.png")


def plot_health(records: list[dict], ranks: list[dict] | None, out: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    steps = [r["step"] for r in records]
    for key in ("recompiles", "cudagraph_skips", "cudagraph_rerecords"):
        left.plot(steps, [r.get(key, 0) for r in records], label=key)
    left.set_xlabel("step")
    left.set_title("after warmup (should stay 0)")
    left.legend(fontsize=8)
    if ranks and any(r.get("peak_gib") is not None for r in ranks):
        labels = [f"{r['rank']}\n{r['role']}" for r in ranks]
        right.bar(labels, [r.get("peak_gib") or 0.0 for r in ranks])
        right.set_ylabel("peak GiB")
        right.set_title("peak memory per rank")
    else:
        right.text(0.5, 0.5, "no GPU memory recorded\n(a CPU or colocated run)", ha="center", va="center")
        right.set_axis_off()
    return _save(fig, out / "health.png")


def write_report(run_dir: str | Path) -> Path:
    """Every plot this run's files allow, and ``report/report.md``; returns that path."""
    run_dir = Path(run_dir)
    records, evals = run_records(run_dir)
    evaluation, ranks = _read(run_dir, "eval.json"), _read(run_dir, "ranks.json")
    config = run_dir / "config.yaml"
    batch_size = OmegaConf.load(config).train.batch_size if config.is_file() else None
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    plots = {
        "Loss and learning rate": plot_loss(records, out),
        "Simulated against real acceptance": plot_acceptance(records, evals, evaluation, out),
        "Per-position accuracy": plot_positions(records, out),
        "Acceptance histogram of the export": plot_histogram(evaluation, out),
        "Throughput and waiting": plot_throughput(records, batch_size, out),
        "Recompiles and memory": plot_health(records, ranks, out),
    }
    last = records[-1]
    lines = [
        f"# Run report: {run_dir.name}",
        "",
        f"{last['step']} steps; final loss {last['loss']:.4f}, tau_sim {last['tau_sim']:.2f}, "
        f"{last['samples_per_s']:.1f} samples/s.",
    ]
    if evals:
        taus = ", ".join(f"{r['eval/tau']:.2f} at step {r['step']}" for r in evals if r["eval/tau"] is not None)
        lines.append(f"Speculative decoding while training: tau {taus}.")
    for name, result in _eval_results(evaluation):
        lossless = {None: "not checked", True: "lossless", False: "NOT lossless"}[result["lossless"]]
        lines.append(f"Speculative decoding with the export on `{name}`: tau {result['tau']}, {lossless}.")
    for title, path in plots.items():
        if path is not None:
            lines += ["", f"## {title}", "", f"![{title}]({path.name})"]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a dflash output directory (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    print(f"wrote {write_report(args.run_dir)}")


if __name__ == "__main__":
    main()
