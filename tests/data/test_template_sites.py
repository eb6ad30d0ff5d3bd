"""One chat template, one end of reply: training's tokenising, decoding's evaluation and
regeneration give the target the same prompt tokens and end a reply at the same token,
for every family of ``chat_templates.py``, the shipped demo tokenizer and the word-level
one of ``helpers.py``.

Each site is driven through its own code: training through :func:`turn_tokens` (what
the loss mask covers), decoding through :func:`evaluate_steps` with its decoding loops
replaced by a target that writes out the rendered reply and carries on past it, and
regeneration through :class:`LocalTarget`'s prompt encoder and reply cut.
"""

import pytest
from chat_templates import FAMILIES, Family, assistant, user
from helpers import tiny_drafter, tiny_target, word_tokenizer

from dflash.data.dataset import turn_tokens
from dflash.data.template import encode, render, reply_end_ids
from dflash.decode import batch, speculative
from dflash.decode import evaluate as evaluate_module
from dflash.decode.evaluate import evaluate
from dflash.decode.speculative import DecodeSettings
from dflash.model.drafter import TargetHead
from dflash.model.target import TargetSource
from dflash.regenerate.local import LocalTarget
from dflash.regenerate.records import Sampling

pytestmark = pytest.mark.usefixtures("one_thread")

BEYOND = "then more text"  # what a target that missed the end of its turn would write next


def _demo() -> Family:
    return Family(lambda: TargetSource("demo").tokenizer(), ["<|im_end|>"],
                  [user("count from 3 to 9"), assistant("3 4 5 6 7 8 9"), user("count from 5 to 7"),
                   assistant("5 6 7")], "<|im_end|>")


def _words() -> Family:
    return Family(word_tokenizer, ["<|im_end|>"], [user("w1 w2"), assistant("w3 w4"), user("w5"), assistant("w6")],
                  "<|im_end|>")


CASES = {**FAMILIES, "demo": _demo(), "word-level": _words()}


def target_of(family: Family, tokenizer):
    """A tiny target with the family's vocabulary and generation config."""
    model = tiny_target(vocab=len(tokenizer))
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(t) for t in family.generation_eos]
    return model


def written(tokenizer, messages, i: int, prompt: list[int], kwargs: dict) -> list[int]:
    """What a target given ``prompt`` writes for reply ``i``: the template's rendering of
    the reply, then text past its end, so that each site has to find where it ends."""
    rendered = encode(tokenizer, [render(tokenizer, messages[: i + 1], generation_prompt=False,
                                         template_kwargs=kwargs)])[0]
    assert rendered[: len(prompt)] == prompt
    return rendered[len(prompt) :] + encode(tokenizer, [BEYOND])[0]


def decoding_site(monkeypatch, model, tokenizer, prompts, kwargs: dict, outputs: list[list[int]]):
    """``evaluate`` with a scripted target: returns the prompt ids it was given and the
    response it cut from each ``outputs`` with its own stop tokens."""
    seen = []

    def scripted(target_model, drafter, head, prompt_ids, *, max_new_tokens, eos_ids, **_):
        tokens = outputs[len(seen)]
        seen.append((prompt_ids[0].tolist(), speculative.truncate(tokens, max_new_tokens, eos_ids)))
        return seen[-1][1], [1]
        yield  # a generator, as the decoding loop is

    def greedy(target_model, prompt_ids, max_new_tokens, eos_ids):
        return next(out for ids, out in seen if ids == prompt_ids[0].tolist())
        yield

    # The per-prompt loops, where the batched decoding calls them (for a target decoded one
    # prompt at a time: its cache cannot be cut back per row).
    monkeypatch.setattr(batch, "single", lambda target_model: True)
    monkeypatch.setattr(batch, "speculative_steps", scripted)
    monkeypatch.setattr(batch, "greedy_steps", greedy)
    drafter = tiny_drafter(vocab=len(tokenizer))
    report = evaluate(model, tokenizer, drafter, TargetHead.of(model), prompts=prompts,
                      settings=DecodeSettings(max_new_tokens=1000, template_kwargs=kwargs, batch_size=1))
    assert report["lossless"] is True and report["prompts"] == len(prompts)
    assert len(seen) == len(prompts), "the scripted target was not the one decoding"
    return seen


@pytest.mark.parametrize("case", CASES)
def test_training_decoding_and_regeneration_render_the_same_prompt_and_end_at_the_same_token(case, monkeypatch):
    family = CASES[case]
    tokenizer = family.tokenizer()
    messages, kwargs = family.messages, family.template_kwargs
    model = target_of(family, tokenizer)
    regenerate = LocalTarget(model, tokenizer, Sampling(max_new_tokens=1000, temperature=0, template_kwargs=kwargs))

    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    trained = turn_tokens(tokenizer, messages, kwargs)  # (prompt, reply) per assistant turn
    outputs = [written(tokenizer, messages, i, prompt, kwargs) for i, (prompt, _) in zip(turns, trained)]
    decoded = decoding_site(monkeypatch, model, tokenizer, [messages[:i] for i in turns], kwargs, outputs)

    end_of_turn = tokenizer.convert_tokens_to_ids(family.end_of_turn)
    for i, (prompt, reply), output, (decoded_prompt, decoded_reply) in zip(turns, trained, outputs, decoded):
        assert regenerate.encode(messages[:i]) == decoded_prompt == prompt
        regenerated = regenerate.reply(output)
        assert regenerated.finished and regenerated.tokens == len(reply)
        assert decoded_reply == output[: len(reply)] == reply
        assert reply[-1] == end_of_turn and reply.count(end_of_turn) == 1
        assert regenerated.text == tokenizer.decode(reply[:-1])


@pytest.mark.parametrize("case", CASES)
def test_the_end_of_a_reply_is_the_template_s_end_of_turn_token(case):
    """The tokens that end a reply hold the family's end of turn, and every eos of its
    generation config, but no token that stands inside text."""
    family = CASES[case]
    tokenizer = family.tokenizer()
    ends = reply_end_ids(tokenizer, target_of(family, tokenizer).generation_config)
    assert tokenizer.convert_tokens_to_ids(family.end_of_turn) in ends
    assert {tokenizer.convert_tokens_to_ids(t) for t in family.generation_eos} <= ends
    inside = {tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.mask_token_id} - {None}
    assert not inside & ends
    assert not {tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>")} & ends - {tokenizer.unk_token_id}


def test_a_tokenizer_without_a_chat_template_cannot_render():
    tokenizer = word_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        render(tokenizer, [user("w1")], generation_prompt=True)


def test_thinking_changes_the_qwen3_prompt_alike_at_every_site():
    """``enable_thinking=false`` appends the empty reasoning block to the generation
    prompt; the template arguments reach every site."""
    family = FAMILIES["qwen3 thinking"]
    tokenizer = family.tokenizer()
    on = evaluate_module.encode_prompt(tokenizer, [user("2+2?")], {"enable_thinking": True})[0].tolist()
    off = evaluate_module.encode_prompt(tokenizer, [user("2+2?")], {"enable_thinking": False})[0].tolist()
    assert tokenizer.decode(off[len(on) :]) == "<think>\n\n</think>\n\n" and off[: len(on)] == on
    regenerate = LocalTarget(target_of(family, tokenizer), tokenizer,
                             Sampling(max_new_tokens=8, template_kwargs={"enable_thinking": False}))
    assert regenerate.encode([user("2+2?")]) == off
    [(prompt, _)] = turn_tokens(tokenizer, [user("2+2?"), assistant("4")], {"enable_thinking": False})
    assert prompt == off
