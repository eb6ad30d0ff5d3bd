"""The tokenised dataset is cached: a second start loads it, any change re-tokenises (not
a change of mixing weights), and on a first start one process tokenises while the
others wait for it."""

import json
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch.multiprocessing as mp
from transformers import AutoTokenizer

import dflash.data.dataset
from dflash.data.dataset import DataSettings, load_dataset
from dflash.data.token_cache import Tokenised, tokenise_once
from dflash.model.target import resolve_path

GOOD = {"conversations": [{"role": "user", "content": "count from 3 to 9"}, {"role": "assistant", "content": "3 4 5 6 7 8 9"}]}
OTHER = {"conversations": [{"role": "user", "content": "count from 5 to 8"}, {"role": "assistant", "content": "5 6 7 8"}]}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_path("demo"))


@pytest.fixture
def calls(monkeypatch):
    """How many conversations were tokenised."""
    counted = []
    real = dflash.data.dataset.conversation_samples
    monkeypatch.setattr(dflash.data.dataset, "conversation_samples", lambda tok, m, kw: counted.append(1) or real(tok, m, kw))
    return counted


def write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "{broken\n")
    return path


def load(path, tokenizer, cache, max_len=320, **kw):
    path = str(path) if isinstance(path, Path) else [str(p) for p in path]
    return load_dataset(DataSettings(path, max_len, 2, cache_dir=cache, **kw), tokenizer)


def test_a_second_start_loads_what_the_first_tokenised(tmp_path, tokenizer, calls):
    data = write(tmp_path / "d.jsonl", [GOOD, OTHER, GOOD])
    first = load(data, tokenizer, tmp_path / "cache")
    assert len(calls) == 3
    second = load(data, tokenizer, tmp_path / "cache")
    assert len(calls) == 3, "nothing tokenised again"
    assert [s.source for s in second.samples] == [s.source for s in first.samples]
    for a, b in zip(first.samples, second.samples):
        assert list(a.input_ids) == list(b.input_ids) and list(a.loss_mask) == list(b.loss_mask)
    assert second.skipped == first.skipped == {"broken JSON": 1}


def test_a_moved_file_loads_from_the_cache_and_is_named_where_it_is_now(tmp_path, tokenizer, calls):
    old, new = tmp_path / "run:1", tmp_path / "new"  # a ':' in a path does not end its file name
    old.mkdir()
    new.mkdir()
    first = load(write(old / "d.jsonl", [GOOD, OTHER]), tokenizer, tmp_path / "cache")
    assert len(first.problems) == 1 and first.problems[0].startswith(f"{old / 'd.jsonl'}:3: broken JSON")
    moved = (old / "d.jsonl").rename(new / "d.jsonl")
    second = load(moved, tokenizer, tmp_path / "cache")
    assert len(calls) == 2, "loaded from the cache"
    assert second.problems == [p.replace(str(old), str(new)) for p in first.problems]
    assert [s.source for s in second.samples] == [f"{moved}:1", f"{moved}:2"]


def test_a_changed_file_or_option_tokenises_again(tmp_path, tokenizer, calls):
    data = write(tmp_path / "d.jsonl", [GOOD, OTHER])
    load(data, tokenizer, tmp_path / "cache")
    write(data, [GOOD, OTHER, OTHER])  # the file changed
    assert len(load(data, tokenizer, tmp_path / "cache")) == 3
    assert len(calls) == 2 + 3
    load(data, tokenizer, tmp_path / "cache", max_len=100)  # another option
    assert len(calls) == 2 + 3 + 3


def test_a_changed_parquet_file_or_saved_dataset_tokenises_again(tmp_path, tokenizer, calls):
    import datasets  # here, not at the top: the spawned processes below import this module

    parquet, saved = tmp_path / "d.parquet", tmp_path / "saved"
    datasets.Dataset.from_list([GOOD, OTHER]).to_parquet(parquet)
    datasets.Dataset.from_list([GOOD]).save_to_disk(saved)
    load([parquet, saved], tokenizer, tmp_path / "cache")
    load([parquet, saved], tokenizer, tmp_path / "cache")
    assert len(calls) == 3
    datasets.Dataset.from_list([OTHER]).save_to_disk(saved)
    load([parquet, saved], tokenizer, tmp_path / "cache")
    assert len(calls) == 3 + 3
    datasets.Dataset.from_list([OTHER, GOOD]).to_parquet(parquet)
    load([parquet, saved], tokenizer, tmp_path / "cache")
    assert len(calls) == 3 + 3 + 3


