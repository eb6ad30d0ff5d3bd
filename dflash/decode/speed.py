"""Is it faster: wall-clock decoding speed of the export against the target alone, and
against transformers' prompt-lookup decoding, the ecosystem's drafter-free baseline.

Speculative decoding and the target alone run in this project's loop
(:mod:`dflash.decode.batch`) on the same prompts, greedy, at each batch size; prompt
lookup runs through ``generate(prompt_lookup_num_tokens=...)``, one prompt at a time as
transformers runs it. Every figure is new tokens per wall second with the device
synchronised before and after, the prefill included; one short warm-up decode comes first
so no figure pays for the first kernel launches.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Generator, Sequence

import torch
from torch import nn

from dflash.decode.batch import greedy_batch_steps, speculative_batch_steps
from dflash.decode.speculative import run_to_end
from dflash.device import synchronize
from dflash.model.drafter import DFlashDrafter, TargetHead

LOOKUP_TOKENS = 10  # transformers' documented choice for prompt_lookup_num_tokens


def timed_decode(steps: Generator, device: torch.device) -> tuple[object, float]:
    """Run a sliced decoding to its end, the device synchronised before and after: its
    result and wall seconds."""
    synchronize(device)
    start = time.perf_counter()
    result = run_to_end(steps)
    synchronize(device)
    return result, time.perf_counter() - start


def prompt_lookup(target_model: nn.Module, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                  eos_ids: Collection[int], lookup_tokens: int = LOOKUP_TOKENS) -> list[list[int]]:
    """transformers' prompt-lookup decoding of each prompt, greedy, stopping at ``eos_ids``."""
    outputs = []
    for ids in prompts:
        out = target_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_new_tokens, prompt_lookup_num_tokens=lookup_tokens,
                                    eos_token_id=sorted(eos_ids), pad_token_id=sorted(eos_ids)[0])
        outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


def row(mode: str, batch: int, outputs: list[list[int]], seconds: float, reference: list[list[int]] | None) -> dict:
    tokens = sum(map(len, outputs))
    return {"mode": mode, "batch": batch, "prompts": len(outputs), "new_tokens": tokens, "wall_s": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
            "same_as_target": None if reference is None else sum(a == b for a, b in zip(outputs, reference))}


@torch.inference_mode()
def measure_speed(target_model: nn.Module, drafter: DFlashDrafter, head: TargetHead, prompts: Sequence[torch.Tensor],
                  *, max_new_tokens: int, eos_ids: Collection[int], batch_sizes: Sequence[int] = (1, 16),
                  lookup: bool = True) -> dict:
    """Tokens/s of the target alone, speculative decoding and (at batch 1) prompt lookup
    over ``prompts``, with each one's speed-up over the target alone at its batch size.
    ``same_as_target`` counts the responses equal to the target's own greedy output."""
    device = head.embed_weight.device
    run_to_end(speculative_batch_steps(target_model, drafter, head, prompts[:1], max_new_tokens=2, eos_ids=eos_ids))
    rows = []
    for batch in batch_sizes:
        alone, seconds = timed_decode(greedy_batch_steps(target_model, prompts, max_new_tokens, eos_ids, batch), device)
        rows.append(row("target alone", batch, alone, seconds, None))
        decoded, seconds = timed_decode(speculative_batch_steps(
            target_model, drafter, head, prompts, max_new_tokens=max_new_tokens, eos_ids=eos_ids, batch_size=batch),
            device)
        rows.append(row("speculative", batch, [t for t, _ in decoded], seconds, alone))
        if lookup and batch == 1:
            synchronize(device)
            start = time.perf_counter()
            looked = prompt_lookup(target_model, prompts, max_new_tokens, eos_ids)
            synchronize(device)
            rows.append(row(f"prompt lookup ({LOOKUP_TOKENS})", 1, looked, time.perf_counter() - start, alone))
    alone_rate = {r["batch"]: r["tokens_per_s"] for r in rows if r["mode"] == "target alone"}
    for r in rows:
        r["speedup"] = round(r["tokens_per_s"] / alone_rate[r["batch"]], 3) if r["tokens_per_s"] else None
    return {"rows": rows, "max_new_tokens": max_new_tokens,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "dtype": str(head.embed_weight.dtype).removeprefix("torch."), "graphs": graphs(device)}


def graphs(device: torch.device) -> str:
    """What replays as CUDA graphs in this loop: on CUDA the target's forwards at decoding
    shapes (:class:`dflash.decode.slots.SlotCache` records each query length once, and warns
    of a forward it cannot record), for the target alone and for speculative decoding alike,
    at every batch size, and the greedy drafter's forward over the cache; the prefill runs
    eagerly."""
    if device.type != "cuda":
        return "eager"
    return "the target's decoding forwards and the drafter's as CUDA graphs, the prefill eager"


def format_speed(report: dict) -> str:
    lines = [f"decoding speed on {report['device']} ({report['dtype']}, {report['max_new_tokens']} new tokens, "
             f"{report['graphs']}):"]
    for r in report["rows"]:
        same = "" if r["same_as_target"] is None else f", {r['same_as_target']}/{r['prompts']} as the target"
        lines.append(f"  {r['mode']:<20} batch {r['batch']:>3}: {r['tokens_per_s']} tokens/s, "
                     f"{r['speedup']}x the target alone{same}")
    return "\n".join(lines)
