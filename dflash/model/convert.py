"""A GGUF chat model as an ordinary Hugging Face directory the trainer reads.

Registry packages carry real chat models as GGUF files (quantised weights, tokenizer and
chat template in one file). transformers reads such a file, dequantising it, but a model
loaded that way refuses ``save_pretrained`` (it carries the quantiser's flag), and every
later load would dequantise again. :func:`convert_gguf` loads the file once, rebuilds the
same architecture from its config without the quantisation entry, moves the weights in
with every key matched, and saves weights, config, tokenizer and generation config as a
directory ``target.path`` takes. Reading GGUF needs the ``gguf`` and ``accelerate``
packages (``pip install 'dflash[real]'``).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.model.target import resolve_mask_token_id

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Converted:
    """What :func:`convert_gguf` wrote: the directory, its model and the mask token the
    stated rule picks (``target.mask_token_id=auto``)."""

    path: Path
    model_type: str
    parameters: int
    mask_token_id: int
    mask_token: str
    seconds: float


def check_readers() -> None:
    """GGUF reading needs two packages the trainer does not; say so before anything loads."""
    missing = []
    for name in ("gguf", "accelerate"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SystemExit(f"reading a GGUF file needs {' and '.join(missing)}: pip install 'dflash[real]'")


def convert_gguf(gguf_path: str | Path, out: str | Path, dtype: str = "bfloat16") -> Converted:
    """Write the model in ``gguf_path`` to ``out`` as safetensors in ``dtype``, with its
    tokenizer; the directory appears whole or not at all (written beside it, then renamed)."""
    check_readers()
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    gguf_path, out = Path(gguf_path), Path(out)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    start = time.perf_counter()
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = DTYPES[dtype]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if missing or unexpected:  # tied weights are one tensor under two keys; anything else is a real mismatch
        tied = set(getattr(model, "_tied_weights_keys", None) or ())
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise ValueError(f"{gguf_path}: the rebuilt {config.model_type} model does not take the file's weights "
                             f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    model.tie_weights()
    model = model.to(DTYPES[dtype]).eval()
    mask_id = resolve_mask_token_id(tokenizer, config.get_text_config().vocab_size, "auto")

    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / "source.json").write_text(json.dumps(
        {"gguf": name, "bytes": gguf_path.stat().st_size, "dtype": dtype, "mask_token_id": mask_id,
         "mask_token": tokenizer.convert_ids_to_tokens(mask_id)}, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return Converted(out, config.model_type, sum(p.numel() for p in model.parameters()), mask_id,
                     tokenizer.convert_ids_to_tokens(mask_id), time.perf_counter() - start)
