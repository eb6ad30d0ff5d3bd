"""Reading data: every format and record shape, mixing weights, and bad input skipped and
counted with its file:line (or file:row), or rejected at start when strict."""

import json

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from dflash.data.dataset import DataSettings, conversation_samples, load_dataset, mix
from dflash.data.order import SampleOrder
from dflash.data.records import BadRecord, iter_records, parse_messages
from dflash.model.target import resolve_path


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_path("demo"))


GOOD = {"conversations": [{"role": "user", "content": "count from 3 to 9"}, {"role": "assistant", "content": "3 4 5 6 7 8 9"}]}
MESSAGES = [{"role": "user", "content": "count from 3 to 9"}, {"role": "assistant", "content": "3 4 5 6 7 8 9"}]
SHAPES = {
    "openai messages": {"messages": MESSAGES},
    "openai conversations": {"conversations": MESSAGES},
    "sharegpt": {"conversations": [{"from": "human", "value": "count from 3 to 9"},
                                   {"from": "gpt", "value": "3 4 5 6 7 8 9"}]},
    "prompt/response": {"prompt": "count from 3 to 9", "response": "3 4 5 6 7 8 9"},
    "instruction/output": {"instruction": "count from 3 to 9", "output": "3 4 5 6 7 8 9"},
}


def write(path, lines):
    path.write_bytes(b"".join(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode() for line in lines))
    return path


def load(path, tokenizer, **kw):
    return load_dataset(DataSettings(path, **{"max_len": 320, "min_loss_tokens": 2, "strict": False, **kw}), tokenizer)


# ---------------------------------------------------------------------------
# Record shapes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_each_record_shape_reads_as_the_same_conversation(shape):
    assert parse_messages(SHAPES[shape]) == MESSAGES


def test_alpaca_input_follows_the_instruction_and_a_system_field_leads():
    record = {"instruction": "count", "input": "from 3 to 9", "output": "3 4 5", "system": "Be terse."}
    assert parse_messages(record) == [{"role": "system", "content": "Be terse."},
                                      {"role": "user", "content": "count\n\nfrom 3 to 9"},
                                      {"role": "assistant", "content": "3 4 5"}]


def test_a_parquet_row_with_other_records_columns_reads_by_its_own():
    """A Parquet row holds every column of its file, None where its record had none."""
    row = {"messages": None, "conversations": [{"role": "user", "content": "a", "from": None, "value": None},
                                               {"from": "gpt", "value": "b", "role": None, "content": None}],
           "prompt": None, "response": None}
    assert parse_messages(row) == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


# ---------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------


def write_all_formats(root):
    """One file of each kind in ``root``, two records each, in every record shape."""
    root.mkdir()
    shapes = list(SHAPES.values())
    write(root / "a.jsonl", shapes[:2])
    (root / "b.json").write_text(json.dumps(shapes[2:4], indent=1))
    datasets.Dataset.from_list([SHAPES["openai messages"]] * 2).to_parquet(root / "c.parquet")
    datasets.Dataset.from_list([SHAPES["sharegpt"], SHAPES["sharegpt"]]).save_to_disk(root / "d")
    (root / "notes.txt").write_text("not data")
    return root


def test_a_directory_of_every_format_reads_in_name_order(tmp_path):
    root = write_all_formats(tmp_path / "data")
    where = [w.removeprefix(f"{root}/") for w, _ in iter_records(str(root))]
    assert where == ["a.jsonl:1", "a.jsonl:2", "b.json:2", "b.json:14", "c.parquet:0", "c.parquet:1", "d:0", "d:1"]
    assert all(parse_messages(r) == MESSAGES for _, r in iter_records(str(root)))


def test_a_list_of_paths_reads_in_its_order(tmp_path, tokenizer):
    root = write_all_formats(tmp_path / "data")
    ds = load([str(root / "d"), str(root / "a.jsonl"), str(root / "c.parquet")], tokenizer)
    assert [s.source.removeprefix(f"{root}/") for s in ds.samples] == ["d:0", "d:1", "a.jsonl:1", "a.jsonl:2",
                                                                      "c.parquet:0", "c.parquet:1"]
    first = ds.samples[0]
    assert tokenizer.decode([i for i, m in zip(first.input_ids, first.loss_mask) if m]) == "3 4 5 6 7 8 9 <|im_end|>"


def test_json_records_on_one_line_are_told_apart_by_column(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([GOOD, GOOD]))
    assert [w for w, _ in iter_records(str(path))] == [f"{path}:1", f"{path}:1:{len(json.dumps(GOOD)) + 4}"]


