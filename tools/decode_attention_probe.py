"""How long SDPA takes at a key length it has not seen, the way decoding calls it.

Each call is a verification block (16 queries of Qwen3-8B's 32 heads over ``kv`` keys
of its 8 KV heads, a causal mask offset by the cache), made the way transformers makes
it on CUDA: with a mask it repeats the KV heads rather than pass ``enable_gqa``, which
would leave only the math kernel outside cuDNN. Each call is timed from launch to finish on
an idle GPU, once per key length: a backend that builds something per shape pays it
at every length. Prints the backend SDPA picks and the times, with every backend
allowed (the default) and with cuDNN attention left out (what ``dflash.eval.decoding_attention``
does).

    python tools/decode_attention_probe.py [--first 96 --lengths 104]
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from dflash.decode.speculative import decoding_attention


def block_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """The newest ``queries`` positions each see the cache and the block up to themselves."""
    last = torch.arange(queries, device=device)[:, None] + keys - queries
    return (torch.arange(keys, device=device)[None] <= last)[None, None]


def sweep(lengths: range, device: torch.device, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
          queries: int = 16) -> tuple[str, list[float]]:
    """The backend of the first call and milliseconds per call, one call per key length."""
    times, backend = [], ""
    for keys in lengths:
        q = torch.randn(1, heads, queries, head_dim, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, keys, head_dim, device=device, dtype=torch.bfloat16)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        mask = block_mask(queries, keys, device)
        backend = backend or SDPBackend(torch._fused_sdp_choice(q, k, k, mask)).name
        torch.cuda.synchronize()
        began = time.perf_counter()
        F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - began))
    return backend, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first", type=int, default=96, help="the first key length")
    parser.add_argument("--lengths", type=int, default=104, help="key lengths per sweep, each one new")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this probe times CUDA attention backends: it needs a GPU")
    device = torch.device("cuda")
    start = args.first
    for label, context in (("decoding (no cuDNN)", decoding_attention), ("default choice", nullcontext)):
        lengths = range(start, start + args.lengths)
        start += args.lengths
        with context():
            backend, times = sweep(lengths, device)
        ordered = sorted(times)
        print(f"{label}: {backend}, key lengths {lengths.start}-{lengths.stop - 1}, first call each: "
              f"median {ordered[len(ordered) // 2]:.2f} ms, max {ordered[-1]:.1f} ms, "
              f"{sum(t > 500 for t in times)} over 500 ms")


if __name__ == "__main__":
    main()
