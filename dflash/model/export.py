"""Export in the z-lab ``DFlashDraftModel`` HF layout, and load an export back.

The layout is what vLLM (``qwen3_dflash.py``) and SGLang (``models/dflash.py``)
load: a Qwen3 ``config.json`` with ``architectures: ["DFlashDraftModel"]``,
``block_size`` and ``num_target_layers`` at the top level (older loaders) and
inside ``dflash_config`` (newer ones) next to ``mask_token_id`` and
``target_layer_ids``; weights named ``fc``, ``hidden_norm``, ``layers.N.*`` and
``norm`` with no ``model.`` prefix and no embedding or LM head (the engines use
the target's).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.files import publish, staging_dir
from dflash.model.drafter import DFlashDrafter, DrafterConfig

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def hf_config(cfg: DrafterConfig, dtype: str) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "max_window_layers": cfg.num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": 0.02,
        "dtype": dtype,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            "block_size": cfg.block_size,
        },
    }


def save_export(drafter: DFlashDrafter, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write ``config.json`` + ``model.safetensors``; a temp dir renamed at the end
    so a crash never leaves a half-written export behind."""
    out = Path(out_dir)
    tmp = staging_dir(out)
    tmp.mkdir(parents=True)
    state = {k: v.detach().to(EXPORT_DTYPES[dtype]).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config(drafter.config, dtype), indent=2) + "\n")
    return publish(tmp, out)


def drafter_config_from_hf(config: dict) -> DrafterConfig:
    dflash = config.get("dflash_config", {})
    block_size = config.get("block_size", dflash.get("block_size"))
    rope_theta = config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 1_000_000.0)
    return DrafterConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]),
        vocab_size=config["vocab_size"],
        num_target_layers=config["num_target_layers"],
        target_layer_ids=list(dflash["target_layer_ids"]),
        mask_token_id=dflash["mask_token_id"],
        block_size=block_size,
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=float(rope_theta),
        max_position_embeddings=config["max_position_embeddings"],
    )


def load_export(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Build a drafter from an export directory (ours or a z-lab checkpoint)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    if "DFlashDraftModel" not in config.get("architectures", []):
        raise ValueError(f"{path} is not a DFlashDraftModel export (architectures={config.get('architectures')})")
    drafter = DFlashDrafter(drafter_config_from_hf(config))
    state = load_file(path / "model.safetensors")
    drafter.load_state_dict(state, strict=True)
    dtype = dtype or EXPORT_DTYPES.get(config.get("dtype", "float32"), torch.float32)
    return drafter.to(device=device, dtype=dtype).eval()
