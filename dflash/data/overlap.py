"""Training prompts that share nothing with a benchmark: no function name and no run of
:data:`SPAN` tokens in common with any of its prompts.

A drafter trained on a benchmark's own text would score its acceptance on memorised
continuations; the check makes the held-apart claim a property of the data, not a hope.
Function names are the benchmark's entry points and every ``def`` in its prompts; a
prompt names one when it appears as its own definition's name, in backticks, or called
(``name(``), since a bare English word ("add", "search") is not a function name. Tokens
are the target tokenizer's when one is given, else words and single punctuation marks
(``\\w+|[^\\w\\s]``), which split code about as finely.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

SPAN = 10
WORDS = re.compile(r"\w+|[^\w\s]")
DEFINED = re.compile(r"\bdef\s+(\w+)")
NAMED = re.compile(r"`(\w+)[`(]|\b(\w+)\(")


def word_tokens(text: str) -> list[str]:
    return WORDS.findall(text)


def function_names(prompts: Iterable[str], entry_points: Iterable[str] = ()) -> frozenset[str]:
    """The functions a benchmark defines: its entry points and every ``def`` in its prompts."""
    names = set(entry_points)
    for prompt in prompts:
        names.update(DEFINED.findall(prompt))
    return frozenset(names)


def names_in(text: str) -> set[str]:
    """The identifiers ``text`` uses as function names: defined, in backticks, or called."""
    found = set(DEFINED.findall(text))
    for backticked, called in NAMED.findall(text):
        found.add(backticked or called)
    return found


@dataclass
class Overlap:
    """What a prompt shares with the benchmark; empty when it shares nothing."""

    names: set[str]
    span: tuple | None

    def __bool__(self) -> bool:
        return bool(self.names) or self.span is not None

    def __str__(self) -> str:
        if self.names:
            return f"function name {sorted(self.names)[0]}"
        return f"{SPAN}-token span {self.span!r}"


class BenchmarkGuard:
    """The function names and every :data:`SPAN`-token run of a benchmark's prompts."""

    def __init__(self, prompts: Sequence[str], entry_points: Iterable[str] = (),
                 tokenize: Callable[[str], Sequence] = word_tokens):
        self.tokenize = tokenize
        self.names = function_names(prompts, entry_points)
        self.spans = {tuple(ids[i:i + SPAN]) for ids in map(tokenize, prompts) for i in range(len(ids) - SPAN + 1)}

    def overlap(self, text: str, own_name: str | None = None) -> Overlap:
        names = (names_in(text) | ({own_name} if own_name else set())) & self.names
        ids = self.tokenize(text)
        span = next((tuple(ids[i:i + SPAN]) for i in range(len(ids) - SPAN + 1)
                     if tuple(ids[i:i + SPAN]) in self.spans), None)
        return Overlap(names, span)
