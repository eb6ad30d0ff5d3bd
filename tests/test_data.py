"""Bad data is skipped and counted with file:line, or rejected at start when strict."""

import json

import pytest
from transformers import AutoTokenizer

from dflash.data import SampleOrder, load_dataset, tokenize_conversation
from dflash.target import resolve_path


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_path("demo"))


GOOD = {"conversations": [{"role": "user", "content": "count from 3 to 9"}, {"role": "assistant", "content": "3 4 5 6 7 8 9"}]}


def write(path, lines):
    path.write_bytes(b"".join(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode() for line in lines))
    return path


BAD = [
    b"{not json\n",
    {"conversations": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
    {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
    {"conversations": [{"role": "user", "content": "hi"}]},
    b'{"conversations": [{"role": "user", "content": "\xff\xfe"}]}\n',
    {"conversations": [{"role": "user", "content": "count from 1 to 400"}, {"role": "assistant", "content": " ".join(map(str, range(1, 401)))}]},
]


def test_bad_lines_are_skipped_and_counted(tmp_path, tokenizer, caplog):
    path = write(tmp_path / "d.jsonl", [GOOD, *BAD, GOOD])
    ds = load_dataset(str(path), tokenizer, max_len=320, min_loss_tokens=2, strict=False)
    assert len(ds) == 2
    assert sum(ds.skipped.values()) == len(BAD)
    assert ds.skipped["broken JSON"] == 1 and ds.skipped["bad UTF-8"] == 1
    assert f"{path}:2: broken JSON" in caplog.text


def test_strict_rejects_at_start(tmp_path, tokenizer):
    path = write(tmp_path / "d.jsonl", [GOOD, BAD[1]])
    with pytest.raises(ValueError, match=r"(?s)data.strict=true and 1 bad.*d.jsonl:2: unknown role: 'narrator'"):
        load_dataset(str(path), tokenizer, max_len=320, min_loss_tokens=2, strict=True)


def test_loss_mask_covers_exactly_the_reply(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, GOOD["conversations"])
    reply = tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True)
    assert reply.split() == "3 4 5 6 7 8 9".split()
    prompt = tokenizer.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=True)
    assert "count from 3 to 9" in prompt and "3 4 5 6 7 8 9" not in prompt


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
    import dflash.data

    masks = iter([[0, 1, 0, 1, 0], [0, 0, 1, 1, 1]])
    monkeypatch.setattr(dflash.data, "tokenize_conversation", lambda tok, messages: ([5, 6, 7, 8, 9], next(masks)))
    ds = load_dataset(str(write(tmp_path / "d.jsonl", [GOOD, GOOD])), tokenizer, max_len=320, min_loss_tokens=1,
                      strict=False)
    assert len(ds) == 1 and ds.skipped["no anchor"] == 1


def test_the_demo_turn_ends_with_the_tokenizer_eos(tokenizer):
    """As in Qwen3's chat models, a decoding loop that stops at the tokenizer's eos stops
    at the end of the assistant's turn (the padding token is another)."""
    from transformers import GenerationConfig

    ids, mask = tokenize_conversation(tokenizer, GOOD["conversations"])
    reply = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id in reply
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert GenerationConfig.from_pretrained(resolve_path("demo")).eos_token_id == tokenizer.eos_token_id
