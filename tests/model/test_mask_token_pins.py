"""Regression pins of ``target.mask_token_id=auto``'s rule (dflash.model.target): the first
special token that no named role holds and the chat template never writes, checked for
every role on a tokenizer built here whose ids are known by hand."""

from __future__ import annotations

import pytest

from dflash.model.target import resolve_mask_token_id, unused_special_tokens

# ids 0..4 are special, 5.. are words; the template writes 0, 1 and 2 literally
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<extra_0>", "<extra_1>"]
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{{ '<|endoftext|>' }}")


def tokenizer(**roles):
    """A word-level tokenizer without a mask token; ``roles`` name special tokens
    (``bos_token="<extra_0>"``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = SPECIALS + ["hello", "world"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=TEMPLATE,
                                   **{"eos_token": "<|endoftext|>", **roles})


def test_without_roles_the_first_special_token_outside_the_template_is_taken():
    tok = tokenizer()
    assert unused_special_tokens(tok) == [(3, "<extra_0>"), (4, "<extra_1>")]
    assert resolve_mask_token_id(tok, 7, "auto") == 3


@pytest.mark.parametrize("role", ["bos", "eos", "unk", "pad", "sep", "cls"])
def test_auto_never_takes_a_token_with_a_role(role):
    """``<extra_0>`` (id 3) given the role is otherwise unused: auto passes over it to 4."""
    tok = tokenizer(**{f"{role}_token": "<extra_0>"})
    assert getattr(tok, f"{role}_token_id") == 3
    assert unused_special_tokens(tok) == [(4, "<extra_1>")]
    assert resolve_mask_token_id(tok, 7, "auto") == 4


def test_a_template_token_is_never_taken_even_without_a_role():
    """The eos moved to ``<extra_1>``: ``<|endoftext|>`` lost its role but the template still
    writes it, so it stays taken."""
    tok = tokenizer(eos_token="<extra_1>")
    assert unused_special_tokens(tok) == [(3, "<extra_0>")]


def tokenizer_with(extra: str, **roles):
    """:func:`tokenizer` with one more special token, id 7."""
    tok = tokenizer(**roles)
    tok.add_special_tokens({"additional_special_tokens": [extra]})
    assert tok.convert_tokens_to_ids(extra) == 7
    return tok


@pytest.mark.parametrize("spelled", ["<|MASK|>", "<|mask|>", "<mask>", "[MASK]"])
def test_a_mask_token_by_its_spelling_comes_first(spelled):
    tok = tokenizer_with(spelled)
    assert resolve_mask_token_id(tok, 8, None) == resolve_mask_token_id(tok, 8, "auto") == 7
    with pytest.raises(ValueError, match="outside the target embedding"):  # not one past it either
        resolve_mask_token_id(tok, 7, None)


def test_a_mask_token_spelled_otherwise_is_not_a_mask_token_and_none_refuses():
    """``None`` takes a mask token only by one of the four spellings; the refusal lists
    the unused special tokens, the first of which ``auto`` takes."""
    tok = tokenizer_with("<MASKED>")
    assert resolve_mask_token_id(tok, 8, "auto") == 3
    with pytest.raises(ValueError, match=r"the tokenizer has no mask token \(unused special tokens it has: 3 "
                                         r"<extra_0>, 4 <extra_1>, 7 <MASKED>; target.mask_token_id=auto takes the "
                                         r"first\); set target.mask_token_id to a reserved id inside the embedding "
                                         r"\(0 <= id < 8\), e.g. 151669 for Qwen3"):
        resolve_mask_token_id(tok, 8, None)


def test_only_rows_inside_the_embedding_count_and_an_id_is_range_checked():
    assert resolve_mask_token_id(tokenizer(), 4, "auto") == 3
    with pytest.raises(ValueError, match="it has no unused special token either"):
        resolve_mask_token_id(tokenizer(), 3, "auto")
    assert resolve_mask_token_id(tokenizer(), 7, 6) == 6
    assert resolve_mask_token_id(None, 7, 0) == 0
    for bad in (7, -1, "5"):
        with pytest.raises(ValueError, match=rf"target.mask_token_id={bad} is outside the target embedding "
                                             r"\(vocab_size=7\); give an id, or auto"):
            resolve_mask_token_id(tokenizer(), 7, bad)
    with pytest.raises(ValueError, match=r"a target without a tokenizer needs target.mask_token_id \(0 <= id < 7\)"):
        resolve_mask_token_id(None, 7, "auto")


def test_more_than_eight_unused_tokens_are_cut_short_in_the_refusal():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    extra = [f"<x{i}>" for i in range(10)]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(["<|endoftext|>", *extra])}))
    backend.add_special_tokens(["<|endoftext|>", *extra])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", chat_template="{{ '' }}")
    with pytest.raises(ValueError, match=r"it has: 1 <x0>, 2 <x1>, 3 <x2>, 4 <x3>, 5 <x4>, 6 <x5>, 7 <x6>, 8 <x7> "
                                         r"\.\.\.; target.mask_token_id=auto"):
        resolve_mask_token_id(tok, 11, None)
