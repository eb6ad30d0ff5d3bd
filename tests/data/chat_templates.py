"""Chat templates and tokenizers built in memory, for the tests of tokenising and rendering.

The tokenizers are byte-level, so decoding gives back the exact text, with the
special tokens of the families whose templates are written here as small faithful
jinja strings: ChatML (Qwen2.5), Qwen3 (which drops the reasoning of replies before
the last user message and reads ``enable_thinking``), Llama 3 and DeepSeek-R1 (its
first release, whose generation prompt is the bare assistant tag). :data:`FAMILIES`
pairs each with the tokenizer, generation config and conversation of that family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

CHATML = r"""
{%- for m in messages -%}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

QWEN3 = r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set answer = m.content.split('</think>')[-1].lstrip('\n') -%}
{%- set thought = m.content.split('</think>')[0].split('<think>')[-1].strip('\n') if '</think>' in m.content else '' -%}
{%- if loop.index0 > ns.last_user and (loop.last or thought) -%}
{{- '<|im_start|>assistant\n<think>\n' + thought + '\n</think>\n\n' + answer + '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>assistant\n' + answer + '<|im_end|>\n' -}}
{%- endif -%}
{%- else -%}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""

LLAMA3 = r"""
{{- bos_token -}}
{%- if messages[0].role == 'system' -%}
{%- set system = messages[0].content -%}{%- set rest = messages[1:] -%}
{%- else -%}
{%- set system = 'Cutting Knowledge Date: December 2023' -%}{%- set rest = messages -%}
{%- endif -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' + system + '<|eot_id|>' -}}
{%- for m in rest -%}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""

# DeepSeek-R1 as first released: the system prompt bare after BOS, and the reasoning
# dropped from every reply (a later revision adds "<think>\n" to the generation prompt).
DEEPSEEK_R1 = r"""
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- endif -%}{%- endfor -%}
{{- bos_token + ns.system -}}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{{- '<｜User｜>' + m.content -}}{%- endif -%}
{%- if m.role == 'assistant' -%}
{%- set content = m.content.split('</think>')[-1] if '</think>' in m.content else m.content -%}
{{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}
"""

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def make_tokenizer(template: str, bos: str | None = None, eos: str = "<|im_end|>", *, pad: str | None = None,
                   specials: list[str] = SPECIALS, plain: tuple[str, ...] = ("<think>", "</think>")
                   ) -> PreTrainedTokenizerFast:
    """Byte-level BPE over whole texts with one merge (two newlines), so that a token
    can span the boundary between a prompt and its reply. ``plain`` tokens are added
    but not special, as Qwen3's ``<think>``."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["ĊĊ"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, [("Ċ", "Ċ")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"eos_token": eos, "additional_special_tokens": specials,
                                  **({"bos_token": bos} if bos else {}), **({"pad_token": pad} if pad else {})})
    tokenizer.add_tokens(list(plain))
    tokenizer.chat_template = template
    return tokenizer


def system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


@dataclass(frozen=True)
class Family:
    """A model family as the tests meet it: its tokenizer, the eos ids of its generation
    config, the template arguments and a multi-turn conversation, and the token its
    replies end with."""

    tokenizer: Callable[[], PreTrainedTokenizerBase]
    generation_eos: list[str]
    messages: list[dict[str, str]]
    end_of_turn: str
    template_kwargs: dict = field(default_factory=dict)


QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                   "<|eot_id|>", "<|python_tag|>"]
R1_BOS, R1_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def _qwen3() -> PreTrainedTokenizerFast:
    return make_tokenizer(QWEN3, eos="<|im_end|>", pad="<|endoftext|>", specials=QWEN3_SPECIALS)


FAMILIES = {
    "qwen3 thinking": Family(
        _qwen3, ["<|im_end|>", "<|endoftext|>"],
        [system("Be brief."), user("2+2?"), assistant("<think>\nadd\n</think>\n\n4"), user("times 3?"),
         assistant("<think>\nmultiply\n</think>\n\n12")],
        "<|im_end|>", {"enable_thinking": True}),
    "qwen3 no thinking": Family(
        _qwen3, ["<|im_end|>", "<|endoftext|>"],
        [user("2+2?"), assistant("4"), user("times 3?"), assistant("12")],
        "<|im_end|>", {"enable_thinking": False}),
    # Qwen2.5's tokenizer ends text with <|endoftext|> and turns with <|im_end|>.
    "chatml with a system message": Family(
        lambda: make_tokenizer(CHATML, eos="<|endoftext|>", specials=QWEN3_SPECIALS), ["<|im_end|>", "<|endoftext|>"],
        [system("You count."), user("1 to 3"), assistant("1 2 3"), user("4 to 5"), assistant("4 5")],
        "<|im_end|>"),
    "llama 3": Family(
        lambda: make_tokenizer(LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>", specials=LLAMA3_SPECIALS),
        ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        [system("Answer in digits."), user("two plus two"), assistant("4"), user("and times 3?"), assistant(" 12\n")],
        "<|eot_id|>"),
    # R1's padding token is its eos, which is also its end of turn.
    "deepseek-r1": Family(
        lambda: make_tokenizer(DEEPSEEK_R1, bos=R1_BOS, eos=R1_EOS, pad=R1_EOS, specials=[],
                               plain=("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")),
        [R1_EOS],
        [system("You are a helpful assistant."), user("2+2?"), assistant("4"), user("times 3?"), assistant("12")],
        R1_EOS),
}
