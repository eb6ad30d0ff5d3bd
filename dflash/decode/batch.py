"""Speculative and plain greedy decoding of several prompts at once.

The batch-1 loops of :mod:`dflash.decode.speculative` spend one target forward per
drafting cycle (or per token) on one sequence: on a GPU that is weight reads, not
compute. Here every cycle verifies the blocks of up to ``batch_size`` sequences in one
target forward, each row keeping its own number of drafts (ragged acceptance).

Rows keep their own lengths in the fixed slots of one :class:`dflash.decode.slots.SlotCache`:
every forward writes the same columns of every slot, a mask says which columns each row
holds, and position ids carry each row's own positions. A rejected draft's column is
let go in the mask, and the held columns are moved to the front when the cache fills.
Masked keys get zero attention weight, so each row computes what the batch-1 loop
computes, up to the rounding of other matrix shapes. With every shape fixed, the target's
forwards replay as CUDA graphs.

Batch 1 takes this path too: one slot, so a cycle at the size a drafter is served at is
two recorded forwards and the acceptance on the device. Greedy DFlash drafts come from the
drafter's forward over every column of the cache, its masks and its argmax recorded with
it (:func:`slot_drafts`, :meth:`SlotCache.record_drafts`); sampled and DFlash2 drafts are
drawn per row eagerly. A cycle then waits for the device once, to read what each row kept.

Waiting prompts are prefilled together, right-padded with no mask (under the causal
mask a prompt's tokens never see the padding after them), up to ``PREFILL_TOKENS``
padded tokens per forward, and join the batch where finished rows left (continuous
batching). A target whose cache
holds layers that cannot give a position back (sliding windows, linear attention:
:func:`dflash.decode.speculative.croppable`) is decoded one prompt at a time, in the
eager batch-1 loop.

The drafter reads each row's whole context every cycle, as in the batch-1 loop, as keys
and values that the cache keeps per position (:func:`drafter_columns`: computed once, in
the forward that reaches the position, where the batch-1 loop projects the whole context
again at every block); the rows' contexts are padded to the longest and the padding
masked, except for a DFlash2 drafter run at another block size than its own (its
convolutions then need the block length that only an unmasked forward gives), which
drafts row by row.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from dflash.decode.baseline import GreedyBaselines
from dflash.decode.selector import propose, sample
from dflash.decode.slots import SlotCache, slot_cache
from dflash.decode.speculative import (
    accept,
    croppable,
    cycle_length,
    drafter_context,
    greedy_steps,
    speculative_steps,
    truncate,
    with_cache,
)
from dflash.model.drafter import (
    FULL,
    SLIDING,
    ContextKV,
    DFlashDrafter,
    TargetHead,
    window_mask,
)

PREFILL_TOKENS = 8192  # padded prompt tokens per prefill forward: about 0.2 s at Qwen3-8B shapes on an H200


@dataclass
class Row:
    """One prompt being decoded: its tokens so far, the position ``p`` of the newest one
    (in no cache yet), and acceptance per cycle. Its keys, values and drafter context
    live in its slot of the :class:`SlotCache`."""

    index: int
    tokens: list[int]
    p: int
    generator: torch.Generator | None = None
    slot: int = -1
    lengths: list[int] = field(default_factory=list)


def default_batch_size(device: torch.device) -> int:
    """Prompts decoded at once where none is set, by the prompts' device. On a GPU, 64: a
    target forward reads its weights once for more rows, and one batch of 64 decoded 64 x
    256 tokens at Qwen3-8B shapes 14% faster than two of 32 (BENCHMARKS.md). On the CPU,
    32: decoding is compute-bound there, and the fixed-shape cache's wider forwards made a
    batch of 64 slower on the demo."""
    return 64 if device.type == "cuda" else 32


def finished(row: Row, new: list[int], max_new_tokens: int, eos_ids: Collection[int]) -> bool:
    """The batch-1 loop's stopping rule: the budget is reached or a stop token was just added."""
    return len(row.tokens) >= max_new_tokens or any(t in eos_ids for t in new)


def batched_drafter(drafter: DFlashDrafter, block_size: int) -> bool:
    """Whether the drafter can run over padded rows under a mask: not a DFlash2 drafter
    at another block size than its own (its convolutions take the block length from the
    mask's absence)."""
    return drafter.config.dflash2 is None or block_size == drafter.config.block_size


