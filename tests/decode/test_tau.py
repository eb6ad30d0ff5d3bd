"""tau: its aggregation (mean over responses of accepted tokens per cycle, bonus
included), and the exact value the eval report carries for scripted drafters.

A perfect drafter (drafts = the target's greedy tokens) accepts the whole block
every cycle, so each of its responses has tau exactly B, whatever its length or
where it stops. A drafter that is always wrong accepts only the bonus, tau exactly
1. Mixing them pins the aggregation: per response first, then over responses,
which is (B + 1) / 2 for one of each, never the pooled mean over cycles.
"""

import json

import pytest
from helpers import (
    OneHotHead,
    PromptScriptDrafter,
    greedy_reference,
    tiny_drafter,
    varied_target,
    word_tokenizer,
)
from torch import nn

from dflash.data.template import reply_end_ids
from dflash.decode.evaluate import encode_prompt, evaluate, evaluate_datasets, tau
from dflash.decode.speculative import DecodeSettings

pytestmark = pytest.mark.usefixtures("one_thread")

B, VOCAB, MAX_NEW = 4, 96, 17


def test_tau_is_the_mean_over_responses_of_the_mean_per_cycle():
    # responses [1, 4] and [2]: per response 2.5 and 2.0, so 2.25 (pooled over cycles: 7/3)
    assert tau([[1, 4], [2]]) == 2.25
    assert tau([[1, 4], [2], []]) == 2.25  # a response without a cycle does not count
    assert tau([[3]]) == 3.0
    assert tau([[16] * 5, [1] * 40]) == 8.5
    assert tau([[2, 3, 5], [1, 1, 1, 1], [4]]) == pytest.approx((10 / 3 + 1 + 4) / 3, abs=1e-12)
    assert tau([]) is None
    assert tau([[], []]) is None


# ---------------------------------------------------------------------------
# Scripted drafters through the real decoding loop and report
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target() -> nn.Module:
    return varied_target(vocab=VOCAB)


def conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"w{i} w{i + 3} w{2 * i + 1} w{i + 7}"}]


def oracle(target, tokenizer, perfect: dict[int, bool]) -> PromptScriptDrafter:
    """Proposes each prompt's greedy continuation, or, for a prompt marked wrong, a token
    that is never the greedy one."""
    scripts = []
    for i, ok in perfect.items():
        prompt = encode_prompt(tokenizer, conversation(i))[0].tolist()
        seq = greedy_reference(target, prompt, len(prompt) + MAX_NEW + B)
        scripts.append((seq, seq if ok else [(t + 1) % VOCAB for t in seq]))
    return PromptScriptDrafter(tiny_drafter(vocab=VOCAB, block_size=B).config, target, scripts)


def expected_histogram(target, tokenizer, perfect: dict[int, bool], eos: set[int]) -> dict[str, int]:
    """Cycles by hand: the first token comes from the prefill, then each cycle adds B
    tokens (perfect) or 1 (always wrong) until MAX_NEW tokens or a stop token."""
    hist = {str(k): 0 for k in range(1, B + 1)}
    for i, ok in perfect.items():
        prompt = encode_prompt(tokenizer, conversation(i))[0].tolist()
        new = greedy_reference(target, prompt, len(prompt) + MAX_NEW + B)[len(prompt):]
        done, last = 1, new[:1]
        while done < MAX_NEW and not set(last) & eos:
            step = B if ok else 1
            last = new[done : done + step]
            done += step
            hist[str(step)] += 1
    return hist


def test_perfect_drafter_reports_tau_equal_to_the_block_size(target):
    tokenizer = word_tokenizer(VOCAB)
    perfect = {1: True, 2: True, 5: True}
    drafter = oracle(target, tokenizer, perfect)
    report = evaluate(target, tokenizer, drafter, OneHotHead(VOCAB), prompts=[conversation(i) for i in perfect],
                      settings=DecodeSettings(max_new_tokens=MAX_NEW))
    assert report["tau"] == float(B)
    assert report["lossless"] is True
    eos = reply_end_ids(tokenizer, target.generation_config)
    hist = expected_histogram(target, tokenizer, perfect, eos)
    assert report["histogram"] == hist and hist[str(B)] >= 3


def test_report_averages_per_response_then_over_responses_and_datasets(target, tmp_path):
    """Through evaluate_datasets, which writes eval.json: dataset "perfect" has tau B,
    dataset "mixed" (one perfect, one always-wrong response) (B + 1) / 2, and the
    report's headline tau is the mean of the two."""
    tokenizer = word_tokenizer(VOCAB)
    perfect = {1: True, 2: True, 3: True, 4: False}
    drafter = oracle(target, tokenizer, perfect)
    for name, ids in (("perfect", [1, 2]), ("mixed", [3, 4])):
        lines = [json.dumps({"conversations": conversation(i)}) for i in ids]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    datasets = {name: str(tmp_path / f"{name}.jsonl") for name in ("perfect", "mixed")}
    out = tmp_path / "eval.json"
    evaluate_datasets(target, tokenizer, drafter, OneHotHead(VOCAB), drafter_dir=tmp_path / "export", datasets=datasets,
                      out_path=out, settings=DecodeSettings(max_new_tokens=MAX_NEW, max_prompts=8))

    report = json.loads(out.read_text())
    assert report["results"]["perfect"]["tau"] == float(B)
    assert report["results"]["mixed"]["tau"] == (B + 1) / 2
    assert report["tau"] == (B + (B + 1) / 2) / 2
    assert report["lossless"] is True
    mixed = report["results"]["mixed"]
    pooled = (B * mixed["histogram"][str(B)] + mixed["histogram"]["1"]) / mixed["cycles"]
    assert abs(pooled - mixed["tau"]) > 0.5  # the pooled mean would be a different number


def test_responses_at_the_budget_are_counted_and_left_out_of_tau_uncapped():
    """A response that ran to the budget without its stop token is capped; one that ends
    with the stop exactly at the budget is not."""
    from dflash.decode.evaluate import at_budget, budget_split

    assert at_budget([5, 6, 7], 3, {9}) and not at_budget([5, 6, 9], 3, {9}) and not at_budget([5, 9], 3, {9})
    split = budget_split([[4, 4, 4], [1, 2], [3]], [True, False, False])
    assert split == {"capped": 1, "tau_uncapped": (1.5 + 3) / 2}
    assert budget_split([[4]], [True]) == {"capped": 1, "tau_uncapped": None}
