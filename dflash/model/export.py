"""Export in the z-lab ``DFlashDraftModel`` HF layout, and load an export back.

The layout is what vLLM (``qwen3_dflash.py``) and SGLang (``models/dflash.py``)
load: a Qwen3 ``config.json`` with ``architectures: ["DFlashDraftModel"]``,
``block_size`` and ``num_target_layers`` at the top level (older loaders) and
inside ``dflash_config`` (newer ones) next to ``mask_token_id`` and
``target_layer_ids``; each layer's attention in ``layer_types``, with
``sliding_window`` and ``use_sliding_window`` set when a layer slides; weights
named ``fc``, ``hidden_norm``, ``layers.N.*`` and ``norm`` with no ``model.``
prefix and no embedding or LM head (the engines use the target's).

A DFlash2 drafter exports as ``DFlash2DraftModel``: the same layout plus
``conv_kernel_size``, ``conv_group_size``, ``selector_rank`` and ``selector_top_k`` in
``dflash_config``, and the weights of :mod:`dflash.model.selector`
(``layers.N.attention_conv.*``, ``layers.N.mlp_conv.*``, ``candidate_selector.*``), as
the released DFlash2 drafters have them (``tests/fixtures/dflash2_reference.json``).

Beside them, ``digests.json`` (:func:`dflash.files.write_digests`) records each file's
SHA-256, and every loader here refuses an export whose files differ from it; the
engines ignore the extra file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.files import (
    DIGESTS,
    DamagedFiles,
    publish,
    staging_dir,
    verify_digests,
    write_digests,
)
from dflash.model.drafter import SLIDING, DFlash2Config, DFlashDrafter, DrafterConfig

log = logging.getLogger(__name__)

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}


def hf_config(cfg: DrafterConfig, dtype: str) -> dict:
    dflash = {
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "block_size": cfg.block_size,
    }
    if cfg.dflash2 is not None:
        dflash.update(asdict(cfg.dflash2))
    dflash.update(cfg.transforms)
    return {
        "architectures": [ARCHITECTURES[cfg.variant]],
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
        "layer_types": cfg.attention_types,
        "max_window_layers": cfg.num_layers,
        # HF's Qwen3Config keeps sliding_window only with use_sliding_window; without is_causal,
        # z-lab and vLLM make sliding layers causal and full ones bidirectional; is_causal false
        # makes every layer bidirectional, the sliding ones within their window both ways
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        **({} if cfg.sliding_causal else {"is_causal": False}),
        "initializer_range": 0.02,
        "dtype": dtype,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": dflash,
    }


def save_export(drafter: DFlashDrafter, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write ``config.json`` + ``model.safetensors`` and, last, their digests; a temp dir
    renamed at the end so a crash never leaves a half-written export behind."""
    out = Path(out_dir)
    tmp = staging_dir(out)
    tmp.mkdir(parents=True)
    state = {k: v.detach().to(EXPORT_DTYPES[dtype]).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config(drafter.config, dtype), indent=2) + "\n")
    write_digests(tmp)
    return publish(tmp, out)


def verify_export(path: Path) -> None:
    """Refuse an export whose files are not those written, naming the file; one written
    before exports kept digests (or a released drafter) loads with a warning that it
    cannot be verified."""
    try:
        verified = verify_digests(path)
    except DamagedFiles as e:
        raise ValueError(f"the drafter {path} is damaged: {e}; if the change was meant, delete {DIGESTS} there to "
                         "load it unverified") from None
    if not verified:
        log.warning("drafter %s has no digests (a release, or an export from before they were kept), so its files "
                    "cannot be verified", path)


def attention_from_hf(config: dict) -> tuple[list[str] | None, int | None, bool]:
    """``layer_types``, ``sliding_window`` and whether sliding layers are causal, from an HF
    config, refusing the attention this drafter cannot run. z-lab's ``is_causal`` sets
    every layer: ``false`` is the default for full layers and makes sliding ones look both
    ways within their window (released DFlash2 drafters); ``true`` would make full layers
    causal. Refused too: ``dflash_config.causal`` that differs from the default,
    ``use_swa``, and sliding layers whose window HF's Qwen3Config would drop (no
    ``use_sliding_window``)."""
    dflash = config.get("dflash_config", {})
    layer_types = config.get("layer_types")
    sliding = [t == SLIDING for t in layer_types or []]
    is_causal = config.get("is_causal")
    if is_causal and not all(sliding or [False]):
        raise ValueError("is_causal=True makes full-attention layers causal; this drafter's full layers see their "
                         "whole block")
    causal = dflash.get("causal")
    if causal is not None and any(s != bool(causal) for s in sliding or [False]):
        raise ValueError(f"dflash_config.causal={causal} overrides the attention of every layer; this drafter runs "
                         "sliding layers causal (or as is_causal=false sets them) and full layers bidirectional")
    if dflash.get("use_swa"):
        raise ValueError("dflash_config.use_swa (bidirectional sliding attention) is not supported")
    if not any(sliding):
        return None, None, True
    if not config.get("use_sliding_window", False):
        raise ValueError("layer_types has sliding layers but use_sliding_window is false, so HF drops sliding_window")
    return list(layer_types), config.get("sliding_window"), is_causal is not False