def test_a_path_that_cannot_be_read_is_an_error(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="not a .jsonl/.json/.parquet file"):
        list(iter_records(str(tmp_path / "d.csv")))
    with pytest.raises(FileNotFoundError, match="holds no"):
        list(iter_records(str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(iter_records([str(tmp_path / "gone.jsonl"), str(tmp_path / "d.csv")]))


# ---------------------------------------------------------------------------
# Mixing weights
# ---------------------------------------------------------------------------


def test_weights_repeat_whole_and_fractional_shares(tmp_path, tokenizer):
    a = write(tmp_path / "a.jsonl", [GOOD] * 4)
    b = write(tmp_path / "b.jsonl", [GOOD] * 10)
    ds = load([str(a), str(b)], tokenizer, weights=[2, 0.5], seed=3)
    sources = [s.source for s in ds.samples]
    assert sum(s.startswith(str(a)) for s in sources) == 8 and sum(s.startswith(str(b)) for s in sources) == 5
    assert sources == [s.source for s in load([str(a), str(b)], tokenizer, weights=[2, 0.5], seed=3).samples]
    assert len(load([str(a), str(b)], tokenizer, weights=[0, 1.3]).samples) == 13


def test_the_fractional_share_is_seeded():
    origins = [0] * 100
    assert (mix(origins, [0.5], seed=1) == mix(origins, [0.5], seed=1)).all()
    assert not np.array_equal(mix(origins, [0.5], seed=1), mix(origins, [0.5], seed=2))
    assert len(mix(origins, [1.5], seed=1)) == 150 and len(np.unique(mix(origins, [1.5], seed=1))) == 100


@pytest.mark.parametrize("weights, match", [([1], "1 entries for 2"), ([1, -1], ">= 0"), ([0, 0], "leave no sample")])
def test_bad_weights_are_errors(tmp_path, tokenizer, weights, match):
    a = write(tmp_path / "a.jsonl", [GOOD] * 2)
    with pytest.raises(ValueError, match=match):
        load([str(a), str(a)], tokenizer, weights=weights)


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------

BAD_LINES = {
    "broken JSON": b"{not json\n",
    "unknown role": {"conversations": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
    "empty reply": {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
    "no assistant turn": {"conversations": [{"role": "user", "content": "hi"}]},
    "bad turn": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ["3", "4"]}]},
    "bad UTF-8": b'{"conversations": [{"role": "user", "content": "\xff\xfe"}]}\n',
    "no conversation": {"text": "count from 3 to 9"},
    "not a JSON object": [1, 2],
    "starts with the assistant": {"messages": [{"role": "assistant", "content": "hi"},
                                               {"role": "user", "content": "x"}]},
    "too long": {"conversations": [{"role": "user", "content": "count from 1 to 400"},
                                   {"role": "assistant", "content": " ".join(map(str, range(1, 401)))}]},
}


def bad_files(root):
    """Every kind of bad input, each once, with one good record per readable file."""
    root.mkdir()
    write(root / "a.jsonl", [GOOD, *BAD_LINES.values(), GOOD])
    (root / "b.jsonl").write_bytes(b"")
    (root / "c.json").write_text("[]")
    (root / "d.json").write_bytes(b'[\n' + json.dumps(GOOD).encode() + b',\n {"messages": [{"role": "user", '
                                  b'"content": "\xff"}]},\n {"broken\n]')
    datasets.Dataset.from_list([GOOD] * 50).to_parquet(root / "e.parquet")
    data = (root / "e.parquet").read_bytes()
    (root / "e.parquet").write_bytes(data[: len(data) // 2])
    datasets.Dataset.from_list([{"text": "x"}]).select([]).to_parquet(root / "f.parquet")
    (root / "g.jsonl").write_text('{"messages": [{"role": "user", "content": "\\ud800"}]}\n')  # a lone surrogate
    return root


EXPECTED = {**{reason: 1 for reason in BAD_LINES}, "empty file": 3, "bad UTF-8": 3, "broken JSON": 2,
            "unreadable file": 1}


def expected_problems(root):
    lines = [f"{root}/a.jsonl:{n}: {reason}" for n, reason in enumerate(BAD_LINES, 2)]
    return lines + [f"{root}/b.jsonl:1: empty file", f"{root}/c.json:1: empty file", f"{root}/d.json:3: bad UTF-8",
                    f"{root}/d.json:4: broken JSON", f"{root}/e.parquet:0: unreadable file",
                    f"{root}/f.parquet:0: empty file", f"{root}/g.jsonl:1: bad UTF-8"]


def test_bad_input_is_skipped_and_counted_with_where(tmp_path, tokenizer):
    root = bad_files(tmp_path / "data")
    ds = load(str(root), tokenizer)
    assert [s.source for s in ds.samples] == [f"{root}/a.jsonl:1", f"{root}/a.jsonl:{len(BAD_LINES) + 2}",
                                              f"{root}/d.json:2"]
    assert ds.skipped == EXPECTED
    assert [p.split(": ")[0] + ": " + p.split(": ")[1] for p in ds.problems] == expected_problems(root)


def test_strict_lists_every_offender_before_training(tmp_path, tokenizer):
    root = bad_files(tmp_path / "data")
    with pytest.raises(ValueError, match=r"data.strict=true and 17 bad records") as error:
        load(str(root), tokenizer, strict=True)
    assert all(problem in str(error.value) for problem in expected_problems(root))


def test_nothing_usable_is_an_error_with_the_counts(tmp_path, tokenizer):
    path = write(tmp_path / "d.jsonl", [BAD_LINES["empty reply"], BAD_LINES["broken JSON"], BAD_LINES["empty reply"]])
    counts = r"3 records skipped \{'broken JSON': 1, 'empty reply': 2\}"
    with pytest.raises(ValueError, match=f"nothing to train on .* {counts}"):
        load(str(path), tokenizer)


def test_iter_records_hands_over_unreadable_entries_as_bad_records(tmp_path):
    path = write(tmp_path / "d.jsonl", [GOOD, BAD_LINES["broken JSON"]])
    (good_where, good), (bad_where, bad) = iter_records(str(path))
    assert (good_where, good) == (f"{path}:1", GOOD)
    assert bad_where == f"{path}:2" and isinstance(bad, BadRecord)
    with pytest.raises(BadRecord, match="^broken JSON"):
        parse_messages(bad)


# ---------------------------------------------------------------------------
# Masks and order
# ---------------------------------------------------------------------------


def test_loss_mask_covers_exactly_the_reply_and_its_end_of_turn(tokenizer):
    [(_, ids, mask)] = conversation_samples(tokenizer, GOOD["conversations"])
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "3 4 5 6 7 8 9 <|im_end|>"
    prompt = tokenizer.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=True)
    assert "count from 3 to 9" in prompt and "3 4 5 6 7 8 9" not in prompt


def test_an_unknown_word_does_not_end_the_reply(tokenizer):
    """The unknown token is special but stands inside text; the reply ends at eos."""
    messages = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "1 2 zebra 3"}]
    [(_, ids, mask)] = conversation_samples(tokenizer, messages)
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "1 2 <|unk|> 3 <|im_end|>"


