"""Regression pins of the drafter model and its export: behaviours whose silent breakage
would still train, export or decode something, each checked against an independent
reference (transformers' own code, a hand formula) rather than against the code under test."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import tiny_dflash2, tiny_drafter
from runs import RANDOM_TARGET, TINY

from dflash.model.drafter import DFlashDrafter, DrafterConfig, apply_rope
from dflash.model.export import load_export, save_export
from dflash.objective.masks import build_mask
from dflash.run.build import build_job
from dflash.run.config import compose_config

pytestmark = pytest.mark.usefixtures("one_thread")


# RoPE equals transformers' Qwen3 rotation ------------------------------------------------


@pytest.mark.parametrize("theta", [None, 1_000_000.0, 12_345.6])
def test_drafter_rope_equals_transformers_qwen3_in_float64(theta: float | None):
    """The drafter built for a Qwen3 target rotates queries and keys exactly as the
    target's own RoPE does (same theta, same half-split layout), at any position ids."""
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    extra = [] if theta is None else [f"+target.shape.rope_theta={theta}"]
    job = build_job(compose_config(TINY + RANDOM_TARGET + extra))
    text = job.target_config.get_text_config()
    assert theta is None or text.rope_parameters["rope_theta"] == theta  # None: transformers' Qwen3 default
    config = job.drafter
    assert config.rope_theta == text.rope_parameters["rope_theta"]
    drafter = DFlashDrafter(config)  # fp32 tables, as trained and as the target computes them

    g = torch.Generator().manual_seed(0)
    heads, d = text.num_attention_heads, text.head_dim
    positions = torch.tensor([[0, 1, 2, 17, 511, 4095, 40_000, 3], [5, 5, 6, 1000, 7, 8, 9, 30_000]])
    q = torch.randn(2, heads, positions.shape[1], d, generator=g, dtype=torch.float64)
    k = torch.randn(2, text.num_key_value_heads, positions.shape[1], d, generator=g, dtype=torch.float64)

    hf = Qwen3RotaryEmbedding(text)
    assert torch.equal(drafter.rotary.inv_freq, hf.inv_freq)
    cos, sin = drafter.rotary(positions, torch.float64)
    hf_cos, hf_sin = hf(q, positions)
    want_q, want_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    got_q, got_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert got_q.dtype == torch.float64
    assert (got_q - want_q).abs().max() < 1e-12
    assert (got_k - want_k).abs().max() < 1e-12
    assert (got_q - q).abs().max() > 0.1  # the rotation did something


# RoPE config survives export -------------------------------------------------------------


def test_rope_theta_and_rope_config_survive_export_and_reload(tmp_path: Path):
    """An export reloads with the drafter's theta, max positions and eps (not the defaults),
    so it drafts exactly as trained, and transformers reads the same theta from config.json."""
    from transformers import AutoConfig

    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=96, num_target_layers=6,
                        target_layer_ids=[1, 2, 3], mask_token_id=95, block_size=4, rms_norm_eps=1e-5,
                        rope_theta=10_000.0, max_position_embeddings=2048)
    assert cfg.rope_theta != DrafterConfig.rope_theta
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    out = save_export(drafter, tmp_path / "export", dtype="float32")
    loaded = load_export(out)
    assert dataclasses.asdict(loaded.config) == dataclasses.asdict(cfg)
    assert torch.equal(loaded.rotary.inv_freq, drafter.rotary.inv_freq)
    hf = AutoConfig.from_pretrained(out)
    assert hf.rope_parameters["rope_theta"] == 10_000.0 and hf.rope_parameters["rope_type"] == "default"
    assert hf.max_position_embeddings == 2048
    g = torch.Generator().manual_seed(1)
    ctx, blk = torch.randn(1, 6, 3 * 64, generator=g), torch.randn(1, 4, 64, generator=g)
    cpos, bpos = torch.arange(900, 906)[None], torch.arange(906, 910)[None]
    with torch.no_grad():
        assert torch.equal(drafter(ctx, blk, cpos, bpos), loaded(ctx, blk, cpos, bpos))


# RoPE frequencies stay fp32 in a bf16 drafter --------------------------------------------


