"""Real speculative decoding with the HF target and an exported drafter.

Batch size 1, the way a drafter is served: the target prefills the prompt into
a KV cache; then each cycle the drafter fills the block ``[last, MASK x (B-1)]``
in one forward, the target verifies it in one forward, the longest accepted
prefix plus the target's own next token (the bonus) is kept, and the cache is
rolled back to the accepted prefix (:func:`snapshot`, :func:`roll_back`). Greedy
decoding must reproduce plain greedy decoding token for
token (``lossless``); the headline metric is ``tau``, the mean acceptance length
(accepted drafts + 1 per cycle, the last cycle counted up to its stop token:
:func:`cycle_length`), averaged per response and then over responses as z-lab's
harness reports it.

This path shares nothing with training but the model definitions: context
features come from HF's ``output_hidden_states`` (layer id ``i`` is
``hidden_states[i + 1]``), not from training's hooks, so a layer-id slip on
either side shows up here as a low tau.

The evaluation harness over prompt sets is :mod:`dflash.decode.evaluate`.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Collection, Generator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from dflash.data import template
from dflash.decode.selector import propose, sample
from dflash.model.drafter import DFlashDrafter, TargetHead

log = logging.getLogger("dflash.decode.speculative")


T = TypeVar("T")


@dataclass(frozen=True)
class DecodeSettings:
    """How prompt sets are decoded and measured (the ``eval`` config group, the
    ``dflash.eval`` options)."""

    max_new_tokens: int = 256  # per response
    max_prompts: int = 64  # read from each prompt set
    temperatures: tuple[float, ...] = (0.0,)  # 0: greedy, with the lossless check
    seed: int = 0  # prompt i samples with a generator seeded seed + i
    block_size: int | None = None  # None: the drafter's
    template_kwargs: Mapping = field(default_factory=dict)  # data.chat_template_kwargs, as in training
    batch_size: int | None = None  # prompts decoded at once; None: 64 on a GPU, 32 on the CPU (dflash.decode.batch)

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
        object.__setattr__(self, "template_kwargs", dict(self.template_kwargs or {}))


# ---------------------------------------------------------------------------
# Decoding on token ids
# ---------------------------------------------------------------------------


def context_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """The drafter's context: the chosen layers' outputs side by side, ``[b, S, n*H]``."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def drafter_context(drafter: DFlashDrafter, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """What decoding keeps of a target forward for the drafter: its context features
    projected as the drafter's layers read them (:meth:`DFlashDrafter.context`), ``[b, S, H]``,
    in the target's dtype (the drafter's block embeddings come from the same weights)."""
    features = context_features(hidden_states, drafter.config.target_layer_ids)
    return drafter.context(features, features.dtype)


def window(features: torch.Tensor, first: int, keep: int | None) -> tuple[torch.Tensor, int]:
    """Context features ``[1, S, n*H]`` starting at position ``first``, cut to their last
    ``keep`` positions (``None``: all), and the position they then start at."""
    drop = 0 if keep is None else max(0, features.shape[1] - keep)
    return features[:, drop:], first + drop


def with_cache(model: nn.Module, cache: DynamicCache, **kwargs):
    """Forward with a KV cache under the keyword this transformers version expects
    (``cache`` in 5.x, where ``past_key_values`` is deprecated; only the latter in 4.57)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(**kwargs, **{name: cache}, use_cache=True)


def accept(
    drafts: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float,
    *,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """How many of the ``B - 1`` drafts the target keeps, and the token it adds after them.

    ``target_logits[i]`` is the target's prediction after ``[last, d_1..d_i]``.
    Greedy keeps the drafts that equal the target's argmax. Sampling is standard
    speculative sampling (accept ``d`` with probability ``min(1, p/q)``, resample a
    rejection from ``max(0, p - q)``), whose output is distributed exactly as
    sampling the target alone.
    """
    if temperature == 0:
        target = target_logits.argmax(-1)
        n = int((drafts == target[:-1]).cumprod(0).sum())
        return n, int(target[n])
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)
    rows = torch.arange(len(drafts), device=drafts.device)
    ratio = p[rows, drafts] / q[rows, drafts]
    u = torch.rand(len(drafts), device=drafts.device, generator=generator)
    n = int((u < ratio).cumprod(0).sum())
    if n == len(drafts):
        dist = p[n]
    else:
        dist = (p[n] - q[n]).clamp_min(0)
        if dist.sum() <= 0:  # p == q up to rounding: the rejection itself was rounding noise
            dist = p[n]
    return n, int(torch.multinomial(dist, 1, generator=generator))


