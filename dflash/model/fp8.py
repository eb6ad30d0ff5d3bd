"""FP8 matmuls past bf16's limit, through torchao (the ``fp8`` extra).

Hopper's FP8 tensor cores run at twice the bf16 rate, and both roles spend most of their
time in linear layers. Two switches, both off by default until an H200 has measured their
speed and their acceptance (BENCHMARKS.md):

- ``train.fp8``: the drafter's trainable linear layers (attention projections, MLP, the
  context projection ``fc``) train with torchao's float8 training at rowwise scaling: each
  GEMM operand is scaled per row along the contraction, so an outlier token or channel costs
  only its own row's precision. Only the compute copy is swapped and the swapped layers share
  its weights, so the fp32 masters, the optimizer, checkpoints and the bf16 export are those
  of a bf16 run. The swapped layers leave :mod:`dflash.model.linear`'s fused gradient sums
  (their weight gradient comes through autograd and is added to the fp32 sums after each
  backward, as the norms' are). The frozen LM head stays in bf16.
- ``target.fp8``: the target's decoder layers prefill with weights quantized once at load
  (per output channel) and activations per token (torchao's dynamic float8 quantization).
  The embedding and LM head stay in bf16: the drafter reads them.

torchao 0.18.0 runs float8 training with torch 2.13 (verified on the CPU, whose
``torch._scaled_mm`` the tests use); its dynamic float8 inference runs on CUDA only.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 9)  # Ada, Hopper, Blackwell: FP8 tensor cores
ALIGNMENT = 16  # the FP8 GEMM's operands need both dimensions a multiple of 16


def fp8_unsupported(device: torch.device) -> str | None:
    """Why FP8 matmuls cannot run on ``device``; None where they can."""
    if device.type != "cuda":
        return (f"FP8 matmuls run on CUDA GPUs of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
                f"newer (Ada, Hopper, Blackwell), and this run is on the {device.type.upper()}")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} is compute capability {capability[0]}.{capability[1]}; FP8 "
                f"matmuls need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer")
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'dflash[fp8]')"
    return None


def check_fp8(key: str, device: torch.device) -> None:
    """Refuse ``key=true`` where FP8 cannot run, naming why, before anything loads."""
    why = fp8_unsupported(device)
    if why:
        raise ValueError(f"{key}=true: {why}. Set {key}=false")


def fp8_shaped(layer: nn.Linear) -> bool:
    """Whether the FP8 GEMM takes ``layer``'s shape."""
    return layer.in_features % ALIGNMENT == 0 and layer.out_features % ALIGNMENT == 0


def train_in_fp8(module: nn.Module) -> list[str]:
    """Swap every linear layer of ``module`` that the FP8 GEMM takes for torchao's
    ``Float8Linear`` at rowwise scaling, sharing its weight (the parameters, their order
    and the state dict stay as they were). Returns the names of the layers swapped; any
    other stays in bf16, with a warning."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    swapped, kept = [], []

    def take(layer: nn.Module, name: str) -> bool:
        ok = fp8_shaped(layer)
        (swapped if ok else kept).append(name)
        return ok

    convert_to_float8_training(module, module_filter_fn=take, config=Float8LinearConfig.from_recipe_name("rowwise"))
    if kept:
        log.warning("train.fp8: %d linear layer(s) stay in bf16, their sides not multiples of %d: %s", len(kept),
                    ALIGNMENT, ", ".join(kept))
    return swapped


def quantize_prefill(layers: list[nn.Module]) -> int:
    """Quantize the linear weights of the target's decoder ``layers`` to FP8 once, per
    output channel, with activations quantized per token at every forward. Returns how
    many linear layers were quantized."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    count = 0

    def take(layer: nn.Module, name: str) -> bool:
        nonlocal count
        ok = isinstance(layer, nn.Linear) and fp8_shaped(layer)
        count += ok
        return ok

    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    for layer in layers:
        quantize_(layer, config, filter_fn=take)
    return count
