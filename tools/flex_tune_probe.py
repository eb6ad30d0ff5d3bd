"""Time the drafter's flex attention, forward and backward, under several kernel options.

The drafter's attention is a block-sparse mask (each 16-query block sees the context up to
its anchor and itself), and its backward is the largest non-GEMM cost of the step. This
times one layer's attention at the paper's shapes (512 anchors of 16 over a 3072-token
context; 32 query and 8 KV heads of 128) with Inductor's default kernel choice and with
each candidate ``kernel_options``, so a better choice for a GPU can be found and set.

    python tools/flex_tune_probe.py [--anchors 512 --ctx 3072 --calls 20]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.attention.flex_attention import flex_attention

from dflash.bench.timing import timed
from dflash.objective.anchors import sample_anchors
from dflash.objective.masks import build_mask

# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages, num_warps); the backward's kernel
# asserts BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0
CANDIDATES = [
    (64, 128, 128, 64, 3, 8),
    (64, 128, 128, 64, 2, 8),
    (64, 128, 128, 64, 4, 8),
    (64, 64, 64, 64, 3, 4),
    (64, 64, 64, 64, 2, 8),
    (32, 128, 128, 32, 3, 4),
    (32, 64, 64, 32, 3, 4),
    (64, 128, 128, 64, 3, 4),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--ctx", type=int, default=3072)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this probe times Triton kernels: it needs a GPU")
    torch._dynamo.config.cache_size_limit = 64
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    anchors, _ = sample_anchors(torch.ones(args.ctx, dtype=torch.long), args.anchors, g)
    mask = build_mask(anchors[None].to(device), args.ctx, args.block, use_flex=True)
    q_len = args.anchors * args.block
    q = torch.randn(1, 32, q_len, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, args.ctx + q_len, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn_like(q)
    flex = torch.compile(flex_attention, dynamic=False)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; q {tuple(q.shape)}, kv {tuple(k.shape)}")
    for options in [None, *CANDIDATES]:
        kernel_options = None if options is None else dict(zip(
            ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_stages", "num_warps"), options))

        def forward() -> torch.Tensor:
            return flex(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=kernel_options)

        def both() -> None:
            torch.autograd.grad(forward(), (q, k, v), grad)

        label = "default" if options is None else str(options)
        began = time.perf_counter()
        try:
            with torch.no_grad():
                forward()  # compiles
                fwd = 1e3 * timed(forward, args.calls, device)
            both()
            total = 1e3 * timed(both, args.calls, device)
        except Exception as e:  # noqa: BLE001 - a config the GPU cannot run is reported, not fatal
            print(f"{label:32s} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        print(f"{label:32s} forward {fwd:6.3f} ms, backward {total - fwd:6.3f} ms, both {total:6.3f} ms "
              f"(compiled and timed in {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
