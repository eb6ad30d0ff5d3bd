"""Each rank's shard file, appended and fsynced per batch and read back on a restart, the
settings a restart must share, the merge into the output in input order, and the
progress line."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

from tqdm import tqdm

from dflash.regenerate.records import Conversation

log = logging.getLogger("dflash.regenerate")

# Ranks finish their shards hours apart on a skewed data set; the merge waits for the last.
MERGE_WAIT = timedelta(hours=24)
PROGRESS_LOG_S = 30.0  # a progress line this often when stderr is a log file, not a terminal
SHARD_KEY_PREFIX = '{"key": '  # every shard line starts so, so a restart reads keys alone


def parts_dir(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def drop_partial_line(path: Path) -> None:
    """A kill mid-write leaves half a line at the end: cut it, so the next append starts clean."""
    if not path.exists():
        return
    with open(path, "r+b") as fh:
        end = pos = fh.seek(0, os.SEEK_END)
        while pos > 0:
            step = min(1 << 16, pos)
            fh.seek(pos - step)
            cut = fh.read(step).rfind(b"\n")
            if cut >= 0:
                pos += cut + 1 - step
                break
            pos -= step
        if pos != end:
            fh.truncate(pos)


def shard_keys(path: Path) -> Iterator[tuple[int, str]]:
    """``(offset, key)`` of every complete line, decoding only the key."""
    decoder = json.JSONDecoder()
    with open(path, "rb") as fh:
        while True:
            offset, raw = fh.tell(), fh.readline()
            if not raw.endswith(b"\n"):
                return  # the end, or half a line a running or killed writer left
            line = raw.decode("utf-8")
            if line.startswith(SHARD_KEY_PREFIX):
                yield offset, decoder.raw_decode(line, len(SHARD_KEY_PREFIX))[0]


def finished_keys(directory: Path) -> set[str]:
    return {key for path in sorted(directory.glob("*.jsonl")) for _, key in shard_keys(path)}


class ShardWriter:
    """Appends finished records to this rank's shard file, durably."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        drop_partial_line(path)
        self.fh = open(path, "ab")

    def write(self, conversations: Sequence[Conversation]) -> None:
        """One write, flush and fsync per batch: a crash loses at most the batch in flight."""
        if not conversations:
            return
        self.fh.write(b"".join(json.dumps(c.entry(), ensure_ascii=False).encode() + b"\n" for c in conversations))
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def close(self) -> None:
        self.fh.close()


def check_settings(directory: Path, settings: dict) -> None:
    """Shards made with another target or sampling would mix two distributions in one
    file: a restart must use the same ones."""
    path = directory / "settings.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old != settings:
            changed = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
            raise ValueError(f"{directory} holds replies made with other settings (was, now): {changed}; "
                             f"use the same options, or delete {directory} to start over")
        return
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".settings.{os.getpid()}.json"
    tmp.write_text(json.dumps(settings, indent=1) + "\n")
    os.replace(tmp, path)


def category(reason: str) -> str:
    return reason.split(":")[0]


def merge(keys: Sequence[str], directory: Path, out: Path, keep_truncated: bool) -> dict:
    """Write ``out`` in input order from the shard files, once every record has its line;
    the counts of the whole data set (all runs and ranks) come back."""
    found: dict[str, tuple[Path, int]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        for offset, key in shard_keys(path):
            found.setdefault(key, (path, offset))
    missing = [k for k in keys if k not in found]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(keys)} records have no result in {directory} yet "
                           f"(first: {missing[0]}); run the same command again to finish them")
    status, skipped, tokens, written = Counter(), Counter(), 0, 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp_{out.name}")
    with ExitStack() as stack:
        shards = {path: stack.enter_context(open(path, "rb")) for path in {p for p, _ in found.values()}}
        dst = stack.enter_context(open(tmp, "wb"))
        for key in keys:
            path, offset = found[key]
            shards[path].seek(offset)
            entry = json.loads(shards[path].readline())
            status[entry["status"]] += 1
            tokens += entry["tokens"]
            if entry["status"] == "skipped":
                skipped[category(entry["reason"])] += 1
            elif entry["status"] == "ok" or keep_truncated:
                dst.write(json.dumps(entry["record"], ensure_ascii=False).encode() + b"\n")
                written += 1
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, out)
    return {"records": len(keys), "regenerated": status["ok"], "truncated": status["truncated"],
            "keep_truncated": keep_truncated, "skipped": dict(sorted(skipped.items())), "tokens": tokens,
            "written": written, "out": str(out)}


class Progress:
    """A tqdm bar on a terminal; in a log file the same figures as one line every
    :data:`PROGRESS_LOG_S` seconds, since carriage returns make a log unreadable."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.tty, self.enabled, self.total, self.desc = sys.stderr.isatty(), enabled, total, desc
        self.bar = tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, mininterval=1.0, smoothing=0.1,
                        disable=not (enabled and self.tty))
        self.samples = self.tokens = 0
        self.began = self.logged = time.perf_counter()

    def update(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        now = time.perf_counter()
        rate = f"{self.tokens / max(now - self.began, 1e-9):.0f} tokens/s"
        self.bar.set_postfix_str(rate, refresh=False)
        self.bar.update(samples)
        if self.enabled and not self.tty and (now - self.logged >= PROGRESS_LOG_S or self.samples == self.total):
            self.logged = now
            log.info("%s", tqdm.format_meter(self.samples, self.total, now - self.began, prefix=self.desc,
                                             unit="sample", postfix=rate))

    def close(self) -> None:
        self.bar.close()