def truncate(tokens: list[int], max_new_tokens: int, eos_ids: Collection[int]) -> list[int]:
    """Cut after the first stop token and at the budget; a cycle may overshoot both."""
    return tokens[: template.end_of_reply(tokens, eos_ids) or len(tokens)][:max_new_tokens]


TAU_COUNT = "z-lab benchmark.py: accepted drafts + 1 per cycle, the last cycle up to its stop token"


def cycle_length(new: list[int], eos_ids: Collection[int]) -> int:
    """A cycle's acceptance length as z-lab's harness counts it: the accepted drafts and
    the bonus, the last cycle only up to and with its stop token (drafts the target also
    accepted past the end of the reply are not counted)."""
    return template.end_of_reply(new, eos_ids) or len(new)


def croppable(cache: DynamicCache) -> bool:
    """Whether cutting positions off the end takes the cache back to any earlier length:
    only when every layer keeps each position's keys and values. A sliding-window layer
    keeps the last window only, and a linear-attention layer one recurrent state that
    every token updates, so neither can give back the state before a rejected draft."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def snapshot(cache: DynamicCache) -> list[object | None]:
    """The cache at a block's start, for :func:`roll_back`: ``None`` for a layer that
    cropping puts back, a copy of every other (a sliding window or a recurrent state,
    small and of fixed size)."""
    return [None if type(layer) is DynamicLayer else copy.deepcopy(layer) for layer in cache.layers]


def roll_back(cache: DynamicCache, saved: list[object | None], dropped: int) -> None:
    """Back to the block's start: the last ``dropped`` positions cut off the layers that
    keep every position, the saved copies in place of the others."""
    for i, layer in enumerate(saved):
        if layer is None:
            cache.layers[i].crop(-dropped)  # negative = drop that many; 4.57 and 5.x agree on this spelling
        else:
            cache.layers[i] = layer


def decoding_attention() -> AbstractContextManager[None]:
    """The attention kernels decoding may use: every SDPA backend but cuDNN's.

    cuDNN attention, SDPA's first choice on an H200 for a verification's masked call,
    builds an execution plan for each new shape, and decoding gives every call a new
    key length. That cost 43-98 ms of host time per new length on an idle H200, and
    about 1 s for some lengths (BENCHMARKS.md); flash and memory-efficient attention
    take 0.2-0.6 ms at a new length. In a target rank's evaluation slice, the 1 s builds
    held back its next bundle. Speculative decoding here and regeneration's ``generate``
    run under it; training's prefill does not: it runs at a few fixed shapes.

    The backend flags are process-wide, so a sliced decoding enters this around each
    slice, never across a pause."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def run_to_end(steps: Generator[str, None, T]) -> T:
    """Drive a sliced decoding (below) to its end and return its result."""
    with decoding_attention():
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value


