"""Regression pin of the regeneration merge: a merged file out of input order would still
train, on records paired with the wrong ids; checked against the input order itself."""

from __future__ import annotations

import json
from pathlib import Path

from dflash.regenerate.records import Conversation, Reply
from dflash.regenerate.shards import ShardWriter, merge


def test_merge_writes_records_in_input_order_whatever_the_keys_and_shards(tmp_path: Path):
    """The merged file follows the input order, not the keys' sort order, the shard
    files' names or the order the ranks finished records in."""
    keys = ["z", "10", "9", "b#1", "b", "a:3", "a:20", "1"]  # input order; sorts differently as text
    parts = tmp_path / "out.jsonl.parts"

    def entries(indices: list[int]) -> list[Conversation]:
        done = []
        for i in indices:
            c = Conversation.of(i, keys[i], [{"role": "user", "content": f"q{i}"}])
            c.add(Reply(f"r{i}", 2, True))
            done.append(c)
        return done

    # rank 0's file sorts first but holds the late records; each shard is written out of order
    ranks = {"rank0-of-2.jsonl": [7, 4, 6, 5], "rank1-of-2.jsonl": [2, 0, 3, 1]}
    for name, indices in ranks.items():
        writer = ShardWriter(parts / name)
        writer.write(entries(indices[:2]))
        writer.write(entries(indices[2:]))
        writer.close()
    out = tmp_path / "out.jsonl"
    summary = merge(keys, parts, out, keep_truncated=False)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == keys
    assert [r["conversations"][-1]["content"] for r in lines] == [f"r{i}" for i in range(len(keys))]
    assert summary["written"] == summary["records"] == len(keys) and summary["tokens"] == 2 * len(keys)