def test_schedule_depends_on_seed_and_index_only():
    a = SampleOrder(100, batch_size=8, micro_batch_size=2, seed=3)
    b = SampleOrder(100, batch_size=8, micro_batch_size=4, seed=3)
    # the same samples per optimizer step whatever the micro-batch split
    step_a = sorted(i for m in range(4) for i in a.micro_batch(4 + m)[1])
    step_b = sorted(i for m in range(2) for i in b.micro_batch(2 + m)[1])
    assert step_a == step_b
    assert a.micro_batch(12 * 4)[0] == 1  # 12 steps per epoch


def test_a_reply_without_an_anchor_position_is_counted(tmp_path, tokenizer, monkeypatch):
    """Anchors need a response token followed by another; a conversation without one
    would train nothing and is skipped and counted, not lost silently."""
    import dflash.data.dataset

    masks = iter([[0, 1, 0, 1, 0], [0, 0, 1, 1, 1]])
    monkeypatch.setattr(dflash.data.dataset, "conversation_samples", lambda tok, m, kw: [("", [5, 6, 7, 8, 9], next(masks))])
    ds = load(str(write(tmp_path / "d.jsonl", [GOOD, GOOD])), tokenizer, min_loss_tokens=1)
    assert len(ds) == 1 and ds.skipped["no anchor"] == 1


def test_the_demo_turn_ends_with_the_tokenizer_eos(tokenizer):
    """As in Qwen3's chat models, a decoding loop that stops at the tokenizer's eos stops
    at the end of the assistant's turn (the padding token is another)."""
    from transformers import GenerationConfig

    [(_, ids, mask)] = conversation_samples(tokenizer, GOOD["conversations"])
    reply = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.eos_token == "<|im_end|>" and reply[-1] == tokenizer.eos_token_id
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert GenerationConfig.from_pretrained(resolve_path("demo")).eos_token_id == tokenizer.eos_token_id
