"""Tokenise a dataset once: tokenised conversations cached on disk, keyed by content.

The key hashes the data files' bytes and kinds, grouped by ``data.path`` entry (a
saved dataset directory by all of its files), the tokenizer (vocabulary, merges,
special tokens and chat template), ``max_len``, ``min_loss_tokens``,
``max_samples`` and the chat template's arguments, so any change tokenises again
and nothing stale is ever read. ``data.weights`` are applied to what is read
from it, so changing them reuses the cache. On a first start one process per
cache directory tokenises while holding a lock file; the others wait for its
result, bounded by a timeout. A lock whose owner has died on this
host is taken over, so a crash never leaves the others waiting.

The file is an ``.npz`` of plain arrays (no pickle): token ids and loss masks
concatenated with their offsets, plus a JSON blob with each sample's source
(``file:line``) and ``data.path`` entry, the skip counts and the skip reasons.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

FORMAT = 4  # bump when what tokenisation produces changes (mask rules, skip rules; 4: the one end-of-reply rule)


@dataclass
class Tokenised:
    ids: list[Sequence[int]]
    masks: list[Sequence[int]]
    sources: list[str]
    skipped: dict[str, int]  # a Counter while tokenising
    problems: list[str]
    origins: list[int] = field(default_factory=list)  # the data.path entry of each sample
    files: list[str] = field(default_factory=list)  # every source file, where it was when read


def relocate(data: Tokenised, files: list[str]) -> Tokenised:
    """``data`` with its ``file:line`` locations naming ``files``, where the sources are
    now. The cache key holds the files' names and contents, not their directories, so a
    cached dataset may have been read from files that have moved since."""
    moves = sorted(((old, new) for old, new in zip(data.files, files) if old != new), key=lambda m: -len(m[0]))
    if not moves:
        return data

    def where(text: str) -> str:
        for old, new in moves:  # longest first: a path may itself contain ':'
            if text.startswith(old + ":"):
                return new + text[len(old):]
        return text

    return replace(data, sources=[where(s) for s in data.sources], problems=[where(p) for p in data.problems],
                   files=list(files))


def _file_digest(path: Path) -> str:
    """The bytes of a file, or of every file of a directory with their relative names."""
    digest = hashlib.sha256()
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _kind(path: Path) -> str:
    return "saved dataset" if path.is_dir() else path.suffix


def _tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    parts = [type(tokenizer).__name__, vocab, str(tokenizer.chat_template), json.dumps(tokenizer.special_tokens_map,
                                                                                        sort_keys=True, default=str)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def cache_key(sources: list[list[Path]], tokenizer: PreTrainedTokenizerBase, **options) -> str:
    """What the tokenised dataset depends on, hashed; ``sources`` holds the files of
    each ``data.path`` entry."""
    described = {
        "format": FORMAT,
        "sources": [[[f.name, _kind(f), _file_digest(f)] for f in files] for files in sources],
        "tokenizer": _tokenizer_digest(tokenizer),
        **options,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


def _save(path: Path, data: Tokenised) -> None:
    lengths = np.array([len(i) for i in data.ids], dtype=np.int64)
    meta = {"sources": data.sources, "origins": data.origins, "skipped": data.skipped, "problems": data.problems,
            "files": data.files}
    tmp = path.with_name(f".tmp_{os.getpid()}_{path.name}")
    with open(tmp, "wb") as fh:
        np.savez(
            fh,
            ids=np.concatenate([np.asarray(i, dtype=np.int32) for i in data.ids]) if data.ids else np.zeros(0, np.int32),
            masks=np.concatenate([np.asarray(m, dtype=np.uint8) for m in data.masks]) if data.masks else np.zeros(0, np.uint8),
            offsets=np.concatenate([[0], np.cumsum(lengths)]),
            meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        )
    os.replace(tmp, path)


def _load(path: Path) -> Tokenised:
    with np.load(path, allow_pickle=False) as f:
        ids, masks, offsets = f["ids"], f["masks"], f["offsets"]
        meta = json.loads(f["meta"].tobytes())
    spans = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
    return Tokenised([ids[a:b] for a, b in spans], [masks[a:b] for a, b in spans], meta["sources"], meta["skipped"],
                     meta["problems"], meta["origins"], meta["files"])


def _owner_is_gone(lock: Path) -> bool:
    """A lock left by a process of this host that no longer runs."""
    try:
        host, pid = lock.read_text().split()
    except (OSError, ValueError):
        return False
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def tokenise_once(cache_dir: Path, key: str, tokenise: Callable[[], Tokenised], wait_s: float) -> tuple[Tokenised, bool]:
    """The tokenised dataset for ``key``: from the cache, or from ``tokenise()`` by the one
    process that takes the lock. Returns it and whether it came from the cache."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path, lock = cache_dir / f"{key}.npz", cache_dir / f"{key}.lock"
    deadline = time.monotonic() + wait_s
    while True:
        if path.is_file():
            return _load(path), True
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _owner_is_gone(lock):
                log.warning("taking over %s: the process that held it is gone", lock)
                lock.unlink(missing_ok=True)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"waited {wait_s:.0f} s for another process to tokenise the data ({lock} holds "
                    f"'{lock.read_text().strip()}'); if it is gone, delete the lock file"
                ) from None
            time.sleep(0.5)
            continue
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(f"{socket.gethostname()} {os.getpid()}\n")
            if path.is_file():  # written, and its lock let go, between the look above and this lock
                return _load(path), True
            data = tokenise()
            _save(path, data)
            return data, False
        finally:
            lock.unlink(missing_ok=True)
