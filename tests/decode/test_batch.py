"""Batched decoding: every row gives the tokens and acceptance lengths of the batch-1
loop, with ragged acceptance, continuous refill, sampling, DFlash2 and sliding drafters;
targets whose cache cannot be cut back per row decode one prompt at a time; the plain
greedy baseline is kept by target, prompt and budget."""

import random

import pytest
import torch
from helpers import (
    OneHotHead,
    PromptScriptDrafter,
    acceptance_by_hand,
    family_target,
    greedy_reference,
    tiny_drafter,
    varied_target,
)
from torch import nn
from transformers import DynamicCache

from dflash.decode.baseline import GreedyBaselines, fingerprint
from dflash.decode.batch import (
    greedy_batch_steps,
    prefill_groups,
    single,
    speculative_batch_steps,
)
from dflash.decode.slots import SlotCache
from dflash.decode.speculative import (
    greedy_generate,
    run_to_end,
    speculative_generate,
    with_cache,
)
from dflash.model.drafter import FULL, SLIDING, DFlash2Config, DFlashDrafter, TargetHead

pytestmark = pytest.mark.usefixtures("one_thread")

B = 4
VOCAB = 96
MAX_NEW = 24


@pytest.fixture(scope="module")
def target64() -> nn.Module:
    return varied_target(vocab=VOCAB).double()


def prompts(count: int, seed: int = 0) -> list[torch.Tensor]:
    """Prompts of different lengths (5 to 5 + 3 * (count - 1) tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (1, 5 + 3 * i), generator=g) for i in range(count)]


def random_drafter(seed: int = 0, **config) -> nn.Module:
    drafter = tiny_drafter(vocab=VOCAB, block_size=B, seed=seed, **config).double().eval()
    drafter.reset_parameters(0.2)
    return drafter


def batch_one(target, drafter, head, ids: list[torch.Tensor], temperature: float = 0.0, **kwargs):
    return [speculative_generate(target, drafter, head, p, max_new_tokens=MAX_NEW, temperature=temperature,
                                 generator=torch.Generator().manual_seed(i), **kwargs) for i, p in enumerate(ids)]


def batched(target, drafter, head, ids: list[torch.Tensor], temperature: float = 0.0, batch_size: int = 3, **kwargs):
    generators = [torch.Generator().manual_seed(i) for i in range(len(ids))]
    return run_to_end(speculative_batch_steps(target, drafter, head, ids, max_new_tokens=MAX_NEW,
                                              temperature=temperature, generators=generators, batch_size=batch_size,
                                              **kwargs))


def prefix_drafter(target: nn.Module, ids: list[torch.Tensor], wrong: float) -> PromptScriptDrafter:
    """Proposes each prompt's greedy continuation, wrong at scripted positions: many
    acceptance lengths, different per row."""
    scripts = []
    for k, p in enumerate(ids):
        seq = greedy_reference(target, p[0].tolist(), p.shape[1] + MAX_NEW + B)
        rng = random.Random(k)
        scripts.append((seq, [(t + 1) % VOCAB if rng.random() < wrong else t for t in seq]))
    return PromptScriptDrafter(tiny_drafter(vocab=VOCAB, block_size=B).config, target, scripts, torch.float64, 1e-9)


def test_ragged_acceptance_gives_every_row_the_batch_one_result(target64):
    """Rows accept different numbers of drafts each cycle; 7 prompts through 3 places
    (rows finish and others join); each row equals the batch-1 loop and plain greedy."""
    ids = prompts(7)
    drafter = prefix_drafter(target64, ids, wrong=0.3)
    head = OneHotHead(VOCAB, torch.float64)
    expected = batch_one(target64, drafter, head, ids)
    assert batched(target64, drafter, head, ids) == expected
    assert [tokens for tokens, _ in expected] == [greedy_generate(target64, p, MAX_NEW) for p in ids]
    assert len({n for _, lengths in expected for n in lengths}) == B


def test_one_prompt_at_a_time_runs_the_slot_cache_as_the_batch_one_loop(target64, monkeypatch):
    """Batch 1 decodes through the slot cache too (its fixed shapes replay as CUDA graphs on a
    GPU), the drafter's forward recorded over all of the cache's columns: each prompt gives
    the eager batch-1 loop's tokens and acceptance lengths, with scripted drafts that are
    often kept, and with random ones over 120 tokens, where the cache grows and the drafter's
    forward is recorded again at the new width."""
    widths = []
    record_drafts = SlotCache.record_drafts
    monkeypatch.setattr(SlotCache, "record_drafts", lambda cache, fn: (widths.append(cache.columns),
                                                                       record_drafts(cache, fn))[1])
    ids = prompts(3, seed=4)
    drafter, head = prefix_drafter(target64, ids, wrong=0.3), OneHotHead(VOCAB, torch.float64)
    expected = batch_one(target64, drafter, head, ids)
    assert batched(target64, drafter, head, ids, batch_size=1) == expected
    assert batched(target64, drafter, head, ids[:1], batch_size=4) == expected[:1]  # one prompt: one slot
    assert max(n for _, lengths in expected for n in lengths) == B and len(widths) == 2
    widths.clear()
    drafter, head = random_drafter(seed=3), TargetHead.of(target64)
    long = [speculative_generate(target64, drafter, head, p, max_new_tokens=120) for p in ids[:1]]
    assert run_to_end(speculative_batch_steps(target64, drafter, head, ids[:1], max_new_tokens=120,
                                              batch_size=1)) == long
    assert len(widths) == 2 and widths[1] > widths[0]  # grown once, and recorded again


def test_a_stop_token_accepted_among_the_drafts_ends_that_rows_cycles(target64):
    """Rows whose stop token arrives among accepted drafts end with that cycle, as the
    hand-counted loop does; the others run on to their budget or their own stop."""
    ids = prompts(6, seed=6)
    drafter = prefix_drafter(target64, ids, wrong=0.3)
    head = OneHotHead(VOCAB, torch.float64)
    new = []  # per row: the target's new tokens and the drafts proposed for them
    for p, (_, proposals) in zip(ids, drafter.scripts):
        seq = greedy_reference(target64, p[0].tolist(), p.shape[1] + MAX_NEW + B)
        new.append((seq[p.shape[1]:], proposals.tolist()[p.shape[1]:]))

    def by_hand(eos):
        return [acceptance_by_hand(greedy, proposals, B, MAX_NEW, {eos}) for greedy, proposals in new]

    eos = next(t for t in range(VOCAB) if sum(how == "draft" for _, how in by_hand(t)) >= 2)
    results = batched(target64, drafter, head, ids, eos_ids={eos})
    assert [lengths for _, lengths in results] == [lengths for lengths, _ in by_hand(eos)]
    assert [tokens for tokens, _ in results] == [greedy_generate(target64, p, MAX_NEW, {eos}) for p in ids]
    assert results == batch_one(target64, drafter, head, ids, eos_ids={eos})


def test_a_real_drafter_greedy_and_sampled(target64):
    """A random drafter (mostly rejected: the cache is compacted often) greedy, and
    sampled with each row's own generator."""
    drafter, head, ids = random_drafter(), TargetHead.of(target64), prompts(5, seed=1)
    for temperature in (0.0, 1.0):
        assert batched(target64, drafter, head, ids, temperature) == batch_one(target64, drafter, head, ids,
                                                                               temperature)


