"""The conversations regeneration reads and writes: each record's turns, its key, the
replies as they come back, how they are sampled, and the records of one rank's windows."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from dflash.data.records import BadRecord, conversation_turns, iter_records, parse_turn


@dataclass(frozen=True)
class Reply:
    text: str
    tokens: int  # generated, the end-of-turn token included
    finished: bool  # ended with the end-of-turn token; False: broke off at max_new_tokens


@dataclass
class Conversation:
    """One record being regenerated: the turns before each reply, and the conversation so far."""

    index: int
    key: str
    chunks: list[list[dict[str, str]]]  # the user/system turns before each reply to generate
    messages: list[dict[str, str]] = field(default_factory=list)
    replies: int = 0
    tokens: int = 0
    status: str = "ok"  # ok | truncated | skipped
    reason: str = ""

    @classmethod
    def of(cls, index: int, key: str, turns: list[dict[str, str]]) -> Conversation:
        """Split at the assistant turns (their old content is dropped); trailing user or
        system turns ask for one reply more."""
        chunks, chunk = [], []
        for turn in turns:
            if turn["role"] == "assistant":
                chunks.append(chunk)
                chunk = []
            else:
                chunk.append(turn)
        if chunk:
            chunks.append(chunk)
        return cls(index, key, chunks)

    @property
    def done(self) -> bool:
        return self.status != "ok" or self.replies == len(self.chunks)

    def prompt(self) -> list[dict[str, str]]:
        """The context of the next reply: everything regenerated so far, then the next turns."""
        return self.messages + self.chunks[self.replies]

    def add(self, reply: Reply) -> None:
        """A reply that broke off ends the record: later turns would answer a cut context."""
        self.messages = self.prompt() + [{"role": "assistant", "content": reply.text}]
        self.replies += 1
        self.tokens += reply.tokens
        if not reply.finished:
            self.status = "truncated"
        elif not reply.text.strip():
            self.skip("empty reply: the target answered with nothing")

    def skip(self, reason: str) -> None:
        self.status, self.reason = "skipped", reason

    def entry(self) -> dict:
        """The record's line in a shard file, the key first (:data:`SHARD_KEY_PREFIX`)."""
        entry = {"key": self.key, "index": self.index, "status": self.status, "tokens": self.tokens}
        if self.status == "skipped":
            entry["reason"] = self.reason
        else:
            entry["record"] = {"id": self.key, "conversations": self.messages}
        return entry


@dataclass(frozen=True)
class Sampling:
    """How replies are drawn. ``None`` leaves the value to the target's generation
    config (or the server's default), the setting its authors recommend."""

    max_new_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    template_kwargs: Mapping = field(default_factory=dict)
    seed: int = 0


def source_turns(record: object) -> list[dict[str, str]]:
    """The turns of a record of any shape :mod:`dflash.data.records` reads. Unlike training
    (``parse_messages``), a record needs no reply and may hold empty ones: they are
    replaced, and a bare prompt is the common input."""
    turns = [parse_turn(turn) for turn in conversation_turns(record)]
    if next((t["role"] for t in turns if t["role"] != "system"), "assistant") == "assistant":
        raise BadRecord("starts with the assistant")
    return turns


def unique_key(where: str, record: object, used: set[str]) -> str:
    """The record's own ``id`` when it has one, else where it sits; a repeat gets ``#n``,
    so that no two records share a key and a restart skips exactly the finished ones."""
    own = record.get("id") if isinstance(record, Mapping) else None
    base = where if own is None else str(own)
    key, n = base, 0
    while key in used:
        n += 1
        key = f"{base}#{n}"
    used.add(key)
    return key


def keyed_records(path: str | Sequence[str], max_samples: int | None) -> Iterator[tuple[int, str, object]]:
    """``(index, key, record)`` of the first ``max_samples`` records, in input order."""
    used: set[str] = set()
    for index, (where, record) in enumerate(iter_records(path)):
        if max_samples is not None and index >= max_samples:
            return
        yield index, unique_key(where, record, used), record


@dataclass
class Work:
    keys: list[str]  # every record's key, in input order
    windows: dict[int, list[Conversation]]  # this rank's unfinished records, by window number
    skipped: list[Conversation]  # this rank's unfinished records that cannot be regenerated

    @property
    def pending(self) -> int:
        return sum(map(len, self.windows.values()))


def find_work(path: str | Sequence[str], max_samples: int | None, window_size: int, rank: int, *, world: int,
              done: set[str]) -> Work:
    """Read the input once: every key, and this rank's share of what is not done yet."""
    work = Work([], {}, [])
    for index, key, record in keyed_records(path, max_samples):
        work.keys.append(key)
        window = index // window_size
        if window % world != rank or key in done:
            continue
        try:
            conversation = Conversation.of(index, key, source_turns(record))
        except BadRecord as e:
            conversation = Conversation(index, key, [])
            conversation.skip(str(e))
            work.skipped.append(conversation)
        else:
            work.windows.setdefault(window, []).append(conversation)
    return work