def drafter_masks(drafter: DFlashDrafter, valid: torch.Tensor, ctx_positions: torch.Tensor,
                  block_positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """The masks of a padded drafter forward: every block query sees its row's context
    and the whole block (inference's unmasked forward), a sliding layer only its window."""
    b, block_size = block_positions.shape
    seen = torch.cat([valid, valid.new_ones(b, block_size)], dim=1)[:, None, None, :].expand(-1, 1, block_size, -1)
    if SLIDING not in drafter.config.attention_types:
        return seen
    cfg = drafter.config
    return {FULL: seen,
            SLIDING: seen & window_mask(ctx_positions, block_positions, cfg.sliding_window, cfg.sliding_causal)}


def drafter_columns(drafter: DFlashDrafter, hidden_states: tuple[torch.Tensor, ...], positions: torch.Tensor
                    ) -> list[torch.Tensor]:
    """What the cache keeps for the drafter of a target forward's positions ``[b, S]``: every
    drafter layer's context keys and values, one row per position (:meth:`ContextKV.flat`)."""
    return drafter.context_kv(drafter_context(drafter, hidden_states), positions).flat()


def cached_context(drafter: DFlashDrafter, columns: list[torch.Tensor]) -> ContextKV:
    """The drafter's context from the cache's columns ``[b, S, F]`` (:func:`drafter_columns`)."""
    return ContextKV.of_flat(columns, drafter.config.num_key_value_heads)


def draft_hidden(drafter: DFlashDrafter, head: TargetHead, cache: SlotCache, rows: list[Row], mask_token_id: int,
                 block_size: int) -> torch.Tensor:
    """The drafter's hidden states ``[b, B, H]`` of every row's block ``[last, MASK...]``:
    one forward over the rows' contexts as the cache holds them, the columns a row does not
    hold masked, or row by row over each row's own context (:func:`batched_drafter`)."""
    device = cache.device
    offsets = torch.arange(block_size, device=device)
    if not batched_drafter(drafter, block_size):
        hidden = []
        for r in rows:
            held = cache.valid[r.slot].nonzero()[:, 0]
            drop = max(0, len(held) - (drafter.config.context_window or len(held)))
            context = cached_context(drafter, [t[r.slot, held[drop:]][None] for t in cache.drafter_kv])
            block = torch.full((1, block_size), mask_token_id, dtype=torch.long, device=device)
            block[0, 0] = r.tokens[-1]
            hidden.append(drafter(context, head.embed(block), torch.arange(drop, r.p, device=device)[None],
                                  (r.p + offsets)[None]))
        return torch.cat(hidden)
    columns = slice(0, cache.used)  # no row holds a column beyond
    if [r.slot for r in rows] == list(range(cache.slots)):  # every slot in order: views, not copies
        index: torch.Tensor | slice = slice(None)
    else:
        index = torch.tensor([r.slot for r in rows], device=device)
    context = cached_context(drafter, [t[index, columns] for t in cache.drafter_kv])
    valid, ctx_positions = cache.valid[index, columns], cache.positions[index, columns]
    block = torch.full((len(rows), block_size), mask_token_id, dtype=torch.long, device=device)
    block[:, 0] = torch.tensor([r.tokens[-1] for r in rows], device=device)
    block_positions = torch.tensor([r.p for r in rows], device=device)[:, None] + offsets
    masks = drafter_masks(drafter, valid, ctx_positions, block_positions)
    return drafter(context, head.embed(block), ctx_positions, block_positions, masks)


def graphed_drafts(drafter: DFlashDrafter, temperature: float, block_size: int) -> bool:
    """Whether a cycle's drafts come from the drafter's recorded forward over every slot
    (:meth:`SlotCache.record_drafts`): greedy DFlash drafts, an argmax in the forward, where
    sampling draws per row from each row's generator and DFlash2 walks its candidates."""
    return temperature == 0 and drafter.config.dflash2 is None and batched_drafter(drafter, block_size)


def slot_drafts(drafter: DFlashDrafter, head: TargetHead, cache: SlotCache, mask_token_id: int, block_size: int
                ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The greedy drafts of every slot from its newest token ``last [slots]`` at ``p [slots]``:
    the drafter over every column of the cache (the columns a slot does not hold masked), its
    drafted slots through the target's head, the argmax. Every shape is the cache's, so the
    forward can be recorded."""
    offsets = torch.arange(block_size, device=cache.device)

    def draft(last: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        block = torch.full((cache.slots, block_size), mask_token_id, dtype=torch.long, device=cache.device)
        block[:, 0] = last
        block_positions = p[:, None] + offsets
        masks = drafter_masks(drafter, cache.valid, cache.positions, block_positions)
        hidden = drafter(cached_context(drafter, cache.drafter_kv), head.embed(block), cache.positions,
                         block_positions, masks)
        return drafter.draft_logits(head, hidden[:, 1:]).argmax(-1)

    return draft


def single(target_model: nn.Module) -> bool:
    """Whether the target's cache must be decoded one prompt at a time: it has layers that
    cannot be cut back per row (:func:`dflash.decode.speculative.croppable`)."""
    return not croppable(DynamicCache(config=target_model.config))


@dataclass
class Started:
    """A prefilled prompt: its row (holding the first token), its keys and values per layer
    ``[1, h, S, d]`` and, for a drafter, what the cache keeps of its context
    (:func:`drafter_columns`, each ``[1, S, F]``)."""

    row: Row
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    context: list[torch.Tensor] | None


def prefill(target_model: nn.Module, drafter: DFlashDrafter | None, indices: list[int],
            prompts: Sequence[torch.Tensor], generators: Sequence[torch.Generator | None], temperature: float
            ) -> list[Started]:
    """Prompts ``prompts[i]`` for ``i`` in ``indices`` prefilled in one forward, right-padded
    to the longest with no attention mask (under the causal mask a prompt's tokens never see
    the padding after them)."""
    lengths = [prompts[i].shape[1] for i in indices]
    ids = torch.zeros(len(indices), max(lengths), dtype=torch.long, device=prompts[indices[0]].device)
    for r, i in enumerate(indices):
        ids[r, : lengths[r]] = prompts[i][0]
    ends = sorted(set(n - 1 for n in lengths))  # the positions whose logits give a first token
    cache = DynamicCache(config=target_model.config)
    out = with_cache(target_model, cache, input_ids=ids, output_hidden_states=drafter is not None,
                     logits_to_keep=torch.tensor(ends, device=ids.device))
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    context = None if drafter is None else drafter_columns(drafter, out.hidden_states, positions)
    started = []
    for r, (i, n) in enumerate(zip(indices, lengths)):
        row = Row(i, sample(out.logits[r, ends.index(n - 1)][None], temperature, generators[i]).tolist(), n,
                  generators[i])
        layers = [(layer.keys[r : r + 1, :, :n], layer.values[r : r + 1, :, :n]) for layer in cache.layers]
        started.append(Started(row, layers, None if context is None else [t[r : r + 1, :n] for t in context]))
    return started


def prefill_groups(prompts: Sequence[torch.Tensor], indices: list[int], tokens: int) -> list[list[int]]:
    """``indices`` in groups whose padded prefill (count x longest) stays within ``tokens``
    (a prompt longer than that alone): one decoding slice stays short. Shortest first, so
    that a forward holds prompts of like length: 64 random prompts of 64-512 tokens (19.6k
    tokens) pad to 31.7k in arrival order and to 24.4k sorted."""
    groups: list[list[int]] = []
    for i in sorted(indices, key=lambda k: prompts[k].shape[1]):
        group = groups[-1] if groups else None
        if group and (len(group) + 1) * max(prompts[k].shape[1] for k in [*group, i]) <= tokens:
            group.append(i)
        else:
            groups.append([i])
    return groups


def propose_rows(drafter: DFlashDrafter, head: TargetHead, hidden: torch.Tensor, rows: list[Row],
                 temperature: float) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Every row's drafts ``[b, B-1]`` from the drafted slots' hidden states ``[b, B-1, H]``;
    greedy DFlash drafts are one argmax over the batch, the others are drawn row by row
    with each row's generator (:func:`dflash.decode.selector.propose`), with the draft
    logits sampling needs."""
    if temperature == 0 and drafter.config.dflash2 is None:
        return drafter.draft_logits(head, hidden).argmax(-1), None
    proposed = [propose(drafter, head, hidden[i], r.tokens[-1], temperature, r.generator) for i, r in enumerate(rows)]
    return torch.stack([d for d, _ in proposed]), [q for _, q in proposed]


def accept_rows(drafts: torch.Tensor, draft_logits: list[torch.Tensor] | None, target_logits: torch.Tensor,
                rows: list[Row], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts kept and the token added after them, per row, on the device ``[b]``
    (:func:`dflash.decode.speculative.accept`): greedy over the whole batch at once, with
    no wait for the device; sampling row by row with each row's generator."""
    if temperature == 0:
        target = target_logits.argmax(-1)
        n = (drafts == target[:, :-1]).cumprod(1).sum(1)
        return n, target.gather(1, n[:, None])[:, 0]
    kept = [accept(drafts[i], draft_logits[i], target_logits[i].float(), temperature, generator=r.generator)
            for i, r in enumerate(rows)]
    return torch.tensor(kept, device=drafts.device).unbind(1)


def refill(rows: list[Row], cache: SlotCache, pending: list[int], free: list[int], prompts: Sequence[torch.Tensor],
           start: Callable[[list[int]], list[Started]], max_new_tokens: int, eos_ids: Collection[int]
           ) -> Generator[str, None, list[Row]]:
    """Prefill waiting prompts into the free slots, ``PREFILL_TOKENS`` padded tokens per
    forward (``start(indices)`` prefills them), pausing after each; returns the rows
    already finished by their first token (they never join)."""
    done = []
    taken = [pending.pop() for _ in range(min(len(pending), len(free)))]
    for group in prefill_groups(prompts, taken, PREFILL_TOKENS):
        started = start(group)
        yield "prompt prefill"
        for s in started:
            if finished(s.row, s.row.tokens, max_new_tokens, eos_ids):
                done.append(s.row)
            else:
                s.row.slot = free.pop()
                cache.join(s.row.slot, s.layers, s.context)
                rows.append(s.row)
    return done


def retire(rows: list[Row], cache: SlotCache, over: list[bool], free: list[int]) -> list[Row]:
    """Take the finished rows out of the batch and free their slots; returns them."""
    done = [r for r, o in zip(rows, over) if o]
    for r in done:
        cache.leave(r.slot)
        free.append(r.slot)
    rows[:] = [r for r, o in zip(rows, over) if not o]
    return done


@torch.inference_mode()
def speculative_batch_steps(
    target_model: nn.Module,
    drafter: DFlashDrafter,
    head: TargetHead,
    prompts: Sequence[torch.Tensor],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_ids: Collection[int] = (),
    generators: Sequence[torch.Generator | None] | None = None,
    block_size: int | None = None,
    batch_size: int | None = None,
) -> Generator[str, None, list[tuple[list[int], list[int]]]]:
    """:func:`dflash.decode.speculative.speculative_steps` over ``prompts`` (each ``[1, S]``),
    up to ``batch_size`` (None: :func:`default_batch_size`) at a time, each with its
    generator; returns (new tokens, acceptance lengths) per prompt, in order. Pauses after
    every prompt's prefill and every batched drafting cycle."""
    generators = list(generators or [None] * len(prompts))
    batch_size = batch_size or (default_batch_size(prompts[0].device) if prompts else 1)
    if single(target_model) or not prompts:
        results = []
        for ids, generator in zip(prompts, generators):
            results.append((yield from speculative_steps(
                target_model, drafter, head, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                eos_ids=eos_ids, generator=generator, block_size=block_size)))
        return results
    cfg = drafter.config
    block_size = block_size or cfg.block_size
    device = prompts[0].device
    offsets = torch.arange(block_size, device=device)
    results: list = [None] * len(prompts)
    slots = min(batch_size, len(prompts))
    cache = slot_cache(target_model, prompts, block_size, slots,
                       lambda hidden_states, positions: drafter_columns(drafter, hidden_states, positions))
    rows, pending, free = [], list(range(len(prompts)))[::-1], list(range(slots))[::-1]

    def start(indices: list[int]) -> list[Started]:
        return prefill(target_model, drafter, indices, prompts, generators, temperature)

    def record(done: list[Row]) -> None:
        for r in done:
            results[r.index] = (truncate(r.tokens, max_new_tokens, eos_ids), r.lengths)

    graphed = graphed_drafts(drafter, temperature, block_size)
    while pending or rows:
        record((yield from refill(rows, cache, pending, free, prompts, start, max_new_tokens, eos_ids)))
        if not rows:
            continue
        rows.sort(key=lambda r: r.slot)  # a full batch then reads its drafter context in place (draft_hidden)
        index, last, p = torch.tensor([[r.slot, r.tokens[-1], r.p] for r in rows], device=device).unbind(1)
        if graphed:
            if cache.drafting is None:  # the context buffers exist from the first join on
                cache.record_drafts(slot_drafts(drafter, head, cache, cfg.mask_token_id, block_size))
            drafts, draft_logits = cache.draft(index, last, p), None
        else:
            hidden = draft_hidden(drafter, head, cache, rows, cfg.mask_token_id, block_size)
            drafts, draft_logits = propose_rows(drafter, head, hidden[:, 1:], rows, temperature)
        logits = cache.forward(index, torch.cat([last[:, None], drafts], dim=1), p[:, None] + offsets)
        kept, bonus = accept_rows(drafts, draft_logits, logits, rows, temperature)
        cache.keep(index, kept + 1, block_size)
        over = []
        for r, (n, *drafted) in zip(rows, torch.cat([kept[:, None], drafts, bonus[:, None]], dim=1).tolist()):
            new = drafted[:n] + [drafted[-1]]  # the kept drafts, then the bonus
            r.tokens += new
            r.p += n + 1
            r.lengths.append(cycle_length(new, eos_ids))
            over.append(finished(r, new, max_new_tokens, eos_ids))
        yield "drafting cycle"
        record(retire(rows, cache, over, free))
    return results


@torch.inference_mode()
def greedy_batch_steps(
    target_model: nn.Module,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    eos_ids: Collection[int] = (),
    batch_size: int | None = None,
) -> Generator[str, None, list[list[int]]]:
    """:func:`dflash.decode.speculative.greedy_steps` over ``prompts``, up to ``batch_size``
    (None: :func:`default_batch_size`) at a time: one target forward of one token per row
    per step. Pauses after every prompt's prefill and every step."""
    batch_size = batch_size or (default_batch_size(prompts[0].device) if prompts else 1)
    if single(target_model) or not prompts:
        results = []
        for ids in prompts:
            results.append((yield from greedy_steps(target_model, ids, max_new_tokens, eos_ids)))
        return results
    device = prompts[0].device
    results: list = [None] * len(prompts)
    slots = min(batch_size, len(prompts))
    cache = slot_cache(target_model, prompts, 1, slots, None)
    rows, pending, free = [], list(range(len(prompts)))[::-1], list(range(slots))[::-1]

    def start(indices: list[int]) -> list[Started]:
        return prefill(target_model, None, indices, prompts, [None] * len(prompts), 0.0)

    def record(done: list[Row]) -> None:
        for r in done:
            results[r.index] = r.tokens

    while pending or rows:
        record((yield from refill(rows, cache, pending, free, prompts, start, max_new_tokens, eos_ids)))
        if not rows:
            continue
        last = torch.tensor([[r.tokens[-1]] for r in rows], device=device)
        positions = torch.tensor([[r.p] for r in rows], device=device)
        index = torch.tensor([r.slot for r in rows], device=device)
        tokens = cache.forward(index, last, positions)[:, -1].argmax(-1).tolist()
        cache.keep(index, torch.ones_like(index), 1)
        over = []
        for r, t in zip(rows, tokens):
            r.tokens.append(t)
            r.p += 1
            over.append(finished(r, [t], max_new_tokens, eos_ids))
        yield "baseline token"
        record(retire(rows, cache, over, free))
    return results


def baseline_steps(target_model: nn.Module, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                   eos_ids: Collection[int], batch_size: int | None, baselines: GreedyBaselines
                   ) -> Generator[str, None, list[list[int]]]:
    """The plain greedy output of every prompt: those ``baselines`` holds, the others
    decoded in batches (:func:`greedy_batch_steps`) and added to it."""
    keys = baselines.keys(target_model, prompts, max_new_tokens, eos_ids)
    missing = [k for k, key in enumerate(keys) if baselines.get(key) is None]
    if missing:
        found = yield from greedy_batch_steps(target_model, [prompts[k] for k in missing], max_new_tokens, eos_ids,
                                              batch_size)
        baselines.put({keys[k]: tokens for k, tokens in zip(missing, found)})
    return [baselines.get(key) for key in keys]
