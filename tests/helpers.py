"""Tiny models, heads and tokenizers the tests build in memory (no files, no network)."""

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.model.drafter import DFlashDrafter, DrafterConfig, TargetHead


def tiny_target(num_layers: int = 6, hidden: int = 64, vocab: int = 96, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(cfg).eval()


def varied_target(vocab: int = 96, std: float = 0.2, seed: int = 1) -> Qwen3ForCausalLM:
    """A tiny random target whose greedy output varies: at init std 0.02 it repeats one
    token, which any constant drafter would "predict" perfectly, so its matrices are
    drawn again with the larger ``std``."""
    model = tiny_target(vocab=vocab)
    torch.manual_seed(seed)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=std)
    return model


def greedy_reference(model: nn.Module, prompt: list[int], total: int) -> list[int]:
    """``prompt`` and its greedy continuation up to ``total`` tokens in all, by plain argmax
    decoding over the whole sequence each time (no cache): the reference, independent of
    dflash's decoding."""
    seq = list(prompt)
    with torch.no_grad():
        while len(seq) < total:
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq


def tiny_drafter(hidden: int = 64, vocab: int = 96, layer_ids=(1, 2, 3), block_size: int = 4, seed: int = 0,
                 layer_types=None, sliding_window=None) -> DFlashDrafter:
    """Two layers; ``layer_types`` and ``sliding_window`` as in ``DrafterConfig`` (the
    weights do not depend on them: one seed gives the same weights either way)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        vocab_size=vocab,
        num_target_layers=6,
        target_layer_ids=list(layer_ids),
        mask_token_id=vocab - 1,
        block_size=block_size,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    return DFlashDrafter(cfg)


def flat_grads(trainer) -> torch.Tensor:
    """A trainer's accumulated gradients, all parameters in order, as one vector."""
    return torch.cat([g.flatten() for g in trainer.grads])


def tiny_head(hidden: int = 64, vocab: int = 96, seed: int = 0) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    return TargetHead(torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g) * 0.1)


def word_tokenizer(vocab_size: int = 96):
    """A word-level tokenizer with a Qwen-style chat template, built in memory (no files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>", "<|unk|>"]
    vocab = specials + ["\n", "user", "assistant"] + [f"w{i}" for i in range(vocab_size - 8)]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<|unk|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(specials)
    backend.add_tokens(["\n"])
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", unk_token="<|unk|>", chat_template=template
    )
