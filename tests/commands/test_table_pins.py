"""Regression pins of the recipe's table (recipes/table.py): hand-written reports with a
distinct value in every column, each whole row and note compared with the text worked out
by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.table import main, rows, speed_row, table

HUMANEVAL = {"prompts": 7, "tau": 3.14159, "capped": 2, "tau_uncapped": 2.71828, "lossless": True,
             "new_tokens": 900, "wall_s": 4.0, "baseline_wall_s": 9.0}
# no capped count (a report from before it was kept), no greedy run, no timing
HELDOUT = {"prompts": 5, "tau": None, "tau_uncapped": None, "lossless": None, "new_tokens": 40, "wall_s": 0.0,
           "baseline_wall_s": None}
SPEED = {"rows": [
    {"mode": "target alone", "batch": 4, "tokens_per_s": 80.04, "speedup": 1.0, "same_as_target": None, "prompts": 4},
    {"mode": "speculative", "batch": 4, "tokens_per_s": 123.456, "speedup": 1.876, "same_as_target": 3, "prompts": 4},
]}
SUMMARY = {"train": 950, "heldout": 50, "by_source": {"code": 900, "question": 100}, "dropped_for_overlap":
           {"code: function name": 12, "code: span": 3}}


def test_a_row_has_every_column_by_hand():
    """tok/s: 900 tokens in 4 s speculative and 9 s by the target alone."""
    assert rows({"results": {"humaneval": HUMANEVAL}}) == [
        "| humaneval | 7 | 3.14 | 2 | 2.72 | yes | 225.0 | 100.0 |"]
    assert rows({"results": {"heldout": HELDOUT, "x": {**HUMANEVAL, "lossless": False}}}) == [
        "| heldout | 5 | - | - | - | - | - | - |", "| x | 7 | 3.14 | 2 | 2.72 | NO | 225.0 | 100.0 |"]


def test_a_speed_row_by_hand():
    assert [speed_row(r) for r in SPEED["rows"]] == ["| target alone | 4 | 80.0 | 1.00x | - |",
                                                    "| speculative | 4 | 123.5 | 1.88x | 3/4 |"]


def write(work: Path, name: str, value: dict) -> None:
    path = work / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def test_the_whole_table_by_hand(tmp_path, capsys):
    write(tmp_path, "eval_humaneval.json", {"tau_count": "z-lab's", "results": {"humaneval": HUMANEVAL}})
    write(tmp_path, "eval_heldout.json", {"tau_count": "every cycle, the last up to its stop token",
                                          "results": {"heldout": HELDOUT}, "speed": SPEED})
    write(tmp_path, "prompts/summary.json", SUMMARY)
    text = main([str(tmp_path), "--seconds", "5430"])
    assert capsys.readouterr().out == text + "\n"
    assert text.splitlines() == [
        "| set | responses | tau | capped | tau without capped | lossless | tok/s speculative | tok/s target |",
        "|---|---|---|---|---|---|---|---|",
        "| humaneval | 7 | 3.14 | 2 | 2.72 | yes | 225.0 | 100.0 |",
        "| heldout | 5 | - | - | - | - | - | - |",
        "",
        "| decoding (held-out prompts) | batch | tokens/s | vs the target alone | same as the target |",
        "|---|---|---|---|---|",
        "| target alone | 4 | 80.0 | 1.00x | - |",
        "| speculative | 4 | 123.5 | 1.88x | 3/4 |",
        "",
        "- tau: every cycle, the last up to its stop token",  # the held-out report's, read last
        "- prompts: 950 for training, 50 held out ({'code': 900, 'question': 100}); dropped for a HumanEval function "
        "name or 10-token span: 15",
        "- tok/s: this project's decoding loop at the evaluation's batch size, speculative against the target alone "
        "(greedy); on a GPU the target's decoding forwards replay as CUDA graphs in both, and so does the drafter's, "
        "the prefill runs eagerly; wall time includes the prefill",
        "- recipe wall time: 90.5 min",
    ]


def test_a_work_directory_without_reports_says_so(tmp_path):
    write(tmp_path, "eval_humaneval.json", {"results": {"humaneval": HUMANEVAL}})  # no tau_count: none said
    lines = table(tmp_path).splitlines()
    assert lines[2:4] == ["| humaneval | 7 | 3.14 | 2 | 2.72 | yes | 225.0 | 100.0 |", ""]
    assert lines[4] == "- tau: no report found" and not any("wall time:" in line for line in lines)
    assert table(tmp_path / "absent").splitlines()[2:4] == ["", "- tau: no report found"]


def test_the_tau_count_is_the_last_report_that_states_one(tmp_path):
    write(tmp_path, "eval_humaneval.json", {"tau_count": "z-lab's", "results": {"humaneval": HUMANEVAL}})
    write(tmp_path, "eval_heldout.json", {"results": {"heldout": HELDOUT}})
    assert "- tau: z-lab's" in table(tmp_path).splitlines()


def test_the_help_says_what_the_command_does(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert "The recipe's table from its evaluation reports: per set the responses, tau (z-lab's" in printed
    assert "--seconds SECONDS  the recipe's wall time so far" in printed
    assert "runs/smollm2" not in printed  # the first paragraph only
