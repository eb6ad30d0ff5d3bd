import os

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.model import DFlashDrafter, DrafterConfig, TargetHead

os.environ.setdefault("WANDB_MODE", "disabled")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


def tiny_drafter(hidden: int = 64, vocab: int = 96, layer_ids=(1, 2, 3), block_size: int = 4, seed: int = 0) -> DFlashDrafter:
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
    )
    return DFlashDrafter(cfg)


def tiny_head(hidden: int = 64, vocab: int = 96, seed: int = 0) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    return TargetHead(torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g) * 0.1)