@torch.inference_mode()
def speculative_steps(
    target_model: nn.Module,
    drafter: DFlashDrafter,
    head: TargetHead,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_ids: Collection[int] = (),
    generator: torch.Generator | None = None,
    block_size: int | None = None,
) -> Generator[str, None, tuple[list[int], list[int]]]:
    """Generate from ``prompt_ids`` ``[1, S]``, pausing after the prompt's prefill and
    after every drafting cycle (each pause yields what ran before it);
    returns (new tokens, acceptance length per cycle). The pauses let a target rank
    run an evaluation in the gaps between its training work (:mod:`dflash.decode.live`).

    Invariant between cycles: the target cache covers positions ``0..p-1`` and the
    drafter's context (:func:`drafter_context`) ``first..p-1``; the newest token sits at
    ``p`` and is in neither. ``first`` is 0 unless every drafter layer slides: then the
    context keeps only the positions a window reaches (``DrafterConfig.context_window``),
    and the drafter's sliding layers mask the rest of theirs. Each position's context is
    projected once; the drafter's layers rerun over the whole context each cycle (no
    drafter KV cache), which is slower but leaves no cache bookkeeping to get wrong.

    After a rejection the target cache goes back to the accepted prefix: cropped when
    every layer keeps all positions (:func:`croppable`); otherwise (sliding windows,
    linear attention) put back as it was at the block's start and fed the accepted
    tokens again, one more target forward of ``n + 1`` tokens in that cycle.
    """
    cfg = drafter.config
    block_size = block_size or cfg.block_size
    device = prompt_ids.device
    cache = DynamicCache(config=target_model.config)
    out = with_cache(target_model, cache, input_ids=prompt_ids, output_hidden_states=True, logits_to_keep=1)
    crop = croppable(cache)
    context, first = window(drafter_context(drafter, out.hidden_states), 0, cfg.context_window)
    new = sample(out.logits[0, -1:], temperature, generator).tolist()
    tokens, lengths = list(new), []
    yield "prompt prefill"  # a slice of its own
    while len(tokens) < max_new_tokens and not any(t in eos_ids for t in new):
        p = first + context.shape[1]
        block = torch.full((1, block_size), cfg.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = tokens[-1]
        hidden = drafter(
            context,
            head.embed(block),
            torch.arange(first, p, device=device)[None],
            torch.arange(p, p + block_size, device=device)[None],
            projected=True,
        )
        drafts, draft_logits = propose(drafter, head, hidden[0, 1:], tokens[-1], temperature, generator)
        block[0, 1:] = drafts
        saved = None if crop else snapshot(cache)
        out = with_cache(target_model, cache, input_ids=block, output_hidden_states=True)
        n, bonus = accept(drafts, draft_logits, out.logits[0].float(), temperature, generator=generator)
        if n + 1 < block_size and crop:  # negative crop = drop that many; 4.57 and 5.x agree on this spelling
            cache.crop(-(block_size - n - 1))
        elif n + 1 < block_size:
            roll_back(cache, saved, block_size)
            with_cache(target_model, cache, input_ids=block[:, : n + 1], logits_to_keep=1)
        context = torch.cat([context, drafter_context(drafter, out.hidden_states)[:, : n + 1]], dim=1)
        context, first = window(context, first, cfg.context_window)
        new = drafts[:n].tolist() + [bonus]
        tokens += new
        lengths.append(cycle_length(new, eos_ids))
        yield "drafting cycle"
    return truncate(tokens, max_new_tokens, eos_ids), lengths


def speculative_generate(*args, **kwargs) -> tuple[list[int], list[int]]:
    """:func:`speculative_steps` in one call."""
    return run_to_end(speculative_steps(*args, **kwargs))


@torch.inference_mode()
def greedy_steps(
    target_model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids: Collection[int] = ()
) -> Generator[str, None, list[int]]:
    """Plain one-token-at-a-time greedy decoding, the reference ``lossless`` is judged
    against; pauses after every token."""
    cache = DynamicCache(config=target_model.config)
    logits = with_cache(target_model, cache, input_ids=prompt_ids, logits_to_keep=1).logits
    tokens: list[int] = []
    yield "baseline prefill"
    while True:
        tokens.append(int(logits[0, -1].argmax()))
        if len(tokens) >= max_new_tokens or tokens[-1] in eos_ids:
            return tokens
        step = torch.tensor([[tokens[-1]]], device=prompt_ids.device)
        logits = with_cache(target_model, cache, input_ids=step).logits
        yield "baseline token"


def greedy_generate(*args, **kwargs) -> list[int]:
    """:func:`greedy_steps` in one call."""
    return run_to_end(greedy_steps(*args, **kwargs))
