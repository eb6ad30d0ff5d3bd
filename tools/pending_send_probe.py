"""Which host-side CUDA work waits for a send that its receiver has not posted yet.

A target rank keeps bundles in flight to its drafters, and a send completes only
when the drafter posts the matching receive. Work that the driver serialises
behind the whole device (loading a kernel, creating a library handle, freeing
memory) then waits for the drafter as well. Evaluations while training decode on
target rank 0 between its sends, with eager kernels that training never ran, and
their first run stalled for up to 1.8 s on two H200s.

Rank 0 times each action (the host call, then a sync of its own stream) in three
situations: on its first use while a send to rank 1 is pending, again while a send
is pending, and with nothing in flight. Rank 1 posts each receive ``--delay``
seconds after the send, so an action that takes about ``--delay`` waited for the
receiver. ``--first idle`` runs each action's first use with nothing in flight
instead, which gives its own cost. A first use is the first in the process: kernels
that two actions share (a fill, the cuBLAS handle) are paid by the earlier one, so
``--only NAME`` runs one action per process where that matters. ``empty_cache``'s
later rows can wait too, on the segment the NCCL barrier allocated in between.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 tools/pending_send_probe.py --out probe.json
    CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 tools/pending_send_probe.py ...

The shapes are those of decoding with a Qwen3-8B target (``--hidden``,
``--heads``, ``--kv-heads``, ``--vocab``). On the CPU it runs over gloo, whose
sends do not wait for their receiver: a check that the tool runs, nothing more.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F


def actions(device: torch.device, hidden: int, heads: int, kv_heads: int, vocab: int) -> dict[str, Callable[[], object]]:
    """Each decoding operation at its own shape, plus the driver calls suspected of
    serialising. Every call allocates its inputs afresh."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head_dim = hidden // heads
    weight = torch.randn(hidden, 3 * hidden, device=device, dtype=dtype)
    norm_weight = torch.ones(hidden, device=device)  # fp32 weight, low-precision input, as the target's norms

    def gemm(rows: int) -> Callable[[], object]:
        return lambda: torch.randn(rows, hidden, device=device, dtype=dtype) @ weight

    def sdpa(queries: int, keys: int, masked: bool) -> Callable[[], object]:
        """As transformers' ``sdpa`` attention calls it: grouped keys go to the flash
        kernel as they are; with a mask (a block over a cache) they are repeated to every
        head first, which takes the memory-efficient kernel."""
        def run() -> object:
            q = torch.randn(1, heads, queries, head_dim, device=device, dtype=dtype)
            k, v = (torch.randn(1, kv_heads, keys, head_dim, device=device, dtype=dtype) for _ in range(2))
            if not masked:
                return F.scaled_dot_product_attention(q, k, v, is_causal=queries > 1, enable_gqa=True)
            k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
            mask = torch.ones(queries, keys, device=device, dtype=torch.bool).tril(keys - queries)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return run

    return {
        "gemm_1_row": gemm(1),  # a baseline token
        "gemm_16_rows": gemm(16),  # a verified block
        "gemm_333_rows": gemm(333),  # a prompt's prefill
        "sdpa_prefill_causal_333": sdpa(333, 333, masked=False),
        "sdpa_block_masked_16x349": sdpa(16, 349, masked=True),  # a key length off the kernels' alignment
        "sdpa_block_masked_16x352": sdpa(16, 352, masked=True),
        "sdpa_token_1x350": sdpa(1, 350, masked=False),
        "rms_norm_mixed_dtypes": lambda: F.rms_norm(torch.randn(16, hidden, device=device, dtype=dtype), (hidden,),
                                                    norm_weight, 1e-6),
        "argmax_over_vocab": lambda: torch.randn(16, vocab, device=device, dtype=dtype).argmax(-1),
        "kv_cache_growth_cat": lambda: torch.cat([torch.randn(1, kv_heads, 349, head_dim, device=device, dtype=dtype),
                                                  torch.randn(1, kv_heads, 16, head_dim, device=device, dtype=dtype)], 2),
        "new_allocator_segment": lambda: torch.empty(1 << 29, device=device),
        "empty_cache": lambda: torch.cuda.empty_cache() if device.type == "cuda" else None,
    }


def driver_loading_mode() -> str | None:
    """The module loading the driver actually uses (``CUDA_MODULE_LOADING`` counts only
    if set before CUDA starts); ``None`` without a CUDA driver."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    mode = ctypes.c_int()
    if driver.cuModuleGetLoadingMode(ctypes.byref(mode)) != 0:
        return None
    return {1: "EAGER", 2: "LAZY"}.get(mode.value, str(mode.value))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()


def timed(rank: int, device: torch.device, payload: torch.Tensor, fn: Callable[[], object], pending: bool,
          delay: float) -> float | None:
    """Rank 0: the action's seconds, with a send to rank 1 pending or not; rank 1:
    the matching receive, ``delay`` s late."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = None
    if rank == 0:
        work = dist.isend(payload, 1) if pending else None
        time.sleep(0.05)
        began = time.perf_counter()
        fn()
        sync(device)
        seconds = round(time.perf_counter() - began, 4)
        if work:
            work.wait()
    elif pending:
        time.sleep(delay)
        dist.recv(payload, 0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--delay", type=float, default=1.0, help="seconds before rank 1 posts each receive")
    parser.add_argument("--first", choices=["pending", "idle"], default="pending",
                        help="whether each action's first use has a send pending")
    parser.add_argument("--only", help="comma-separated actions to run, e.g. one per process: a first use is "
                        "the first in its process, so kernels two actions share are paid by the earlier one")
    parser.add_argument("--megabytes", type=int, default=126, help="size of the pending send (one Qwen3-8B bundle)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    began = time.perf_counter()
    torch.zeros(1, device=device)
    context_s = time.perf_counter() - began
    payload = torch.empty(args.megabytes << 19, dtype=torch.bfloat16, device=device)
    timed(rank, device, payload, lambda: None, pending=True, delay=0.0)  # the pair's communicator

    results = {}
    first_pending = args.first == "pending"
    chosen = actions(device, args.hidden, args.heads, args.kv_heads, args.vocab)
    if args.only:
        unknown = set(args.only.split(",")) - set(chosen)
        if unknown:
            raise SystemExit(f"unknown actions {sorted(unknown)}; known: {', '.join(chosen)}")
        chosen = {name: chosen[name] for name in args.only.split(",")}
    for name, fn in chosen.items():
        first = timed(rank, device, payload, fn, first_pending, args.delay)
        again = timed(rank, device, payload, fn, True, args.delay)
        idle = timed(rank, device, payload, fn, False, args.delay)
        results[name] = {f"first ({args.first})": first, "again (pending)": again, "idle": idle}
    if rank == 0:
        report = {"backend": dist.get_backend(), "delay_s": args.delay, "context_s": round(context_s, 2),
                  "module_loading": driver_loading_mode(), "seconds": results}
        print(json.dumps(report, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
