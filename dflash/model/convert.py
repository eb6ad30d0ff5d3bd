"""A GGUF chat model as an ordinary Hugging Face directory the trainer reads.

Registry packages carry real chat models as GGUF files (quantised weights, tokenizer and
chat template in one file). transformers reads such a file, dequantising it, but a model
loaded that way refuses ``save_pretrained`` (it carries the quantiser's flag), and every
later load would dequantise again. :func:`convert_gguf` loads the file once, rebuilds the
same architecture from its config without the quantisation entry, moves the weights in
with every key matched, and saves weights, config, tokenizer and generation config as a
directory ``target.path`` takes. Reading GGUF needs the ``gguf`` and ``accelerate``
packages (``pip install 'dflash[real]'``).

A file that cannot give a model raises :class:`BadGGUF`, one line naming the file and why,
before anything is written: one the ``gguf`` reader cannot parse (truncated, or its header
altered), one of an architecture transformers does not read from GGUF, one whose weights
hold NaN or infinity (tensor bytes overwritten). GGUF carries no checksum, so an altered
weight that is still a finite number cannot be told from a real one.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.files import publish, staging_dir
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


class BadGGUF(ValueError):
    """A GGUF file that gives no model: damaged, truncated, or of an architecture transformers
    does not read. The message is one line that names the file."""


class _PastEnd(Exception):
    def __init__(self, end: int) -> None:
        super().__init__(end)
        self.end = end


def read_architecture(gguf_path: Path) -> str:
    """The file's ``general.architecture``, once the ``gguf`` reader has parsed the whole file
    (header, metadata, every tensor's place and size within the file)."""
    from gguf import GGUFReader

    class Reader(GGUFReader):  # the reader slices past the end without a word: say where it ran out
        def _get(self, offset, dtype, count=1, *args, **kwargs):
            end = int(offset) + int(np.dtype(dtype).itemsize) * int(count)
            if end > len(self.data):
                raise _PastEnd(end)
            return super()._get(offset, dtype, count, *args, **kwargs)

    size = gguf_path.stat().st_size
    try:
        reader = Reader(gguf_path)
        field = reader.get_field("general.architecture")
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except _PastEnd as e:
        raise BadGGUF(f"{gguf_path}: not a whole GGUF file: {size:,} bytes, and reading it needs {e.end:,} "
                      f"(truncated, or its header damaged)") from None
    except Exception as e:  # the reader's own errors are numpy's and struct's: say what they mean
        raise BadGGUF(f"{gguf_path}: not a readable GGUF file ({size:,} bytes; damaged?): "
                      f"{type(e).__name__}: {_one_line(e)}") from None
    if end > size:
        raise BadGGUF(f"{gguf_path}: not a whole GGUF file: {size:,} bytes, and its tensors need {end:,} "
                      f"(truncated)")
    if field is None:
        raise BadGGUF(f"{gguf_path}: no general.architecture in its metadata (damaged?)")
    return str(field.contents())


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _supported() -> list[str]:
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return []
    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # the mapping's shared sections


def _load(gguf_path: Path, architecture: str):
    """The tokenizer and the dequantised float32 model transformers reads from the file."""
    import transformers

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ImportError:
        raise
    except Exception as e:
        supported = _supported()
        if supported and architecture not in supported and "not supported" in str(e):
            raise BadGGUF(f"{gguf_path}: architecture {architecture!r} (general.architecture), which "
                          f"transformers {transformers.__version__} does not read from GGUF; it reads "
                          f"{', '.join(supported)}") from None
        raise BadGGUF(f"{gguf_path}: transformers {transformers.__version__} cannot read this {architecture} "
                      f"GGUF file (damaged?): {type(e).__name__}: {_one_line(e)}") from None
    for key, tensor in loaded.state_dict().items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise BadGGUF(f"{gguf_path}: {key} holds NaN or infinity: the file's tensor bytes are damaged")
    return tokenizer, loaded


def convert_gguf(gguf_path: str | Path, out: str | Path, dtype: str = "bfloat16",
                 check: Callable[[Converted], None] | None = None) -> Converted:
    """Write the model in ``gguf_path`` to ``out`` as safetensors in ``dtype``, with its
    tokenizer; the directory appears whole or not at all (written beside it, then renamed),
    and a file that gives no model (:class:`BadGGUF`) or a ``check`` that raises on what
    would be written leaves ``out`` as it was."""
    check_readers()
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    gguf_path, out = Path(gguf_path), Path(out)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    start = time.perf_counter()
    architecture = read_architecture(gguf_path)
    tokenizer, loaded = _load(gguf_path, architecture)
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
            raise BadGGUF(f"{gguf_path}: the rebuilt {config.model_type} model does not take the file's weights "
                          f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    model.tie_weights()
    model = model.to(DTYPES[dtype]).eval()
    mask_id = resolve_mask_token_id(tokenizer, config.get_text_config().vocab_size, "auto")
    converted = Converted(out, config.model_type, sum(p.numel() for p in model.parameters()), mask_id,
                          tokenizer.convert_ids_to_tokens(mask_id), 0.0)
    if check is not None:
        check(converted)  # before anything is written

    staging = staging_dir(out)
    try:
        staging.mkdir(parents=True)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / "source.json").write_text(json.dumps(
            {"gguf": gguf_path.name, "bytes": gguf_path.stat().st_size, "dtype": dtype, "mask_token_id": mask_id,
             "mask_token": converted.mask_token}, indent=1) + "\n")
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return replace(converted, seconds=time.perf_counter() - start)
