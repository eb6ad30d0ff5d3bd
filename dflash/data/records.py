"""Chat records: finding and reading the data files, and each record as a conversation.

``data.path`` names one source or a list of them; a source is a file, a dataset
directory or a directory of those. Files are JSONL, JSON (a top-level list of
records) or Parquet; a dataset directory is one written by
``datasets.Dataset.save_to_disk``. Each record is a conversation in the OpenAI
(``messages``/``conversations`` with ``role``/``content``) or ShareGPT
(``from``/``value``) shape, or a ``prompt``/``response`` (``instruction``/
``output``) pair. What cannot be read or understood is a :class:`BadRecord`,
located by ``file:line`` or ``file:row``, so that callers count it and go on.

Training (:mod:`dflash.data.dataset`), decoding's prompt sets and regeneration
read records through here. Imports no model, objective or run code.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from dflash.files import local_path

ROLE_ALIASES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}
# Prompt/response spellings, tried in order: (prompt key, reply key).
PAIR_KEYS = (("prompt", "response"), ("instruction", "output"))
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


class BadRecord(ValueError):
    """A record that cannot be trained on: "category: detail", counted by category."""


# ---------------------------------------------------------------------------
# Finding and reading the files
# ---------------------------------------------------------------------------


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``datasets.Dataset.save_to_disk``."""
    return path.is_dir() and (path / "state.json").is_file()


def _readable(path: Path) -> bool:
    if path.name.startswith("."):
        return False
    return (path.is_file() and path.suffix in FILE_SUFFIXES) or is_saved_dataset(path)


def source_files(path: str, key: str = "data.path") -> list[Path]:
    """What one ``data.path`` entry names: a file, a saved dataset, a directory of those
    (not recursive, by name), or a shipped name such as ``demo``. Errors name ``key``,
    the setting the path came from."""
    p = local_path("data", path)
    if (p / "dataset_dict.json").is_file():
        raise ValueError(f"{key}={path!r} is a DatasetDict: name one split, e.g. {p / 'train'}")
    if p.is_dir() and not is_saved_dataset(p):
        files = sorted(f for f in p.iterdir() if _readable(f))
        if not files:
            raise FileNotFoundError(f"{key}={path!r} holds no {'/'.join(FILE_SUFFIXES)} files or saved datasets")
        return files
    if not p.exists():
        raise FileNotFoundError(f"{key}={path!r} does not exist")
    if not _readable(p):
        raise ValueError(f"{key}={path!r}: not a {'/'.join(FILE_SUFFIXES)} file or a saved dataset directory")
    return [p]


def data_sources(path: str | Sequence[str], key: str = "data.path") -> list[list[Path]]:
    """The files of each ``data.path`` entry (one string or a list), in order."""
    entries = [path] if isinstance(path, str) else [str(p) for p in path]
    if not entries:
        raise ValueError(f"{key} is an empty list")
    return [source_files(e, key) for e in entries]


def source_names(sources: list[list[Path]]) -> list[str]:
    """Every file of every ``data.path`` entry, as the locations of its records name it."""
    return [str(f) for files in sources for f in files]


class _Lines:
    """``file:line`` of positions met front to back in a JSON text, counted as it goes
    (linear in the file); a second record starting on a line adds ``:column``."""

    def __init__(self, file: Path, text: str):
        self.file, self.text = file, text
        self.pos, self.line, self.line_start, self.named = 0, 1, 0, 0

    def where(self, pos: int) -> str:
        newlines = self.text.count("\n", self.pos, pos)
        if newlines:
            self.line += newlines
            self.line_start = self.text.rfind("\n", self.pos, pos) + 1
        self.pos = pos
        if self.named == self.line:
            return f"{self.file}:{self.line}:{pos - self.line_start + 1}"
        self.named = self.line
        return f"{self.file}:{self.line}"


_SPACE = re.compile(r"[ \t\r\n]*")


