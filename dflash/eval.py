"""Score a drafter with real speculative decoding on prompt sets or the public benchmarks.

    python -m dflash.eval --drafter outputs/demo/export [--data name=file.jsonl ...]
    python -m dflash.eval --target /models/Qwen3-8B --drafter DIR --sets gsm8k,math500,humaneval,mbpp,mt-bench
    python -m dflash.eval --compare ours/eval.json released/eval.json

Prompts are decoded ``--batch-size`` at a time against the HF target, each row with its
own acceptance (:mod:`dflash.decode.batch`), greedy (lossless-checked) and sampled;
:mod:`dflash.decode.evaluate` runs the decoding and writes the report,
:mod:`dflash.decode.public_sets` the public sets built as z-lab's harness builds them.
``--drafter`` takes any drafter directory in the z-lab layout: this project's export or
a released, SpecForge or other checkpoint; one made for another target, or with config
fields the decoding would ignore, is refused with the reason.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from dflash.data import template
from dflash.decode.baseline import GreedyBaselines
from dflash.decode.evaluate import (
    BASELINE_FILE,
    encode_prompt,
    evaluate_datasets,
    format_table,
    load_prompts,
)
from dflash.decode.public_sets import (
    HarnessSettings,
    compare_table,
    conversations,
    evaluate_sets,
    harness_prompt_ids,
    harness_record,
    harness_stop_ids,
    parse_sets,
)
from dflash.decode.speculative import TAU_COUNT, DecodeSettings
from dflash.decode.speed import format_speed, measure_speed
from dflash.model.drafter import TargetHead
from dflash.model.export import load_export
from dflash.model.target import TargetSource


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dflash.eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="demo", help="local HF model directory, or 'demo'")
    ap.add_argument("--drafter", help="drafter directory in the z-lab layout (config.json + model.safetensors)")
    ap.add_argument("--data", nargs="+", default=["demo=demo_heldout"], help="name=path.jsonl entries")
    ap.add_argument("--sets", default=None, metavar="SETS",
                    help="public sets instead of --data, comma-separated: gsm8k,math500,humaneval,mbpp,mt-bench; "
                    "name=path reads that set's rows from a local file in its schema")
    ap.add_argument("--sets-dir", default=None, help="read each set of --sets from <dir>/<name>.jsonl")
    ap.add_argument("--max-samples", type=positive, default=None,
                    help="--sets: rows kept per set after the harness's seeded shuffle (default: all)")
    ap.add_argument("--sample-seed", type=int, default=0, help="--sets: the shuffle's seed (the harness's is 0)")
    ap.add_argument("--enable-thinking", action="store_true", help="--sets: render prompts with thinking on")
    ap.add_argument("--max-prompts", type=positive, default=64)
    ap.add_argument("--max-new-tokens", type=positive, default=None, help="default 256, or 2048 with --sets")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    ap.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=positive, default=DecodeSettings.batch_size,
                    help="prompts decoded at once (1: one at a time; default 64 on a GPU, 32 on the CPU); tokens, tau "
                    "and the histogram do not depend on it "
                    "beyond the rounding of other matrix shapes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"],
        help="target and drafter dtype; a 16-token verify and a 1-token step round differently, "
        "which in bf16 can flip near-tied argmaxes and so 'lossless'; float32 keeps that far below logit gaps",
    )
    ap.add_argument("--speed", type=positive, default=None, metavar="N",
                    help="also time N prompts of the first set (--data or --sets): the target alone, speculative decoding and "
                    "transformers' prompt lookup, tokens/s at --speed-batch (the report's 'speed')")
    ap.add_argument("--speed-batch", type=positive, nargs="+", default=[1, 16])
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--chat-template-kwargs", type=json.loads, default={}, metavar="JSON",
                    help='chat template arguments as in training\'s data.chat_template_kwargs, e.g. \'{"enable_thinking": false}\'')
    ap.add_argument("--out", default=None, help="report path; default <output_dir>/eval.json next to the export")
    ap.add_argument("--compare", nargs=2, default=None, metavar=("OURS", "RELEASED"),
                    help="print (and with --out write) one table of two --sets reports instead of evaluating")
    args = ap.parse_args(argv)
    if args.compare is None and args.drafter is None:
        ap.error("--drafter is required (or --compare)")
    if args.sets is not None and len(args.temperature) != 1:
        ap.error("--sets takes one --temperature, as the harness")
    return args


def compare(args: argparse.Namespace) -> str:
    """The table of two benchmark reports (set, tau ours, tau released, lossless)."""
    ours, released = (json.loads(Path(p).read_text()) for p in args.compare)
    table = compare_table(ours, released)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return table


def score_sets(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, out: Path) -> dict:
    """``--sets``: the public sets as z-lab's harness builds them; the report is
    ``eval.json``'s with the harness settings it was measured under."""
    sets = parse_sets(args.sets, args.sets_dir)
    drafter = load_export(args.drafter, device, dtype)  # a drafter this decoding cannot run fails before the target
    settings = HarnessSettings(max_new_tokens=args.max_new_tokens or 2048, temperature=args.temperature[0],
                               enable_thinking=args.enable_thinking, max_samples=args.max_samples,
                               sample_seed=args.sample_seed, seed=args.seed, block_size=args.block_size,
                               batch_size=args.batch_size)
    target_model, tokenizer = TargetSource(args.target, args.trust_remote_code).load(device, dtype)
    head = TargetHead.of(target_model)
    results = evaluate_sets(target_model, tokenizer, drafter, head, sets, settings,
                            GreedyBaselines(out.with_name(BASELINE_FILE)))
    taus = [r["tau"] for r in results.values() if r["tau"] is not None]
    greedy = [r["lossless"] for r in results.values() if r["lossless"] is not None]
    report = {
        "target": args.target, "drafter": str(args.drafter),
        "block_size": args.block_size or drafter.config.block_size, "tau_count": TAU_COUNT,
        "tau": sum(taus) / len(taus) if taus else None, "lossless": all(greedy) if greedy else None,
        "harness": harness_record(settings), "results": results,
    }
    if args.speed:  # the first set's first turns, as the harness renders them and stops
        name, source = next(iter(sets.items()))
        turns = conversations(name, source, settings)[: args.speed]
        ids = [harness_prompt_ids(tokenizer, [{"role": "user", "content": t[0]}], settings.enable_thinking).to(device)
               for t in turns]
        report["speed"] = measure_speed(target_model, drafter, head, ids, max_new_tokens=settings.max_new_tokens,
                                        eos_ids=harness_stop_ids(tokenizer), batch_sizes=args.speed_batch)
        print(format_speed(report["speed"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> dict | str:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.compare:
        table = compare(args)
        print(table)
        return table
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    out = Path(args.out) if args.out else Path(args.drafter).resolve().parent / "eval.json"
    if args.sets is not None:
        report = score_sets(args, device, dtype, out)
    else:
        report = data(args, device, dtype, out)
    print(format_table(report))
    print(f"lossless: {report['lossless']}  report: {out}")
    return report


def data(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, out: Path) -> dict:
    """``--data``: local prompt sets in any format training reads, rendered as training does."""
    datasets = dict(entry.split("=", 1) if "=" in entry else (Path(entry).stem, entry) for entry in args.data)
    for path in datasets.values():  # a wrong path fails before the target loads
        load_prompts(path, 1, key="--data")
    drafter = load_export(args.drafter, device, dtype)  # a drafter this decoding cannot run fails before the target
    target_model, tokenizer = TargetSource(args.target, args.trust_remote_code).load(device, dtype)
    head = TargetHead.of(target_model)
    settings = DecodeSettings(max_new_tokens=args.max_new_tokens or 256, max_prompts=args.max_prompts,
                              temperatures=args.temperature, seed=args.seed, block_size=args.block_size,
                              template_kwargs=args.chat_template_kwargs, batch_size=args.batch_size)
    report = evaluate_datasets(target_model, tokenizer, drafter, head, drafter_dir=args.drafter, datasets=datasets,
                               out_path=out, settings=settings, target_name=args.target)
    if args.speed:
        messages = load_prompts(next(iter(datasets.values())), args.speed, key="--data")
        ids = [encode_prompt(tokenizer, m, args.chat_template_kwargs).to(device) for m in messages]
        eos = template.reply_end_ids(tokenizer, getattr(target_model, "generation_config", None))
        report["speed"] = measure_speed(target_model, drafter, head, ids, max_new_tokens=settings.max_new_tokens,
                                        eos_ids=eos, batch_sizes=args.speed_batch)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(format_speed(report["speed"]))
    return report


if __name__ == "__main__":
    main()
