"""dflash.decode.speed: the target alone, speculative decoding and transformers' prompt
lookup on the same prompts; all three give the target's own greedy tokens in float32."""

import pytest
import torch
from helpers import tiny_drafter
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.decode.speculative import greedy_generate
from dflash.decode.speed import format_speed, measure_speed
from dflash.model.drafter import TargetHead

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 96


def test_three_ways_to_decode_timed_on_the_same_prompts():
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=256)).eval()
    drafter, head = tiny_drafter(vocab=VOCAB, block_size=4).eval(), TargetHead.of(target)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 7)]
    report = measure_speed(target, drafter, head, prompts, max_new_tokens=10, eos_ids={VOCAB - 1}, batch_sizes=(1, 2))
    modes = [(r["mode"], r["batch"]) for r in report["rows"]]
    assert modes == [("target alone", 1), ("speculative", 1), ("prompt lookup (10)", 1), ("target alone", 2),
                     ("speculative", 2)]
    expected = sum(len(greedy_generate(target, p, 10, {VOCAB - 1})) for p in prompts)
    for r in report["rows"]:
        assert r["new_tokens"] == expected and r["tokens_per_s"] > 0
        assert r["same_as_target"] in (None, 3)
        assert r["speedup"] == (1.0 if r["mode"] == "target alone" else r["speedup"])
    assert "prompt lookup (10)   batch   1" in format_speed(report)