def test_weights_reuse_the_cache_and_the_grouping_of_paths_does_not(tmp_path, tokenizer, calls):
    a, b = write(tmp_path / "a.jsonl", [GOOD, OTHER]), write(tmp_path / "b.jsonl", [GOOD])
    mixed = load([a, b], tokenizer, tmp_path / "cache", weights=[1, 2])
    assert len(mixed) == 4 and len(calls) == 3
    assert len(load([a, b], tokenizer, tmp_path / "cache", weights=[0.5, 3])) == 4 and len(calls) == 3
    load(tmp_path, tokenizer, tmp_path / "cache")  # the same files as one source
    assert len(calls) == 6
    load([a, b], tokenizer, tmp_path / "cache", template_kwargs={"enable_thinking": False})
    assert len(calls) == 9


def test_strict_fails_from_the_cache_too(tmp_path, tokenizer):
    data = write(tmp_path / "d.jsonl", [GOOD])
    load(data, tokenizer, tmp_path / "cache")
    with pytest.raises(ValueError, match=r"(?s)data.strict=true and 1 bad.*d.jsonl:2: broken JSON"):
        load_dataset(DataSettings(str(data), 320, 2, strict=True, cache_dir=tmp_path / "cache"), tokenizer)


def _slow_tokenise(marker_dir: str) -> Tokenised:
    Path(marker_dir, f"tokenised_by_{os.getpid()}").touch()
    time.sleep(1.5)
    return Tokenised([np.arange(5)], [np.ones(5, dtype=np.uint8)], ["x:1"], {}, [])


def _racer(rank: int, cache: str, markers: str, out: str) -> None:
    data, cached = tokenise_once(Path(cache), "samekey", lambda: _slow_tokenise(markers), wait_s=60)
    Path(out, f"rank{rank}").write_text(json.dumps([list(map(int, data.ids[0])), cached]))


def test_on_a_first_start_one_process_tokenises_and_the_others_wait(tmp_path):
    markers, out = tmp_path / "markers", tmp_path / "out"
    markers.mkdir(), out.mkdir()
    mp.start_processes(_racer, args=(str(tmp_path / "cache"), str(markers), str(out)), nprocs=3, join=True,
                       start_method="spawn")
    assert len(list(markers.iterdir())) == 1
    results = [json.loads((out / f"rank{r}").read_text()) for r in range(3)]
    assert all(ids == [0, 1, 2, 3, 4] for ids, _ in results)
    assert sorted(cached for _, cached in results) == [False, True, True]


def test_a_cache_written_between_the_look_and_the_lock_is_read_not_made_again(tmp_path, monkeypatch):
    """Another process may save the cache and let go of its lock after this one looked for the
    file and before it took the lock: the file is looked for again under the lock."""
    import dflash.data.token_cache as token_cache

    cache = tmp_path / "cache"
    made = []
    first, _ = tokenise_once(cache, "first", lambda: _slow_tokenise(str(tmp_path)), wait_s=5)
    real_open = os.open

    def open_after_the_other_finished(path, *args):
        if str(path).endswith("k.lock") and not (cache / "k.npz").exists():
            (cache / "first.npz").rename(cache / "k.npz")  # the other process's save, just now
        return real_open(path, *args)

    monkeypatch.setattr(token_cache.os, "open", open_after_the_other_finished)
    data, cached = tokenise_once(cache, "k", lambda: made.append(1) or first, wait_s=5)
    assert cached and made == [] and data.ids[0].tolist() == first.ids[0].tolist()
    assert not (cache / "k.lock").exists()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    (cache / "k.lock").write_text(f"{socket.gethostname()} {dead.pid}\n")
    data, cached = tokenise_once(cache, "k", lambda: _slow_tokenise(str(tmp_path)), wait_s=5)
    assert not cached and len(data.ids) == 1 and not (cache / "k.lock").exists()
