"""The chat template: conversations to token ids, and the tokens that end a reply.

One renderer and one end-of-reply rule for every place that prompts the target or
reads its replies: training's loss masks (:mod:`dflash.data.dataset`), decoding's
prompts and stops (:mod:`dflash.decode.evaluate`) and regeneration
(:mod:`dflash.regenerate`). So the drafter learns each reply in the context the
target is given when it decodes, and is taught to end a reply exactly where the
target stops. The template arguments (``data.chat_template_kwargs``, e.g. Qwen3's
``enable_thinking``) go with every rendering.

Imports no model, objective or run code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from jinja2.exceptions import TemplateError
from transformers import GenerationConfig, PreTrainedTokenizerBase

from dflash.data.records import BadRecord

# ChatML's end of turn: some tokenizers hold it as a plain added token, outside eos.
CHATML_END = "<|im_end|>"

Messages = Sequence[Mapping[str, str]]


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    *,
    generation_prompt: bool,
    template_kwargs: Mapping | None = None,
) -> str:
    """``messages`` through the tokenizer's chat template, as text; with
    ``generation_prompt`` it ends in the assistant header, as a server renders a
    conversation to ask for the next reply.

    A template that refuses the conversation (``raise_exception``, a Jinja error) is a
    ``template`` :class:`BadRecord`: that record is skipped. A tokenizer without a chat
    template is a ValueError: nothing could be rendered."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__} {tokenizer.name_or_path!r}) has no chat "
                         "template: conversations cannot be rendered as the target reads them")
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt,
                                             **dict(template_kwargs or {}))
    except TemplateError as e:
        raise BadRecord(f"template: the chat template refuses this conversation: {e}") from None


def encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Rendered texts as token ids. Nothing is added: the template holds any BOS."""
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Messages, template_kwargs: Mapping | None = None
               ) -> list[int]:
    """The ids the target is given to write the reply after ``messages``: rendered with
    the generation prompt, then encoded (transformers 5 returns a dict from a
    tokenizing ``apply_chat_template``, so the text is encoded here)."""
    text = render(tokenizer, messages, generation_prompt=True, template_kwargs=template_kwargs)
    return encode(tokenizer, [text])[0]


def reply_end_ids(tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig | None = None
                  ) -> frozenset[int]:
    """The tokens a reply ends at: the tokenizer's eos, ChatML's ``<|im_end|>`` where the
    vocabulary holds it, the generation config's eos ids when there is one, and every
    other special token but those that stand inside text (unknown, padding, mask, BOS).

    Training cuts a rendered reply after the first of them (:func:`end_of_reply`), so
    the template's end-of-turn token is taught and what the template writes after it
    (ChatML's newline) is not; decoding and regeneration stop generating at them. The
    generation config comes with a loaded target; training reads only the tokenizer,
    whose rendered replies reach the template's own end-of-turn token first."""
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    inside = {tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.mask_token_id}
    ends = (special - inside) | {tokenizer.eos_token_id}
    chatml = tokenizer.convert_tokens_to_ids(CHATML_END)
    if chatml != tokenizer.unk_token_id:
        ends.add(chatml)
    generation_eos = getattr(generation_config, "eos_token_id", None)
    ends |= set(generation_eos) if isinstance(generation_eos, (list, tuple)) else {generation_eos}
    return frozenset(i for i in ends if isinstance(i, int))


def end_of_reply(tokens: Iterable[int], ends: frozenset[int] | set[int]) -> int | None:
    """How many of ``tokens`` the reply keeps: up to and with the first end token; None
    when there is none (a reply that broke off)."""
    return next((n + 1 for n, t in enumerate(tokens) if t in ends), None)


def unread_kwargs(tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping) -> list[str]:
    """The template arguments the chat template never mentions (thinking asked of a
    template without it): passing them changes nothing, which callers may warn about."""
    template = str(getattr(tokenizer, "chat_template", None))
    return [k for k in template_kwargs if k not in template]