def variant_from_hf(config: dict) -> DFlash2Config | None:
    """The DFlash2 fields of a ``DFlash2DraftModel`` config (all four are required, as the
    serving engines require them), ``None`` for a ``DFlashDraftModel``."""
    architectures = config.get("architectures") or []
    if not set(architectures) & set(ARCHITECTURES.values()):
        raise ValueError(f"not a DFlash or DFlash2 drafter export (architectures={architectures})")
    dflash = config.get("dflash_config", {})
    if ARCHITECTURES["dflash2"] not in architectures:
        return None
    names = [f.name for f in fields(DFlash2Config)]
    missing = [n for n in names if dflash.get(n) is None]
    if missing:
        raise ValueError(f"a DFlash2DraftModel config needs dflash_config.{', '.join(missing)}")
    return DFlash2Config(**{n: dflash[n] for n in names})


def drafter_config_from_hf(config: dict) -> DrafterConfig:
    dflash = config.get("dflash_config", {})
    block_size = config.get("block_size", dflash.get("block_size"))
    rope_theta = config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 1_000_000.0)
    layer_types, sliding_window, sliding_causal = attention_from_hf(config)
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
        layer_types=layer_types,
        sliding_window=sliding_window,
        sliding_causal=sliding_causal,
        dflash2=variant_from_hf(config),
        **{k: dflash[k] for k in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")
           if dflash.get(k) is not None},
    )


def load_export(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Build a drafter from an export directory (ours or a z-lab checkpoint, DFlash or
    DFlash2), once :func:`check_drafter_config` has passed it."""
    path = Path(path)
    config = check_drafter_config(path)
    try:
        drafter = DFlashDrafter(drafter_config_from_hf(config))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    state = load_file(path / "model.safetensors")
    drafter.load_state_dict(state, strict=True)
    dtype = dtype or EXPORT_DTYPES.get(config.get("dtype", "float32"), torch.float32)
    return drafter.to(device=device, dtype=dtype).eval()


# Fields a drafter built for the target must share with an export it starts from: every
# weight's shape, and what the weights were trained to read (the target's layers, the mask).
MUST_MATCH = ("hidden_size", "intermediate_size", "num_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "target_layer_ids", "mask_token_id", "variant", "dflash2")


def init_from(drafter: DFlashDrafter, path: str | Path) -> None:
    """Load an export's weights (``drafter.init_from``) into ``drafter``, which was built
    for the target, after checking that they fit: the same shapes, target layers, mask
    token and variant, and no embedding or logit transform. Block size and attention may
    differ: they shape no weight."""
    path = Path(path)
    verify_export(path)
    theirs = drafter_config_from_hf(json.loads((path / "config.json").read_text()))
    if theirs.transforms:
        raise ValueError(f"drafter.init_from={path} transforms its embeddings or logits ({theirs.transforms}); "
                         "training here applies none, so its weights would train on other logits than they "
                         "serve with (dflash.eval decodes it as it is)")
    mine = drafter.config
    differ = [f"{k}: {getattr(theirs, k)} there, {getattr(mine, k)} here" for k in MUST_MATCH
              if getattr(theirs, k) != getattr(mine, k)]
    if differ:
        raise ValueError(f"drafter.init_from={path} does not fit this target's drafter ({'; '.join(differ)})")
    drafter.load_state_dict(load_file(path / "model.safetensors"), strict=True)


# Keys of a drafter's config.json that loading understands: Qwen3Config's (transformers 4.57
# and 5.x spellings), what HF writes into every saved config, and the DFlash layout's own.
KNOWN_CONFIG_FIELDS = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
    "attention_bias", "attention_dropout", "hidden_act", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "initializer_range",
    "layer_types", "max_window_layers", "use_sliding_window", "sliding_window", "use_cache", "is_causal",
    "bos_token_id", "eos_token_id", "pad_token_id", "block_size", "num_target_layers", "dflash_config",
})
KNOWN_DFLASH_FIELDS = frozenset({
    "mask_token_id", "target_layer_ids", "block_size", "num_target_layers",
    "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",  # DFlash2
    # read so that the loader refuses them with its own reason
    "output_multiplier", "final_logit_softcapping", "input_embedding_scale", "causal", "use_swa",
})


def unknown_fields(config: Mapping) -> list[str]:
    """The keys of a drafter's ``config.json`` that no loader here reads: each may change
    what the drafter computes (a quantization, a vocabulary map, another attention), so a
    drafter carrying one would be scored as something it is not."""
    top = [k for k in config if k not in KNOWN_CONFIG_FIELDS]
    dflash = [f"dflash_config.{k}" for k in config.get("dflash_config") or {} if k not in KNOWN_DFLASH_FIELDS]
    return sorted(top) + sorted(dflash)


def check_drafter_config(path: str | Path) -> dict:
    """A drafter directory's ``config.json``, refused with the reason when it is not a
    DFlash layout this decoding runs: no config, files that differ from their digests,
    or fields it would ignore."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path}: no config.json; --drafter takes a drafter directory in the z-lab layout "
                         "(config.json + model.safetensors)")
    verify_export(Path(path))
    config = json.loads(config_path.read_text())
    unknown = unknown_fields(config)
    if unknown:
        raise ValueError(f"{path}: config.json has fields this decoding does not read, so the drafter would not be "
                         f"run as it was trained: {', '.join(unknown)}")
    return config
