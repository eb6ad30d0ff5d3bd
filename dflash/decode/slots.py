"""The target's side of batched decoding: a KV cache of fixed shape, and its forwards
replayed as CUDA graphs.

A target forward at decoding shapes (a few tokens per row) is launch-bound in eager HF:
at Qwen3-8B shapes on the H200 a greedy step of 32 rows took about 43 ms, against 3.5 ms to
read the weights once (docs/benchmarks/2026-12-01-h200-decoding-dflash2-moe.md, "Decoding speed"). With every shape fixed, the
forward can be recorded once as a CUDA graph and replayed for the price of copying its
inputs.

:class:`SlotCache` holds ``slots`` rows, each in its own slot of per-layer buffers
``[slots, heads, columns, head_dim]``. Every forward of ``q`` tokens writes columns
``used..used+q-1`` of every slot (a free slot computes padding that nobody reads), and a
float mask ``[slots, 1, q, columns]`` says which columns each row holds: its own tokens
and, among the new columns, the causal ones. Rows therefore keep their own lengths in
shared columns. RoPE is applied before keys are cached, so a key's column does not
matter, only that it is held. A rejected draft's column is let go in the mask (its key
stays, unread); when the next forward would not fit, every row's held columns are moved
to the front (:meth:`SlotCache.compact`). A prefilled prompt joins a free slot with its
keys written just before ``used``. Beside the keys the cache keeps each column's position
and, for speculative decoding, the drafter's context of that position (every drafter
layer's keys and values of the features the forward captured), so the drafter reads its
rows' contexts where they are. The
mask is handed to the model ready-made (4D masks are used as given), and the attention
is :mod:`dflash.model.attention`'s, which reads the grouped keys without copying them.

On CUDA each query length's forward (the block of a verification, one token of the
greedy baseline) is recorded once per decoding with all buffers in place; a model whose
forward makes the host wait for the device (a data-dependent MoE dispatch, a dynamic
RoPE) cannot be recorded and runs eagerly on the same cache.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache

from dflash.decode.speculative import with_cache
from dflash.model.attention import GROUPED, attention_implementation

log = logging.getLogger(__name__)

# what a forward keeps for the drafter, from its hidden states (output_hidden_states) and
# positions [slots, q]: tensors [slots, q, F]
Features = Callable[[tuple[torch.Tensor, ...], torch.Tensor], list[torch.Tensor]]

SLACK_FORWARDS = 16  # free columns kept beyond the longest row, in forwards


class SlotKV(Cache):
    """Per-layer key and value buffers of ``slots`` rows by ``columns`` columns, which a
    forward's HF attention layers write at ``write_at`` (allocated by the first forward or
    join, at the shapes the layers give)."""

    def __init__(self, slots: int, columns: int):
        super().__init__(layers=[])
        self.slots, self.columns = slots, columns
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.write_at: torch.Tensor | None = None  # [q], the columns the running forward writes

    def allocate(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The buffers of ``layer`` (the next one), shaped after ``[.., heads, .., dim]`` states."""
        assert layer == len(self.keys), "layers are allocated in order"
        for store, like in ((self.keys, keys), (self.values, values)):
            store.append(like.new_zeros(self.slots, like.shape[1], self.columns, like.shape[3]))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == len(self.keys):
            self.allocate(layer_idx, key_states, value_states)
        self.keys[layer_idx].index_copy_(2, self.write_at, key_states)
        self.values[layer_idx].index_copy_(2, self.write_at, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and masks always come with the inputs


@dataclass
class Recorded:
    """One query length's forward: its input buffers, and its outputs (``graph`` is None
    where it runs eagerly: the CPU, or a model that cannot be recorded)."""

    input_ids: torch.Tensor  # [slots, q]
    positions: torch.Tensor  # [slots, q]
    mask: torch.Tensor  # [slots, 1, q, columns], 0 where a query may look, the dtype's minimum elsewhere
    write_at: torch.Tensor  # [q]
    causal: torch.Tensor  # [q, q], the new columns' part of the mask
    run: Callable[[], torch.Tensor]  # the logits [slots, q, V]
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the recorded run's


@dataclass
class Drafting:
    """The drafter's forward over every slot (:meth:`SlotCache.record_drafts`): its input
    buffers, each slot's newest token and its position, and its drafts ``[slots, B-1]``
    (``graph`` is None where it runs eagerly)."""

    draft: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (last, p) -> drafts, read from the cache
    last: torch.Tensor  # [slots]
    p: torch.Tensor  # [slots]
    graph: torch.cuda.CUDAGraph | None = None
    drafts: torch.Tensor | None = None  # the recorded run's

    def run(self) -> torch.Tensor:
        return self.draft(self.last, self.p)


def capture(run: Callable[[], torch.Tensor], what: str) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]:
    """``run`` recorded as a CUDA graph, and the output its replays write: run twice on a
    side stream first (allocating its buffers, loading the kernels), the second time with
    host waits refused. A run that makes the host wait for the device cannot be recorded:
    ``(None, None)``, with a warning naming ``what`` runs eagerly."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            run()
            torch.cuda.set_sync_debug_mode("error")
            try:
                run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    except RuntimeError as e:
        torch.cuda.current_stream().wait_stream(side)
        log.warning("%s runs eagerly: it makes the host wait for the device (%s)", what, str(e).splitlines()[0])
        return None, None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()  # a collection inside the capture could free an earlier graph, which ends the capture
    try:
        with torch.cuda.graph(graph):  # collects what is garbage first
            out = run()
    finally:
        if collecting:
            gc.enable()
    return graph, out


class SlotCache:
    """Rows decoding together in the fixed slots of one :class:`SlotKV`; :meth:`forward`
    runs the target over ``q`` new tokens of every slot, recorded per ``q``."""

    def __init__(self, model: nn.Module, slots: int, columns: int, features: Features | None = None, slack: int = 64):
        self.model, self.features, self.slack = model, features, slack
        self.kv = SlotKV(slots, columns)
        self.device = model.get_output_embeddings().weight.device
        self.dtype = model.get_output_embeddings().weight.dtype
        self.valid = torch.zeros(slots, columns, dtype=torch.bool, device=self.device)
        self.positions = torch.zeros(slots, columns, dtype=torch.long, device=self.device)  # each column's position
        self.drafter_kv: list[torch.Tensor] = []  # [slots, columns, F] each: what ``features`` made of each column
        self.used = 0
        self.recorded: dict[int, Recorded] = {}
        self.drafting: Drafting | None = None

    @property
    def slots(self) -> int:
        return self.kv.slots

    @property
    def columns(self) -> int:
        return self.kv.columns

    def additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A mask in the model's dtype: 0 where ``allowed``, the dtype's minimum elsewhere
        (added to the attention scores, by SDPA and eager attention alike)."""
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill(
            ~allowed, torch.finfo(self.dtype).min)

    def record(self, q: int) -> None:
        """Prepare the forward of ``q`` tokens per slot: on CUDA, run it twice on a side
        stream (allocating the buffers, loading the kernels) and record it. Those runs
        write the last ``q`` columns, which no row holds (:meth:`forward` keeps ``q``
        columns free)."""
        slots, columns = self.slots, self.columns
        scratch = slice(columns - q, columns)
        r = Recorded(
            input_ids=torch.zeros(slots, q, dtype=torch.long, device=self.device),
            positions=torch.zeros(slots, q, dtype=torch.long, device=self.device),
            mask=self.additive(torch.zeros(slots, 1, q, columns, dtype=torch.bool, device=self.device)),
            write_at=torch.arange(columns - q, columns, device=self.device),
            causal=self.additive(torch.ones(q, q, dtype=torch.bool, device=self.device).tril()),
            run=lambda: r.input_ids,
        )
        r.mask[..., scratch] = r.causal

        def run() -> torch.Tensor:
            self.kv.write_at = r.write_at
            with attention_implementation(self.model, GROUPED):
                out = with_cache(self.model, self.kv, input_ids=r.input_ids, position_ids=r.positions,
                                 attention_mask=r.mask, output_hidden_states=self.features is not None)
            self.positions.index_copy_(1, r.write_at, r.positions)
            if self.features is not None:
                self.store_context(r.write_at, self.features(out.hidden_states, r.positions))
            return out.logits

        r.run = run
        self.recorded[q] = r
        if self.device.type == "cuda":
            r.graph, r.logits = capture(run, f"the target's forward of {q} tokens per row")

    def resize(self, columns: int) -> None:
        """Room for ``columns`` columns: the buffers move, every forward is recorded again."""
        for buffers in (self.kv.keys, self.kv.values):
            for i, t in enumerate(buffers):
                grown = t.new_zeros(*t.shape[:2], columns, t.shape[3])
                grown[:, :, : self.used] = t[:, :, : self.used]
                buffers[i] = grown
        def grown(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(self.slots, columns, *t.shape[2:])
            out[:, : self.used] = t[:, : self.used]
            return out

        self.valid, self.positions = grown(self.valid), grown(self.positions)
        self.drafter_kv = [grown(t) for t in self.drafter_kv]
        self.kv.columns = columns
        for q in list(self.recorded):
            self.record(q)
        if self.drafting is not None:
            self.record_drafts(self.drafting.draft)

    def record_drafts(self, draft: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Prepare the drafter's forward over every slot: ``draft(last, p)`` gives every
        slot's drafts ``[slots, B-1]`` from its newest token ``last [slots]`` at position
        ``p [slots]`` and the context this cache holds (:attr:`drafter_kv`, :attr:`valid`,
        :attr:`positions`, all columns: a fixed shape, so on CUDA it is recorded, again
        after every growth). A free slot drafts from no context; nobody reads it."""
        d = Drafting(draft, last=torch.zeros(self.slots, dtype=torch.long, device=self.device),
                     p=torch.zeros(self.slots, dtype=torch.long, device=self.device))
        self.drafting = d
        if self.device.type == "cuda":
            d.graph, d.drafts = capture(d.run, "the drafter's forward")

    def draft(self, slots: torch.Tensor, last: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """The drafts ``[b, B-1]`` of the rows in ``slots [b]`` (:meth:`record_drafts`)."""
        d = self.drafting
        d.last.zero_()
        d.p.zero_()
        d.last[slots] = last
        d.p[slots] = p
        if d.graph is None:
            return d.run()[slots]
        d.graph.replay()
        return d.drafts[slots]

    def context_buffers(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """:attr:`drafter_kv`, allocated at the first write, shaped after ``like [.., F]``."""
        if not self.drafter_kv:
            self.drafter_kv = [t.new_zeros(self.slots, self.columns, t.shape[-1]) for t in like]
        return self.drafter_kv

    def store_context(self, columns: torch.Tensor, context: list[torch.Tensor]) -> None:
        """``context``, tensors ``[slots, q, F]``, into ``columns [q]`` of every slot."""
        for buffer, t in zip(self.context_buffers(context), context):
            buffer.index_copy_(1, columns, t)

    def join(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]],
             context: list[torch.Tensor] | None = None) -> None:
        """Put a prefilled row into the free ``slot``: its keys and values per layer
        ``[1, h, S, d]`` and its drafter context (tensors ``[1, S, F]``), at positions
        ``0..S-1``, in the columns just before ``used`` (``used`` moves up if the row is
        longer)."""
        length = layers[0][0].shape[2]
        self.make_room(max(self.used, length) - self.used)
        self.used = max(self.used, length)
        at = slice(self.used - length, self.used)
        for i, (keys, values) in enumerate(layers):
            if i == len(self.kv.keys):
                self.kv.allocate(i, keys, values)
            self.kv.keys[i][slot, :, at] = keys[0]
            self.kv.values[i][slot, :, at] = values[0]
        self.positions[slot, at] = torch.arange(length, device=self.device)
        if context is not None:
            for buffer, t in zip(self.context_buffers(context), context):
                buffer[slot, at] = t[0]
        self.valid[slot] = False
        self.valid[slot, at] = True

    def leave(self, slot: int) -> None:
        self.valid[slot] = False

    def forward(self, slots: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The target over ``input_ids [b, q]`` at ``positions`` for the rows in ``slots [b]``:
        their logits ``[b, q, V]``; what ``features`` makes of the hidden states goes to
        :attr:`drafter_kv`. The ``q`` new columns count as held until :meth:`keep`."""
        q = input_ids.shape[1]
        self.make_room(q)
        r = self.recorded[q]
        r.input_ids.zero_()
        r.positions.zero_()
        r.input_ids[slots] = input_ids
        r.positions[slots] = positions
        torch.add(torch.arange(q, device=self.device), self.used, out=r.write_at)
        new = slice(self.used, self.used + q)
        self.valid[:, new] = True
        r.mask.copy_(self.additive(self.valid)[:, None, None, :].expand_as(r.mask))
        r.mask[:, 0, :, new] = r.causal
        self.used += q
        if r.graph is None:
            logits = r.run()
        else:
            r.graph.replay()
            logits = r.logits
        return logits[slots]

    def keep(self, slots: torch.Tensor, kept: torch.Tensor, q: int) -> None:
        """After a forward of ``q`` tokens, the row in ``slots[i]`` holds only the first
        ``kept[i]`` of them; free slots hold none."""
        new = slice(self.used - q, self.used)
        held = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        held[slots] = kept
        self.valid[:, new] = torch.arange(q, device=self.device)[None] < held[:, None]

    def make_room(self, q: int) -> None:
        """Columns for ``q`` more and the recorded forwards' scratch: the held columns are
        moved to the front when the cache is full, and if that leaves less than half the
        slack free, the cache grows by half (each growth records the forwards again, so
        growths are few: about 2.5 per doubling of the longest row)."""
        scratch = max(self.recorded)
        if self.used + q + scratch <= self.columns:
            return
        self.compact()
        need = self.used + q + scratch
        if need + self.slack // 2 > self.columns:
            self.resize(round_up(max(need + self.slack, self.columns * 3 // 2)))

    def compact(self) -> None:
        """Move every row's held columns (keys, values, positions, context) to the front of
        its slot, in order."""
        held = self.valid.sum(1)
        width = int(held.max())
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :width]
        for buffers in (self.kv.keys, self.kv.values):
            for t in buffers:
                t[:, :, :width] = t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
        self.positions[:, :width] = self.positions.gather(1, order)
        for t in self.drafter_kv:
            t[:, :width] = t.gather(1, order[..., None].expand(-1, -1, t.shape[-1]))
        self.valid.copy_(torch.arange(self.columns, device=self.device)[None] < held[:, None])  # in place: recorded
        self.used = width


def round_up(columns: int) -> int:
    return -(-columns // 64) * 64


def slot_cache(model: nn.Module, prompts: list[torch.Tensor], q: int, slots: int,
               features: Features | None = None) -> SlotCache:
    """A :class:`SlotCache` for these prompts, with the forward of ``q`` tokens recorded:
    room for the longest prompt and ``SLACK_FORWARDS`` forwards, so that a full cache
    compacts at most every ``SLACK_FORWARDS / 2`` forwards; it grows as rows do."""
    slack = SLACK_FORWARDS * q
    longest = max(p.shape[1] for p in prompts)
    cache = SlotCache(model, slots, round_up(longest + q + slack), features, slack)
    cache.record(q)
    return cache
