"""Regression pins of the public-set evaluation's budget count (``python -m dflash.eval
--sets``): an answer that runs to ``--max-new-tokens`` without its stop token is counted in
``capped`` and left out of ``tau_uncapped``, on the HumanEval fixture with the demo target,
whose greedy answers are known token by token."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import tiny_drafter

from dflash.decode import public_sets
from dflash.eval import main
from dflash.model.drafter import DFlashDrafter
from dflash.model.export import save_export

FIXTURES = Path(__file__).parents[1] / "fixtures" / "benchmarks"
EOS = 2  # the demo tokenizer's <|endoftext|>, the harness's stop
# Token 8 first comes in the demo target's greedy answers to the three HumanEval fixture prompts at
# the 40th, past the 40th and the 13th new token (the answers count up and down and never write EOS).
STOP_AT_13 = 8

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> Path:
    """A random drafter shaped for the demo target, exported."""
    cfg = tiny_drafter(hidden=128, vocab=408, layer_ids=(1, 3, 5), block_size=4).config
    torch.manual_seed(0)
    model = DFlashDrafter(dataclasses.replace(cfg, num_target_layers=8, mask_token_id=3))
    return save_export(model, tmp_path_factory.mktemp("drafter") / "export", dtype="float32")


def humaneval(drafter: Path, tmp_path: Path, max_new_tokens: int, source: Path | None = None) -> dict:
    sets = f"humaneval={source}" if source else "humaneval"
    report = main(["--target", "demo", "--drafter", str(drafter), "--sets", sets, "--sets-dir", str(FIXTURES),
                   "--max-new-tokens", str(max_new_tokens), "--device", "cpu", "--out", str(tmp_path / "eval.json")])
    return report["results"]["humaneval"]


def test_answers_that_all_run_to_the_budget_are_all_capped(drafter, tmp_path):
    r = humaneval(drafter, tmp_path, 8)
    assert (r["prompts"], r["new_tokens"], r["capped"], r["tau_uncapped"]) == (3, 24, 3, None)
    assert r["tau"] is not None and r["lossless"] is True


def test_an_answer_that_stops_early_is_not_capped(drafter, tmp_path, monkeypatch):
    """With token 8 a stop token too, the third answer ends at its 13th token, inside the
    budget of 16: one fewer capped, and tau without the capped is that answer's alone."""
    monkeypatch.setattr(public_sets, "harness_stop_ids", lambda tokenizer: frozenset({EOS, STOP_AT_13}))
    r = humaneval(drafter, tmp_path, 16)
    assert (r["prompts"], r["new_tokens"], r["capped"], r["lossless"]) == (3, 16 + 13 + 16, 2, True)
    third = tmp_path / "third.jsonl"
    third.write_text((FIXTURES / "humaneval.jsonl").read_text().splitlines()[2] + "\n")
    alone = humaneval(drafter, tmp_path, 16, third)
    assert (alone["prompts"], alone["new_tokens"], alone["capped"]) == (1, 13, 0)
    assert alone["tau_uncapped"] == alone["tau"]
    assert r["tau_uncapped"] == pytest.approx(alone["tau"], rel=1e-12) and r["tau_uncapped"] != r["tau"]


def test_a_sets_summary_by_hand():
    """Three answers of acceptance (1, 2), (3, 1, 1) and (2), the first and last capped: tau
    is the mean of 1.5, 5/3 and 2; without the capped, 5/3."""
    turns = [public_sets.Turn([1, 2], 4, 0.5, capped=True, lossless=True, baseline_wall_s=1.0),
             public_sets.Turn([3, 1, 1], 5, 0.25, lossless=True, baseline_wall_s=2.0),
             public_sets.Turn([2], 3, 0.25, capped=True, lossless=True, baseline_wall_s=0.5)]
    assert public_sets.summarize(turns, 0.0, 4) == {
        "temperature": 0.0, "tau": pytest.approx((1.5 + 5 / 3 + 2) / 3), "capped": 2,
        "tau_uncapped": pytest.approx(5 / 3),
        "histogram": {"1": 3, "2": 2, "3": 1, "4": 0}, "lossless": True, "divergences": [], "prompts": 3,
        "new_tokens": 12, "cycles": 6, "wall_s": 1.0, "baseline_wall_s": 3.5}
    assert public_sets.summarize(turns[:1], 0.0, 2)["tau_uncapped"] is None
