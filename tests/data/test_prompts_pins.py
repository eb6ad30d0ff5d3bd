"""Regression pins of the prompt builder and its HumanEval guard (dflash.prompts,
dflash.data.overlap): a code task that names a HumanEval function only qualified
(``module.name``) is dropped in every wording, checked again here by a plain look at each
kept task's names; the held-out split is a fixed function of the text (golden values, the
same in every process); and the guard's parts against hand-made cases."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dflash import prompts
from dflash.data.docstrings import Documented, task
from dflash.data.overlap import SPAN, BenchmarkGuard, Overlap, function_names, names_in, word_tokens
from dflash.decode.public_sets import load_rows

HUMANEVAL = "tests/fixtures/benchmarks/humaneval.jsonl"  # entry points add, is_even, first
DOC = "Combine the two values into one, the way the readers of this module expect them to be combined."
WORDINGS = {  # the start of each kind of task (dflash.data.docstrings.task), and whether it names `name(`
    ("function", "Write a Python function `"): True,
    ("function", "Explain what `"): False,
    ("function", "Write pytest unit tests for `"): True,
    ("class", "Implement a Python class `"): True,
    ("class", "Explain what the class `"): False,
    ("method", "Explain what `"): False,
}


def one_of_each_wording(name: str) -> list[Documented]:
    """A documented definition called ``name`` for each wording of :data:`WORDINGS`, found by
    trying modules until each wording has come up (the wording follows from the module)."""
    found: dict = {}
    for i in range(200):
        for kind, qualname in (("function", name), ("class", name), ("method", f"Box.{name}")):
            item = Documented(f"pkg{i}.util", qualname, kind, "(a, b)", DOC)
            key = next((k for k in WORDINGS if k[0] == kind and task(item).startswith(k[1])), None)
            found.setdefault(key, item)
    assert set(WORDINGS) <= set(found)
    return [found[k] for k in WORDINGS]


def build(tmp_path: Path, monkeypatch, items: list[Documented], heldout: float = 0.05) -> tuple[dict, list[dict]]:
    monkeypatch.setattr(prompts, "collect", lambda roots: list(items))
    monkeypatch.setattr(prompts, "demo_prompts", lambda count, seed: [])
    summary = prompts.main(["build", "--out", str(tmp_path), "--packages", "", "--demo", "0", "--humaneval", HUMANEVAL,
                            "--heldout", str(heldout)])
    kept = [json.loads(line) for split in ("train", "heldout")
            for line in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
    return summary, kept


def humaneval_names() -> set[str]:
    """HumanEval's function names by a plain look: each row's entry point and every ``def``."""
    rows = load_rows("humaneval", HUMANEVAL)
    return {r["entry_point"] for r in rows} | {n for r in rows for n in re.findall(r"def (\w+)", r["prompt"])}


def named_in(text: str) -> set[str]:
    """Every name a task writes in backticks, qualified or not, called or not: the last part
    of each dotted identifier that opens a backtick."""
    return {dotted.rsplit(".", 1)[-1] for dotted in re.findall(r"`([\w.]+)", text)}


def test_every_wording_of_a_task_on_a_humaneval_function_is_dropped(tmp_path, monkeypatch):
    """``add`` is a HumanEval entry point: the explain wordings name it only as
    ``pkg.util.add`` (no backticked or called bare name), and are dropped all the same,
    counted under "function name"; a definition of another name is kept."""
    items = one_of_each_wording("add")
    assert [("add(" in task(d)) for d in items] == list(WORDINGS.values())
    assert any(f"`{d.module}.{d.qualname}`" in task(d) for d in items)
    kept_item = Documented("pkg0.util", "frobnicate", "function", "(a, b)", DOC)
    summary, kept = build(tmp_path, monkeypatch, [*items, kept_item])
    assert summary["by_source"] == {"code": 1}
    assert summary["dropped_for_overlap"] == {"code: function name": len(WORDINGS)}
    assert [r["conversations"][0]["content"] for r in kept] == [task(kept_item)]


def test_no_kept_task_names_a_humaneval_function_by_a_plain_check(tmp_path, monkeypatch):
    """The independent check the suite's build test makes, extended to each kept task's own
    definition name, whether the task writes it bare, called or qualified."""
    names = humaneval_names()
    assert names == {"add", "is_even", "first"}
    items = [d for name in ("add", "is_even", "first", "frobnicate", "tally") for d in one_of_each_wording(name)]
    summary, kept = build(tmp_path, monkeypatch, items)
    for record in kept:
        text = record["conversations"][0]["content"]
        assert not named_in(text) & names, text
        assert named_in(text) & {"frobnicate", "tally"}, text  # the plain check sees each task's own name
    assert summary["by_source"] == {"code": 2 * len(WORDINGS)}


# the held-out split ------------------------------------------------------------------------

TEXTS = ["How do volcanoes form?", "Why is the sky blue?", "What is a list?", "Explain recursion.",
         "Write a haiku about rain.", "How do birds fly?", "What is jazz?", "Name three rivers.",
         "How do magnets work?", "What is a prime number?", "Why do cats purr?", "How is bread baked?"]
# By SHA-256 of the text: the first 8 bytes, little-endian, over 2**64 (0.595, 0.425, 0.389, 0.500,
# 0.380, 0.687, 0.232, 0.356, 0.608, 0.568, 0.315, 0.550), below the fraction.
HELD_AT_HALF = [False, True, True, False, True, False, True, True, False, False, True, False]


def test_the_held_out_texts_are_fixed_golden_values():
    assert [prompts.held_out(t, 0.5) for t in TEXTS] == HELD_AT_HALF
    assert [prompts.held_out(t, 0.3) for t in TEXTS] == [v < 0.3 for v in
                                                         (0.595, 0.425, 0.389, 0.5, 0.38, 0.687, 0.232, 0.356, 0.608,
                                                          0.568, 0.315, 0.55)]
    assert not any(prompts.held_out(t, 0.0) for t in TEXTS) and all(prompts.held_out(t, 1.0) for t in TEXTS)


def test_a_build_splits_by_the_same_golden_values(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts, "questions_from", lambda path: list(TEXTS))
    monkeypatch.setattr(prompts, "collect", lambda roots: [])
    monkeypatch.setattr(prompts, "demo_prompts", lambda count, seed: [])
    summary = prompts.main(["build", "--out", str(tmp_path), "--packages", "", "--demo", "0", "--humaneval",
                            HUMANEVAL, "--questions", "asked.jsonl", "--heldout", "0.5"])
    texts = {split: [json.loads(line)["conversations"][0]["content"]
                     for line in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
             for split in ("train", "heldout")}
    assert texts["heldout"] == [t for t, held in zip(TEXTS, HELD_AT_HALF) if held]
    assert texts["train"] == [t for t, held in zip(TEXTS, HELD_AT_HALF) if not held]
    assert (summary["train"], summary["heldout"], summary["heldout_fraction"]) == (6, 6, 0.5)


# the guard's parts --------------------------------------------------------------------------

PROMPT = 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b.\n    >>> add(2, 3)\n    5\n    """\n'