def _read_jsonl(file: Path) -> Iterator[tuple[str, object]]:
    """One record per non-blank line; a broken line is reported and the next one read."""
    seen = False
    with open(file, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            seen = True
            try:
                record = json.loads(raw.decode("utf-8-sig"))
            except UnicodeDecodeError:
                record = BadRecord("bad UTF-8")
            except json.JSONDecodeError as e:
                record = BadRecord(f"broken JSON: {e.msg} at column {e.colno}")
            yield f"{file}:{lineno}", record
    if not seen:
        yield f"{file}:1", BadRecord("empty file")


def _read_json(file: Path) -> Iterator[tuple[str, object]]:
    """A top-level list of records, decoded one element at a time so that each gets its
    line and a broken element still yields the records before it (not those after:
    nothing tells where the next one starts). Invalid UTF-8 is kept as surrogates,
    so only the records holding it are rejected (by :func:`parse_turn`)."""
    text = file.read_bytes().decode("utf-8-sig", errors="surrogateescape")
    decoder, lines = json.JSONDecoder(), _Lines(file, text)
    pos = _SPACE.match(text).end()
    if pos == len(text):
        yield f"{file}:1", BadRecord("empty file")
        return
    if text[pos] != "[":
        yield lines.where(pos), BadRecord("not a JSON list: a .json file holds a list of records")
        return
    pos, count = _SPACE.match(text, pos + 1).end(), 0
    while text[pos : pos + 1] != "]":
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            yield lines.where(e.pos), BadRecord(f"broken JSON: {e.msg}")
            return
        yield lines.where(pos), record
        count += 1
        pos = _SPACE.match(text, end).end()
        if text[pos : pos + 1] == ",":
            pos = _SPACE.match(text, pos + 1).end()
        elif text[pos : pos + 1] != "]":
            yield lines.where(pos), BadRecord("broken JSON: expected ',' or ']' after a record")
            return
    if not count:
        yield f"{file}:1", BadRecord("empty file")


def _read_rows(where: str, open_rows: Callable[[], Iterable[dict]]) -> Iterator[tuple[str, object]]:
    """Rows as ``where:row`` (0-based, the index ``datasets`` gives them); a file that
    cannot be opened, or breaks midway, is reported after the rows read before."""
    import pyarrow

    row = 0
    try:
        for record in open_rows():
            yield f"{where}:{row}", record
            row += 1
    except (pyarrow.ArrowException, OSError, ValueError) as e:
        yield f"{where}:{row}", BadRecord(f"unreadable file: {type(e).__name__}: {e}")
        return
    if not row:
        yield f"{where}:0", BadRecord("empty file")


def _read_parquet(file: Path) -> Iterator[tuple[str, object]]:
    """Streamed by ``datasets``: read batch by batch, with no copy into its cache."""
    import datasets

    def rows() -> Iterable[dict]:
        return datasets.load_dataset("parquet", data_files=[str(file.resolve())], split="train", streaming=True)

    return _read_rows(str(file), rows)


def _read_saved(directory: Path) -> Iterator[tuple[str, object]]:
    """A ``save_to_disk`` directory, memory-mapped by ``datasets``."""
    import datasets

    return _read_rows(str(directory), lambda: datasets.load_from_disk(str(directory)))


def read_file(file: Path) -> Iterator[tuple[str, object]]:
    """``(where, record)`` of one file or saved dataset, a :class:`BadRecord` for what
    cannot be read."""
    if file.is_dir():
        return _read_saved(file)
    return {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}[file.suffix](file)


def source_records(sources: list[list[Path]]) -> Iterator[tuple[int, str, object]]:
    """``(entry, where, record)`` of every file of :func:`data_sources`, ``entry`` the
    index of the ``data.path`` entry the file belongs to."""
    for origin, files in enumerate(sources):
        for file in files:
            for where, record in read_file(file):
                yield origin, where, record


def iter_records(path: str | Sequence[str], key: str = "data.path") -> Iterator[tuple[str, object]]:
    """``(where, record)`` for every record of every file of ``data.path``, in order.

    ``where`` is ``file:line`` for JSONL and JSON (``file:line:column`` for a JSON
    record that shares its line) and ``file:row`` (0-based) for Parquet and saved
    datasets. ``record`` is the raw record, or a :class:`BadRecord` for an entry
    that could not be read (broken JSON, bad UTF-8, an empty or truncated file);
    :func:`parse_messages` raises it, so callers need one ``except BadRecord``.
    """
    for _, where, record in source_records(data_sources(path, key)):
        yield where, record


# ---------------------------------------------------------------------------
# Records to messages
# ---------------------------------------------------------------------------


def _first(d: Mapping, *keys: str) -> object:
    """The first of ``keys`` present and not None: a Parquet row holds every column of
    its file, None where the record had no such key."""
    return next((d[k] for k in keys if d.get(k) is not None), None)


def conversation_turns(record: object) -> list:
    """The raw turns of one record, whichever shape it has; a top-level ``system``
    string becomes the first turn."""
    if isinstance(record, BadRecord):
        raise record
    if not isinstance(record, Mapping):
        raise BadRecord("not a JSON object")
    turns = _first(record, "conversations", "messages")
    if turns is None:
        turns = _pair_turns(record)
    if not isinstance(turns, list) or not turns:
        raise BadRecord("no conversation: no 'conversations' or 'messages' list, or 'prompt' and 'response'")
    system = record.get("system")
    if isinstance(system, str) and system.strip() and not _is_system(turns[0]):
        turns = [{"role": "system", "content": system}, *turns]
    return turns


def _is_system(turn: object) -> bool:
    return isinstance(turn, Mapping) and str(_first(turn, "role", "from")).lower() == "system"


def _pair_turns(record: Mapping) -> list | None:
    """A prompt/response record as turns (the reply only where it has one, so that a
    prompt alone still reads as a prompt); Alpaca's ``input`` follows its instruction."""
    for prompt_key, reply_key in PAIR_KEYS:
        prompt, reply = record.get(prompt_key), record.get(reply_key)
        if prompt is None and reply is None:
            continue
        extra = record.get("input") if prompt_key == "instruction" else None
        if isinstance(prompt, str) and isinstance(extra, str) and extra.strip():
            prompt = f"{prompt}\n\n{extra}"
        turns = [{"role": "user", "content": prompt}]
        return turns + [{"role": "assistant", "content": reply}] if reply is not None else turns
    return None


def parse_turn(turn: object) -> dict[str, str]:
    """One turn as ``{"role", "content"}``, from the OpenAI or the ShareGPT spelling."""
    if not isinstance(turn, Mapping):
        raise BadRecord("bad turn: not an object")
    raw_role = _first(turn, "role", "from")
    role = ROLE_ALIASES.get(str(raw_role).lower())
    if role is None:
        raise BadRecord(f"unknown role: {raw_role!r}")
    content = _first(turn, "content", "value")
    if not isinstance(content, str):
        raise BadRecord(f"bad turn: {role} content is {type(content).__name__}, not a string")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRecord("bad UTF-8") from None
    return {"role": role, "content": content}


def parse_messages(record: object) -> list[dict[str, str]]:
    """A trainable conversation from a record of any accepted shape: user (or system)
    first, at least one assistant turn and no empty one. A
    :class:`BadRecord` from :func:`iter_records` is raised as is."""
    messages = [parse_turn(turn) for turn in conversation_turns(record)]
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no assistant turn")
    if any(m["role"] == "assistant" and not m["content"].strip() for m in messages):
        raise BadRecord("empty reply")
    if messages[0]["role"] == "assistant":
        raise BadRecord("starts with the assistant")
    return messages
