"""DFlash2 export: round trip, the released checkpoints' layout, starting from an export."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import forward_on_noise, tiny_dflash2, tiny_drafter, tiny_head
from safetensors import safe_open

from dflash.model.drafter import DFlash2Config, DFlashDrafter, DrafterConfig
from dflash.model.export import (
    drafter_config_from_hf,
    hf_config,
    init_from,
    load_export,
    save_export,
)

REFERENCE = json.loads((Path(__file__).parents[1] / "fixtures" / "dflash2_reference.json").read_text())


def reference_drafter_config() -> DrafterConfig:
    """The released checkpoint's shapes (its attention is not ours to rebuild here: no weight depends on it)."""
    c, d = REFERENCE["config"], REFERENCE["config"]["dflash_config"]
    return DrafterConfig(
        hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"], vocab_size=c["vocab_size"], num_target_layers=c["num_target_layers"],
        target_layer_ids=d["target_layer_ids"], mask_token_id=d["mask_token_id"], block_size=d["block_size"],
        dflash2=DFlash2Config(**{f.name: d[f.name] for f in dataclasses.fields(DFlash2Config)}),
    )


def test_weight_names_and_shapes_are_the_released_checkpoints():
    with torch.device("meta"):
        drafter = DFlashDrafter(reference_drafter_config())
    ours = {k: list(v.shape) for k, v in drafter.state_dict().items()}
    assert ours == {k: w["shape"] for k, w in REFERENCE["weights"].items()}


def test_config_has_the_released_fields():
    cfg = hf_config(reference_drafter_config(), "bfloat16")
    ref = REFERENCE["config"]
    assert cfg["architectures"] == ref["architectures"] == ["DFlash2DraftModel"]
    # every field of the released config but the tokenizer ids, and the attention override and
    # logit transforms, which a drafter trained here (as this config is) has none of
    assert set(ref) - set(cfg) <= {"bos_token_id", "eos_token_id", "pad_token_id", "is_causal", "rope_parameters",
                                   "transformers_version", "use_cache"}
    assert set(ref["dflash_config"]) - set(cfg["dflash_config"]) == {"final_logit_softcapping", "output_multiplier"}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "num_target_layers", "model_type", "hidden_act", "tie_word_embeddings"):
        assert cfg[key] == ref[key], key
    for key in ("block_size", "conv_group_size", "conv_kernel_size", "mask_token_id", "selector_rank",
                "selector_top_k", "target_layer_ids"):
        assert cfg["dflash_config"][key] == ref["dflash_config"][key], key


def test_round_trip_gives_identical_outputs_and_selector(tmp_path):
    drafter = tiny_dflash2()
    out = save_export(drafter, tmp_path / "export", dtype="float32")
    loaded = load_export(out)
    assert loaded.config == drafter.config
    assert torch.equal(forward_on_noise(drafter), forward_on_noise(loaded))
    assert torch.equal(loaded.candidate_selector.successor_codebook, drafter.candidate_selector.successor_codebook)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [1, 2, 3], "block_size": 4,
                                    "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                                    "selector_top_k": 4}
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                "layers.1.mlp_conv.base_kernel"} <= set(f.keys())


def test_logit_and_embedding_transforms_round_trip_and_shape_the_drafts(tmp_path):
    """A released drafter's dflash_config transforms (the fixture's multiplier and
    soft-cap, an embedding scale) load and export unchanged; decoding's draft logits are
    the head's logits multiplied, then capped at c * tanh(x / c); the block embeddings are
    scaled inside the forward. Training from such a drafter is refused."""
    ref = REFERENCE["config"]["dflash_config"]
    transforms = {"output_multiplier": ref["output_multiplier"], "final_logit_softcapping": ref["final_logit_softcapping"],
                  "input_embedding_scale": 2.0}
    plain = tiny_dflash2()
    drafter = DFlashDrafter(dataclasses.replace(plain.config, **transforms)).eval()
    drafter.load_state_dict(plain.state_dict())
    out = save_export(drafter, tmp_path / "export", dtype="float32")
    assert {k: json.loads((out / "config.json").read_text())["dflash_config"][k] for k in transforms} == transforms
    loaded = load_export(out)
    assert loaded.config.transforms == transforms
    head = tiny_head()
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    raw = (hidden @ head.lm_head_weight.T).double() * ref["output_multiplier"]
    cap = ref["final_logit_softcapping"]
    torch.testing.assert_close(loaded.draft_logits(head, hidden).double(), cap * torch.tanh(raw / cap),
                               rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(3)
    ctx, blk = torch.randn(1, 9, 3 * 64, generator=g), torch.randn(1, 4, 64, generator=g)
    cpos, bpos = torch.arange(9)[None], torch.arange(9, 13)[None]
    with torch.no_grad():
        assert torch.equal(loaded(ctx, blk, cpos, bpos), plain(ctx, 2.0 * blk, cpos, bpos))
    with pytest.raises(ValueError, match="transforms its embeddings or logits"):
        init_from(tiny_dflash2(), out)


def test_the_released_config_loads():
    """The released checkpoint's config.json, sliding layers that look both ways and logit
    transforms included, reads into a drafter config."""
    config = drafter_config_from_hf(REFERENCE["config"])
    assert config.variant == "dflash2" and not config.sliding_causal and config.sliding_window == 2048
    assert config.transforms == {k: REFERENCE["config"]["dflash_config"][k]
                                 for k in ("output_multiplier", "final_logit_softcapping")}


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_init_from_loads_an_export_that_fits(tmp_path, variant):
    source = tiny_dflash2(seed=1) if variant == "dflash2" else tiny_drafter(seed=1)
    out = save_export(source, tmp_path / "export", dtype="float32")
    fresh = DFlashDrafter(dataclasses.replace(source.config, block_size=8))  # block size shapes no weight
    init_from(fresh, out)
    for (name, a), b in zip(source.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_init_from_refuses_an_export_that_does_not_fit(tmp_path):
    out = save_export(tiny_drafter(), tmp_path / "v1")
    with pytest.raises(ValueError, match="variant: dflash there, dflash2 here"):
        init_from(tiny_dflash2(), out)
    out = save_export(tiny_dflash2(), tmp_path / "rank8")
    with pytest.raises(ValueError, match="dflash2: .*selector_rank=8.*selector_rank=16"):
        init_from(tiny_dflash2(selector_rank=16), out)
    out = save_export(tiny_drafter(layer_ids=(1, 2, 4)), tmp_path / "layers")
    with pytest.raises(ValueError, match="target_layer_ids"):
        init_from(tiny_drafter(), out)