def test_names_are_definitions_backticks_and_calls_not_words():
    assert names_in("def foo(x): return bar(x) + `baz` and `qux(1)` then add numbers, `the.dotted` name") == {
        "foo", "bar", "baz", "qux"}
    assert function_names([PROMPT, "def helper():\n    pass\ndef  spaced(): pass"], ["entry"]) == {
        "add", "helper", "spaced", "entry"}
    # an entry point counts though no prompt defines it
    assert BenchmarkGuard([PROMPT], ["sum_squares"]).overlap("What does sum_squares([1]) return?").names == {
        "sum_squares"}


def test_a_span_is_any_ten_tokens_of_a_prompt_the_last_ten_too():
    guard = BenchmarkGuard([PROMPT], ["add"])
    tokens = word_tokens(PROMPT)
    assert len(tokens) == 39
    for start in (0, 13, len(tokens) - SPAN):
        window = " ".join(tokens[start:start + SPAN])
        assert guard.overlap(window).span == tuple(tokens[start:start + SPAN]), start
    assert not guard.overlap(" ".join(tokens[-SPAN + 1:]))  # nine tokens


def test_what_an_overlap_says():
    assert str(Overlap({"is_even", "add"}, None)) == "function name add"
    assert str(Overlap(set(), ("a",) * SPAN)) == f"10-token span {('a',) * SPAN!r}"
    assert not Overlap(set(), None) and Overlap({"x"}, None) and Overlap(set(), ())
    guard = BenchmarkGuard([PROMPT], ["add"], tokenize=lambda text: list(text.replace(" ", "")))
    found = guard.overlap("nothing in common, own name only", own_name="add")
    assert found.names == {"add"} and found.span is None
    assert guard.overlap("the sum of a and b.").span == tuple("thesumofaa")  # the tokenizer given is used
