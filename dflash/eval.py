"""Score an exported drafter with real speculative decoding on prompt sets.

    python -m dflash.eval --drafter outputs/demo/export [--data name=file.jsonl ...]

Batch size 1 against the HF target, greedy (lossless-checked) and sampled;
:mod:`dflash.decode.speculative` is the decoding and the report it writes.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from dflash.decode.speculative import (
    DecodeSettings,
    evaluate_datasets,
    format_table,
    load_prompts,
)
from dflash.model.drafter import TargetHead
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
    ap.add_argument("--drafter", required=True, help="export directory (config.json + model.safetensors)")
    ap.add_argument("--data", nargs="+", default=["demo=demo_heldout"], help="name=path.jsonl entries")
    ap.add_argument("--max-prompts", type=positive, default=64)
    ap.add_argument("--max-new-tokens", type=positive, default=256)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    ap.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"],
        help="target and drafter dtype; a 16-token verify and a 1-token step round differently, "
        "which in bf16 can flip near-tied argmaxes and so 'lossless'; float32 keeps that far below logit gaps",
    )
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--chat-template-kwargs", type=json.loads, default={}, metavar="JSON",
                    help='chat template arguments as in training\'s data.chat_template_kwargs, e.g. \'{"enable_thinking": false}\'')
    ap.add_argument("--out", default=None, help="report path; default <output_dir>/eval.json next to the export")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    datasets = dict(entry.split("=", 1) if "=" in entry else (Path(entry).stem, entry) for entry in args.data)
    for path in datasets.values():  # a wrong path fails before the target loads
        load_prompts(path, 1, key="--data")
    target_model, tokenizer = TargetSource(args.target, args.trust_remote_code).load(device, dtype)
    head = TargetHead.of(target_model)
    out = args.out or Path(args.drafter).resolve().parent / "eval.json"
    settings = DecodeSettings(max_new_tokens=args.max_new_tokens, max_prompts=args.max_prompts,
                              temperatures=args.temperature, seed=args.seed, block_size=args.block_size,
                              template_kwargs=args.chat_template_kwargs)
    report = evaluate_datasets(target_model, tokenizer, args.drafter, head, datasets=datasets, out_path=out,
                               settings=settings, target_name=args.target)
    print(format_table(report))
    print(f"lossless: {report['lossless']}  report: {out}")
    return report


if __name__ == "__main__":
    main()