@pytest.mark.parametrize("layer_types", [[SLIDING] * 2, [SLIDING, FULL]], ids=["all-sliding", "mixed"])
def test_sliding_drafters_batch_with_their_windows(target64, layer_types):
    drafter, ids = random_drafter(layer_types=layer_types, sliding_window=3), prompts(4, seed=2)
    head = TargetHead.of(target64)
    assert batched(target64, drafter, head, ids) == batch_one(target64, drafter, head, ids)


@pytest.mark.parametrize("block_size", [B, 3], ids=["own-block", "other-block"])
def test_a_dflash2_drafter_walks_each_row(target64, block_size):
    """The selector's path walk drafts row by row; at another block size than its own the
    drafter's forward runs row by row too."""
    torch.manual_seed(0)
    cfg = tiny_drafter(vocab=VOCAB, block_size=B).config
    cfg.dflash2 = DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    drafter = DFlashDrafter(cfg).double().eval()
    drafter.reset_parameters(0.2)
    head, ids = TargetHead.of(target64), prompts(4, seed=3)
    for temperature in (0.0, 1.0):
        assert (batched(target64, drafter, head, ids, temperature, block_size=block_size)
                == batch_one(target64, drafter, head, ids, temperature, block_size=block_size))


def test_greedy_baseline_in_batches_stops_per_row(target64):
    ids = prompts(6, seed=4)
    eos = greedy_generate(target64, ids[2], MAX_NEW)[5]  # row 2 stops early
    expected = [greedy_generate(target64, p, MAX_NEW, {eos}) for p in ids]
    assert run_to_end(greedy_batch_steps(target64, ids, MAX_NEW, {eos}, batch_size=4)) == expected
    assert len(expected[2]) == 6


