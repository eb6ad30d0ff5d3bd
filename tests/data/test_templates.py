"""Loss masks under real chat templates: exactly the replies the target produced, each
with its end-of-turn token, in the context the target produced them.

The tokenizers and templates are those of ``chat_templates.py``: byte-level, so
decoding gives back the exact text, with the special tokens of ChatML (Qwen) and
Llama 3 and templates that behave like theirs. Qwen3's drops the reasoning of replies
before the last user message, which makes multi-turn renderings not prefix-stable.
"""

import json

import pytest
from chat_templates import CHATML, LLAMA3, QWEN3, assistant, make_tokenizer, user

from dflash.data.dataset import DataSettings, conversation_samples, load_dataset
from dflash.data.records import BadRecord

# Rewrites every reply, the last one too: what the target generated cannot be told.
STRIPS_ALL = r"""
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' + m.content.split('</think>')[-1] + '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n<think>\n' -}}{%- endif -%}
"""

ALTERNATING = r"""
{%- for m in messages -%}
{%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}{{- raise_exception('roles must alternate') -}}{%- endif -%}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""


def supervised(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """Each run of supervised tokens, decoded."""
    runs, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            runs, run = runs + [run], []
    return [tokenizer.decode(r) for r in runs + ([run] if run else [])]


def context(tokenizer, ids: list[int], mask: list[int]) -> str:
    """The tokens before the last supervised run, decoded."""
    last = max(i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
    return tokenizer.decode(ids[:last])


def test_qwen3_single_turn_supervises_the_reasoning_and_the_answer():
    tok = make_tokenizer(QWEN3)
    [(name, ids, mask)] = conversation_samples(tok, [user("2+2?"), assistant("<think>\nadd\n</think>\n\n4")])
    assert name == ""
    reply = "<think>\nadd\n</think>\n\n4<|im_end|>"
    assert supervised(tok, ids, mask) == [reply]
    assert tok.decode(ids) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n" + reply


def test_qwen3_multi_turn_gives_each_reasoning_turn_its_own_context():
    """In turn 2's context the template shows reply 1 without its reasoning, which the
    target never generated: reply 1 is taught in its own context, and turn 2's
    sample keeps the stripped reply 1 as unsupervised prompt."""
    tok = make_tokenizer(QWEN3)
    messages = [{"role": "system", "content": "Be brief."}, user("2+2?"), assistant("<think>\nadd\n</think>\n\n4"),
                user("times 3?"), assistant("<think>\nmultiply\n</think>\n\n12")]
    first, second = conversation_samples(tok, messages)
    assert first[0] == "#2" and second[0] == "#4"
    assert supervised(tok, *first[1:]) == ["<think>\nadd\n</think>\n\n4<|im_end|>"]
    assert context(tok, *first[1:]) == tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert supervised(tok, *second[1:]) == ["<think>\nmultiply\n</think>\n\n12<|im_end|>"]
    assert context(tok, *second[1:]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\ntimes 3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen3_without_thinking_supervises_only_the_answer():
    """With ``enable_thinking=false`` the empty reasoning block is part of the prompt the
    target was given, so it is not taught."""
    tok = make_tokenizer(QWEN3)
    messages = [user("2+2?"), assistant("4"), user("times 3?"), assistant("12")]
    samples = conversation_samples(tok, messages, {"enable_thinking": False})
    assert [supervised(tok, ids, mask) for _, ids, mask in samples] == [["4<|im_end|>"], ["12<|im_end|>"]]
    assert all(context(tok, ids, mask).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
               for _, ids, mask in samples)


def test_chatml_with_a_system_prompt_is_one_sample_for_all_turns():
    tok = make_tokenizer(CHATML)
    messages = [{"role": "system", "content": "You count."}, user("1 to 3"), assistant("1 2 3"), user("4 to 5"),
                assistant("4 5"), user("6"), assistant("6")]
    [(name, ids, mask)] = conversation_samples(tok, messages)
    assert name == ""
    assert supervised(tok, ids, mask) == ["1 2 3<|im_end|>", "4 5<|im_end|>", "6<|im_end|>"]
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False).removesuffix("\n")


def test_llama3_supervises_the_trimmed_reply_and_eot_only():
    tok = make_tokenizer(LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>")
    messages = [user("count to 3"), assistant("  1 2 3\n"), user("and 4?"), assistant("4")]
    [(_, ids, mask)] = conversation_samples(tok, messages)
    assert supervised(tok, ids, mask) == ["1 2 3<|eot_id|>", "4<|eot_id|>"]
    assert tok.decode(ids).startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting")
    assert ids.count(tok.bos_token_id) == 1


def test_llama3_with_its_own_system_prompt():
    tok = make_tokenizer(LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>")
    messages = [{"role": "system", "content": "Answer in digits."}, user("two plus two"), assistant("4")]
    [(_, ids, mask)] = conversation_samples(tok, messages)
    assert supervised(tok, ids, mask) == ["4<|eot_id|>"]
    assert context(tok, ids, mask) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nAnswer in digits.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\ntwo plus two<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_a_reply_whose_first_token_would_merge_with_the_prompt_is_encoded_after_it():
    """``assistant\\n`` + ``\\nhi`` encodes as one two-newline token across the boundary;
    the target saw the prompt's newline and then generated its own."""
    tok = make_tokenizer(CHATML)
    messages = [user("hi"), assistant("\nhi"), user("again"), assistant("hi")]
    first, second = conversation_samples(tok, messages)
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    reply = tok.encode("\nhi<|im_end|>", add_special_tokens=False)
    assert first[1] == tok.encode(prompt, add_special_tokens=False) + reply
    assert supervised(tok, *first[1:]) == ["\nhi<|im_end|>"]
    assert supervised(tok, *second[1:]) == ["hi<|im_end|>"]


@pytest.mark.parametrize("template, messages", [
    (STRIPS_ALL, [user("2+2?"), assistant("<think>\nadd\n</think>\n\n4")]),
    (ALTERNATING, [user("a"), user("b"), assistant("c")]),
])
def test_a_template_that_cannot_show_what_the_target_saw_is_a_template_problem(template, messages):
    with pytest.raises(BadRecord, match="^template: "):
        conversation_samples(make_tokenizer(template), messages)


def test_a_multi_turn_qwen3_dataset_is_not_skipped(tmp_path):
    conversations = [
        [user(f"{a}+{a}?"), assistant(f"<think>\nadd {a}\n</think>\n\n{2 * a}"), user("and times 3?"),
         assistant(f"<think>\nmultiply\n</think>\n\n{6 * a}")]
        for a in range(1, 6)
    ]
    path = tmp_path / "qwen3.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    ds = load_dataset(DataSettings(str(path), max_len=1000, min_loss_tokens=2, strict=True), make_tokenizer(QWEN3))
    assert not ds.skipped and not ds.problems
    assert [s.source.rsplit(":", 1)[1] for s in ds.samples] == [f"{line}#{i}" for line in range(1, 6) for i in (1, 3)]
