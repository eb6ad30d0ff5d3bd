"""Time the loss's pass over the vocabulary: Inductor's kernels against dflash's Triton ones.

Per loss chunk the loss reads the LM head's ``[rows, V]`` bf16 logits for each row's
log-sum-exp, argmax and label logit, and writes their gradient. This times that pass
at the paper's shapes (two chunks, 4096 and 3584 rows, of Qwen3's 151936 columns):
the PyTorch formula compiled by Inductor, then ``dflash::softmax_xent`` under each
candidate (block, warps) of its two kernels, with the traffic's bandwidth (two reads
of the logits, one write of the gradient).

    python tools/xent_probe.py [--rows 4096 3584 --vocab 151936 --calls 20]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from dflash.bench.timing import timed
from dflash.objective import xent

BLOCKS = (1024, 2048, 4096)
WARPS = (4, 8, 16)
STAGES = (2, 3, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[4096, 3584])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this probe times Triton kernels: it needs a GPU")
    device = torch.device("cuda")
    chunks = []
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, device=device).mul_(3).bfloat16()
        labels = torch.randint(0, args.vocab, (rows,), device=device)
        scale = torch.rand(rows, device=device)
        chunks.append((logits, labels, scale, scale * 0.9))
    gigabytes = sum(3 * c[0].numel() * c[0].element_size() for c in chunks) / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; rows {args.rows} x {args.vocab}, {gigabytes:.2f} GB moved")

    def report(name: str, op) -> None:
        def run() -> None:
            for chunk in chunks:
                op(*chunk)

        run()
        seconds = timed(run, args.calls, device)
        print(f"{name:<42} {seconds * 1e3:7.3f} ms  {gigabytes / seconds / 1e3:5.2f} TB/s", flush=True)

    report("inductor, PyTorch formula", torch.compile(xent.softmax_xent_reference, dynamic=False))
    report("triton, default", torch.ops.dflash.softmax_xent)
    defaults = (xent.STATS_BLOCK, xent.STATS_WARPS, xent.GRAD_BLOCK, xent.GRAD_WARPS, xent.STATS_STAGES)
    for block, warps in itertools.product(BLOCKS, WARPS):
        xent.STATS_BLOCK, xent.STATS_WARPS = block, warps
        report(f"triton, stats block {block} warps {warps}", torch.ops.dflash.softmax_xent)
    xent.STATS_BLOCK, xent.STATS_WARPS = defaults[:2]
    for stages in STAGES:
        xent.STATS_STAGES = stages
        report(f"triton, stats loads pipelined {stages} deep", torch.ops.dflash.softmax_xent)
    xent.STATS_STAGES = defaults[4]
    for block, warps in itertools.product(BLOCKS, WARPS):
        xent.GRAD_BLOCK, xent.GRAD_WARPS = block, warps
        report(f"triton, grad block {block} warps {warps}", torch.ops.dflash.softmax_xent)
    xent.GRAD_BLOCK, xent.GRAD_WARPS = defaults[2:4]


if __name__ == "__main__":
    main()