@pytest.mark.parametrize("name,alone", [("qwen3", False), ("llama3", False), ("gemma3", True), ("qwen3_5", True)])
def test_caches_that_cannot_be_cut_per_row_decode_one_prompt_at_a_time(name, alone):
    target = family_target(name, num_layers=4, vocab=VOCAB).double()
    assert single(target) is alone
    drafter, head, ids = random_drafter(), TargetHead.of(target), prompts(3, seed=5)
    drafter.config.num_target_layers = 4
    assert batched(target, drafter, head, ids) == batch_one(target, drafter, head, ids)


def test_a_slot_cache_compacts_to_each_rows_columns(target64):
    """After rejections, compaction and growth each row's next-token logits equal those
    of a cache of its own accepted tokens only, a free slot beside them, and its held
    columns carry its positions in order and its own context (kept with the positions the
    forward that made it was given)."""
    ids = prompts(2, seed=6)

    def features(hidden_states, positions):
        return [hidden_states[-1], positions[..., None].to(hidden_states[-1].dtype)]

    cache = SlotCache(target64, slots=3, columns=20, features=features, slack=4)
    cache.record(B)
    cache.record(1)
    slots = torch.tensor([2, 0])
    with torch.no_grad():
        for slot, p in zip(slots.tolist(), ids):
            row = DynamicCache(config=target64.config)
            out = with_cache(target64, row, input_ids=p, output_hidden_states=True)
            cache.join(slot, [(layer.keys, layer.values) for layer in row.layers],
                       features(out.hidden_states, torch.arange(p.shape[1])[None]))
        blocks = torch.randint(0, VOCAB - 1, (6, 2, B), generator=torch.Generator().manual_seed(0))
        kept, length = [[], []], [p.shape[1] for p in ids]
        for block, keep in zip(blocks, ([1, 4], [4, 1]) * 3):
            positions = torch.tensor(length)[:, None] + torch.arange(B)
            cache.forward(slots, block, positions)
            cache.keep(slots, torch.tensor(keep), B)
            for r in range(2):
                kept[r] += block[r, : keep[r]].tolist()
                length[r] += keep[r]
        assert cache.used < ids[1].shape[1] + 6 * B and cache.columns > 20  # compacted and grown on the way
        nxt = torch.tensor([[7], [8]])
        logits = cache.forward(slots, nxt, torch.tensor(length)[:, None])[:, -1]
        for r, p in enumerate(ids):
            sequence = torch.cat([p, torch.tensor([kept[r] + [7 + r]])], dim=1)
            alone = target64(input_ids=sequence, output_hidden_states=True)
            torch.testing.assert_close(logits[r], alone.logits[0, -1], rtol=1e-9, atol=1e-9)
            held = cache.valid[slots[r]]  # the next token's column counts as held until keep()
            assert cache.positions[slots[r], held].tolist() == list(range(sequence.shape[1]))
            context, at = (t[slots[r], held] for t in cache.drafter_kv)
            torch.testing.assert_close(context[-1], alone.hidden_states[-1][0, -1], rtol=1e-9, atol=1e-9)
            assert at[:, 0].tolist() == list(range(sequence.shape[1]))


def test_prompts_are_prefilled_together_within_the_token_budget():
    lengths = [5, 9, 3, 30, 4, 4]
    ids = [torch.zeros(1, n, dtype=torch.long) for n in lengths]
    groups = prefill_groups(ids, list(range(6)), tokens=20)
    assert groups == [[2, 4, 5, 0], [1], [3]]  # shortest first: 4 x 5 fits, 5 x 9 > 20; 30 alone
    assert sorted(sum(groups, [])) == list(range(6))


def test_baselines_are_keyed_by_the_weights_and_kept_in_their_file(tmp_path, target64):
    other = varied_target(vocab=VOCAB, seed=2).double()
    assert fingerprint(target64) == fingerprint(varied_target(vocab=VOCAB).double()) != fingerprint(other)
    store, ids = GreedyBaselines(tmp_path / "b.json"), prompts(2)
    keys = store.keys(target64, ids, MAX_NEW, {1})
    assert len(set(keys)) == 2 and keys != store.keys(other, ids, MAX_NEW, {1}) != store.keys(target64, ids, 8, {1})
    store.put({keys[0]: [1, 2, 3]})
    assert GreedyBaselines(tmp_path / "b.json").get(keys[0]) == [1, 2, 3]
    (tmp_path / "b.json").write_text("{broken")
    assert GreedyBaselines(tmp_path / "b.json").get(keys[0]) is None
