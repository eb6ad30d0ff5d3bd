"""Export round trip and the z-lab / serving-engine layout."""

import json

import torch
from helpers import tiny_drafter
from safetensors import safe_open

from dflash.model.export import load_export, save_export


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