def test_a_bf16_drafter_keeps_its_rope_frequencies_in_fp32(tmp_path: Path):
    """A bf16 export loaded in bf16, and a drafter cast with ``.to(torch.bfloat16)``, hold
    bf16 weights but the fp32 RoPE frequencies of training: cast to bf16 with the weights,
    ``inv_freq`` would rotate far positions by angles off by up to a radian."""
    drafter = tiny_drafter().eval()
    head_dim, theta = drafter.config.head_dim, drafter.config.rope_theta
    hand = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    fp32 = drafter.rotary.inv_freq.clone()
    assert fp32.dtype == torch.float32
    torch.testing.assert_close(fp32.double(), hand, rtol=1e-6, atol=0)
    assert not torch.equal(fp32.to(torch.bfloat16).float(), fp32)  # a bf16 cast would change them

    loaded = load_export(save_export(drafter, tmp_path / "export", "bfloat16"), torch.device("cpu"), torch.bfloat16)
    cast = copy.deepcopy(drafter).to(torch.bfloat16)
    positions = torch.tensor([[0, 1, 17, 1000, 4095, 40_000]])
    want_cos, want_sin = drafter.rotary(positions, torch.float32)
    for name, bf16 in (("loaded export", loaded), ("cast drafter", cast)):
        assert bf16.rotary.inv_freq.dtype == torch.float32, name
        assert torch.equal(bf16.rotary.inv_freq, fp32), name
        weights = [p for p in bf16.parameters()]
        assert weights and all(p.dtype == torch.bfloat16 for p in weights), name
        cos, sin = bf16.rotary(positions, torch.bfloat16)  # computed in fp32, then rounded once
        assert torch.equal(cos, want_cos.to(torch.bfloat16)) and torch.equal(sin, want_sin.to(torch.bfloat16)), name
    assert drafter.rotary.inv_freq.dtype == torch.float32 and torch.equal(drafter.rotary.inv_freq, fp32)


# DFlash2 layers with convolutions that are not the identity ------------------------------


def conv_by_hand(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, block: int) -> torch.Tensor:
    """Row ``t`` is ``sum_k (base[k] + delta[t, k] per group) * x[t - k]``, reading no row
    before its block's first: ``x [rows, H]``, ``base [K, H]``, ``delta [rows, K, G]``."""
    rows, hidden = x.shape
    taps, groups = delta.shape[-2:]
    out = torch.zeros_like(x)
    for t in range(rows):
        for k in range(taps):
            if t - k >= t - t % block:
                out[t] += (base[k] + delta[t, k].repeat_interleave(hidden // groups)) * x[t - k]
    return out


@pytest.mark.parametrize("drafted_only", [False, True])
def test_dflash2_layers_equal_a_hand_formula_with_random_convolutions(drafted_only: bool):
    """A DFlash2 drafter whose convolutions are random (not the identity they start as)
    gives, on two blocks under the training mask, the hidden states of a hand loop: per
    layer, the attention's input and output and the MLP's input and output each convolved
    inside its block (kernels from the sublayer input's projection), the residuals around
    each convolved sublayer, the final norm; with ``drafted_only``, slot 0 of each block
    dropped after the last MLP."""
    drafter = tiny_dflash2(seed=3).double()
    B, S, H = drafter.config.block_size, 9, drafter.config.hidden_size
    g = torch.Generator().manual_seed(4)
    features = torch.randn(2, S, 3 * H, generator=g, dtype=torch.float64)
    anchors = torch.tensor([[2, 6], [1, 5]])
    blocks = torch.randn(2, 2 * B, H, generator=g, dtype=torch.float64)
    ctx_positions = torch.arange(S).expand(2, S)
    block_positions = (anchors[..., None] + torch.arange(B)).flatten(1)
    mask = build_mask(anchors, S, B, use_flex=False)
    with torch.no_grad():
        got = drafter(features, blocks, ctx_positions, block_positions, mask, drafted_only=drafted_only)

        ctx = drafter.context(features, torch.float64)
        rope_ctx, rope_block = drafter.rotary(ctx_positions, torch.float64), drafter.rotary(block_positions, torch.float64)
        K = drafter.config.dflash2.conv_kernel_size
        x = blocks.clone()
        for layer in drafter.layers:
            attention = lambda h, layer=layer: layer.self_attn(h, ctx, rope_block, rope_ctx, mask)  # noqa: E731
            for conv, norm, sublayer in ((layer.attention_conv, layer.input_layernorm, attention),
                                         (layer.mlp_conv, layer.post_attention_layernorm, layer.mlp)):
                h = norm(x)
                delta = conv.kernel_projection(h).unflatten(-1, (2, K, conv.groups))
                inner = torch.stack([conv_by_hand(h[r], conv.base_kernel[0], delta[r, :, 0], B) for r in range(2)])
                y = sublayer(inner)
                x = x + torch.stack([conv_by_hand(y[r], conv.base_kernel[1], delta[r, :, 1], B) for r in range(2)])
        want = drafter.norm(x)
        if drafted_only:
            want = want.unflatten(1, (2, B))[:, :, 1:].flatten(1, 2)
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-12
    # the convolutions matter: the same weights as plain DFlash layers give other states
    plain = DFlashDrafter(dataclasses.replace(drafter.config, dflash2=None)).double()
    plain.load_state_dict(drafter.state_dict(), strict=False)
    with torch.no_grad():
        other = plain(features, blocks, ctx_positions, block_positions, mask, drafted_only=drafted_only)
    assert (other - want).abs().max() > 0.01
