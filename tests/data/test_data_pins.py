"""Regression pins of the data side: behaviours whose silent breakage would still train or
decode something, each checked against an independent reference (a hand count, the
template's own rendering) rather than against the code under test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import tiny_target, word_tokenizer

from dflash.data.dataset import DataSettings, load_dataset
from dflash.data.order import SampleOrder
from dflash.data.template import reply_end_ids
from dflash.data.token_cache import cache_key
from dflash.distributed.topology import Topology

pytestmark = pytest.mark.usefixtures("one_thread")


# reply end ids ---------------------------------------------------------------------------


def test_reply_end_ids_hold_the_templates_end_of_turn_token():
    """Decoding stops at the chat template's end-of-turn token even when neither the
    tokenizer's eos nor the generation config names it (else replies run on)."""
    tokenizer = word_tokenizer(96)
    model = tiny_target(vocab=96)
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # <|endoftext|>, not the turn's end
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w5 w6"}], tokenize=True, return_dict=False
    )
    end_of_turn = rendered[rendered.index(tokenizer.convert_tokens_to_ids("w6")) + 1]
    assert tokenizer.convert_ids_to_tokens(end_of_turn) == "<|im_end|>"
    assert end_of_turn not in {tokenizer.eos_token_id, model.generation_config.eos_token_id}
    assert end_of_turn in reply_end_ids(tokenizer, model.generation_config)
    model.generation_config.eos_token_id = None
    assert end_of_turn in reply_end_ids(tokenizer, model.generation_config)
    assert end_of_turn in reply_end_ids(tokenizer)  # training's call: the tokenizer alone


# the sample order ------------------------------------------------------------------------


@pytest.mark.parametrize("num_samples", [40, 43])
def test_an_epoch_is_a_permutation_over_all_ranks_and_epochs_differ(num_samples: int):
    """Over one epoch the micro-batches of every target rank (and of every drafter rank)
    cover each sample at most once and all but the dropped remainder; the next epoch
    visits them in another order."""
    world, targets, micro, batch = 4, 2, 2, 8
    order = SampleOrder(num_samples, batch, micro, seed=3)
    per_epoch = (num_samples // batch) * (batch // micro)
    ranks = [Topology(world, r, targets, micro, batch) for r in range(world)]
    epochs = []
    for epoch in range(2):
        first, last = epoch * per_epoch, (epoch + 1) * per_epoch
        for who, ms in (("targets", [t.produced_by(t.rank, first, last) for t in ranks[:targets]]),
                        ("drafters", [t.consumed_by(t.rank, first, last) for t in ranks[targets:]])):
            assert sorted(m for part in ms for m in part) == list(range(first, last)), who
            seen: list[int] = []
            for part in ms:
                for m in part:
                    e, indices = order.micro_batch(m)
                    assert e == epoch and len(indices) == micro
                    seen += indices.tolist()
            assert len(seen) == len(set(seen)) == (num_samples // batch) * batch, who
            assert set(seen) <= set(range(num_samples)), who
        epochs.append([i for m in range(first, last) for i in order.micro_batch(m)[1].tolist()])
    if num_samples % batch == 0:
        assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(num_samples))
    assert epochs[0] != epochs[1]


# the token cache key ---------------------------------------------------------------------


def test_a_changed_chat_template_changes_the_cache_key_and_tokenises_again(tmp_path: Path):
    """The tokenised cache is keyed by the chat template: a new template re-tokenises and
    its samples carry the new rendering, never the stale cached one."""
    data = tmp_path / "d.jsonl"
    record = {"conversations": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4 w5"}]}
    data.write_text(json.dumps(record) + "\n")
    old, new, same = word_tokenizer(), word_tokenizer(), word_tokenizer()
    new.chat_template = "{{ 'w9 ' }}" + old.chat_template  # every rendering now starts with w9

    def key(tokenizer) -> str:
        return cache_key([[data]], tokenizer, max_len=64, min_loss_tokens=1, max_samples=None, template_kwargs={})

    def load(tokenizer):
        settings = DataSettings(str(data), max_len=64, min_loss_tokens=1, strict=True, cache_dir=tmp_path / "cache")
        return load_dataset(settings, tokenizer)

    assert key(old) == key(same)
    assert key(old) != key(new)
    first = load(old)
    second = load(new)
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2
    load(same)  # the first template again: read from the cache, nothing new written
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2
    w9 = new.convert_tokens_to_ids("w9")
    assert first.samples[0].input_ids[0] != w9
    assert second.samples[0].input_ids[0] == w9
    assert list(second.samples[0].input_ids[1:]) == list(first.samples[0].input_ids)
