"""Export round trip and the z-lab / serving-engine layout."""

import json

import pytest
import torch
from helpers import forward_on_noise, tiny_drafter
from safetensors import safe_open
from transformers import Qwen3Config

from dflash.model.drafter import DrafterConfig
from dflash.model.export import drafter_config_from_hf, load_export, save_export


def test_round_trip_gives_identical_outputs(tmp_path):
    drafter = tiny_drafter().eval()
    out = save_export(drafter, tmp_path / "export", dtype="float32")
    loaded = load_export(out)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, 9, 3 * 64, generator=g)
    blk = torch.randn(1, 4, 64, generator=g)
    cpos, bpos = torch.arange(9)[None], torch.arange(9, 13)[None]
    with torch.no_grad():
        assert torch.equal(drafter(ctx, blk, cpos, bpos), loaded(ctx, blk, cpos, bpos))


def test_config_fields_and_weight_names(tmp_path):
    drafter = tiny_drafter()
    out = save_export(drafter, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["mask_token_id"] == 95
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 6
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 64 and cfg["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    per_layer = {
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        "input_layernorm", "post_attention_layernorm",
    }
    assert {f"layers.{i}.{n}.weight" for i in range(2) for n in per_layer} <= names
    assert not any(n.startswith("model.") or "embed" in n or "lm_head" in n for n in names)
    assert len(names) == 3 + 2 * len(per_layer)
    assert not (tmp_path / "export.tmp").exists()


# ---------------------------------------------------------------------------
# Sliding layers: layer_types and sliding_window in config.json
# ---------------------------------------------------------------------------

MIXED = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3)


def test_all_full_export_config_is_unchanged(tmp_path):
    """An all-full drafter's config.json, key for key, as before sliding layers existed."""
    cfg = json.loads((save_export(tiny_drafter(), tmp_path / "export") / "config.json").read_text())
    assert cfg == {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
        "vocab_size": 96, "tie_word_embeddings": False, "layer_types": ["full_attention", "full_attention"],
        "max_window_layers": 2, "use_sliding_window": False, "sliding_window": None, "initializer_range": 0.02,
        "dtype": "bfloat16", "block_size": 4, "num_target_layers": 6,
        "dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 2, 3], "block_size": 4},
    }
    assert load_export(tmp_path / "export").config == tiny_drafter().config


def test_sliding_layers_round_trip(tmp_path):
    drafter = tiny_drafter(**MIXED).eval()
    out = save_export(drafter, tmp_path / "export", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"] == MIXED["layer_types"] and cfg["sliding_window"] == 3
    assert cfg["use_sliding_window"] is True and "is_causal" not in cfg  # z-lab / vLLM: sliding layers causal
    hf = Qwen3Config(**cfg)  # what z-lab's DFlashDraftModel (a Qwen3Config) reads
    assert hf.layer_types == MIXED["layer_types"] and hf.sliding_window == 3
    loaded = load_export(out)
    assert loaded.config == drafter.config
    windowed = forward_on_noise(loaded)
    assert torch.equal(forward_on_noise(drafter), windowed)
    assert not torch.allclose(forward_on_noise(tiny_drafter()), windowed)  # the window is applied


def test_sliding_layers_that_look_both_ways_round_trip(tmp_path):
    """``is_causal: false`` (released DFlash2 drafters): written, read back, and the later
    block slots reach a sliding layer's earlier ones."""
    drafter = tiny_drafter(**MIXED, sliding_causal=False).eval()
    out = save_export(drafter, tmp_path / "export", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["is_causal"] is False
    loaded = load_export(out)
    assert loaded.config == drafter.config and not loaded.config.sliding_causal
    assert torch.equal(forward_on_noise(drafter), forward_on_noise(loaded))
    causal = tiny_drafter(**MIXED).eval()
    causal.load_state_dict(drafter.state_dict())
    assert not torch.allclose(forward_on_noise(causal), forward_on_noise(drafter))


@pytest.mark.parametrize("change,message", [
    ({"is_causal": True}, "is_causal=True makes full-attention layers causal"),
    ({"dflash_config": {"causal": True}}, "dflash_config.causal=True"),
    ({"use_sliding_window": False}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention"]}, "drafter.num_layers=2"),
    ({"sliding_window": 0}, "sliding_window must be an integer >= 1"),
])
def test_attention_this_drafter_cannot_run_is_refused(tmp_path, change, message):
    out = save_export(tiny_drafter(**MIXED), tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(change)
    with pytest.raises(ValueError, match=message):
        drafter_config_from_hf(cfg)


def test_layer_types_are_checked():
    def config(**kwargs):
        return dict(tiny_drafter().config.to_dict(), **kwargs)

    with pytest.raises(ValueError, match="has 1 entries but the drafter has drafter.num_layers=2"):
        DrafterConfig(**config(layer_types=["full_attention"]))
    with pytest.raises(ValueError, match="'global'"):
        DrafterConfig(**config(layer_types=["full_attention", "global"]))
    for window in (None, 0, 2.5):
        with pytest.raises(ValueError, match="drafter.sliding_window must be an integer >= 1"):
            DrafterConfig(**config(layer_types=["full_attention", "sliding_attention"], sliding_window=window))
    with pytest.raises(ValueError, match="no layer slides"):
        DrafterConfig(**config(sliding_window=8))
    assert DrafterConfig(**config(layer_types=["full_attention"] * 2)).layer_types is None  # all full: stored as None
