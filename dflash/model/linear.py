"""A linear layer whose weight gradient is summed into an fp32 buffer by the backward GEMM.

Training accumulates the gradients of many micro-batches in fp32 while the compute
weights are bf16. With autograd's ``.grad``, each micro-batch's backward writes a
bf16 weight gradient and a separate pass adds it to the fp32 sum: at Qwen3-8B
shapes 2 GB written, then 6 GB read and 4 GB written again, 2.5 ms per micro-batch.
Here the weight-gradient GEMM itself adds into the fp32 sum (cuBLAS with beta = 1
and an fp32 output, as Megatron's gradient-accumulation fusion does): no bf16
gradient exists, and the sum is more precise, since no micro-batch's gradient is
rounded to bf16 first.

The sum is the layer's ``grad_sink`` buffer. Without one, the layer is a plain
``nn.Linear``: evaluation, export and checkpoints never see the difference (the
buffer is not part of the state dict). Layers that read one input, such as an
attention's projections, train as one GEMM of their stacked weights
(:func:`project`), while each keeps its own weight and buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.library.custom_op("dflash::add_weight_grad", mutates_args=("sink",))
def add_weight_grad(sink: torch.Tensor, grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
    """``sink += grad_out.T @ inputs`` with products summed in ``sink``'s dtype.

    A custom op, so that the compiler calls it as is, in place on the buffer, and
    CUDA graphs record it. On CUDA, bf16 operands use ``addmm``'s ``out_dtype``:
    one cuBLAS call that reads and writes the fp32 sum. Elsewhere (the CPU has no
    such kernel) the operands are upcast first, which gives the same sums."""
    if sink.is_cuda and grad_out.dtype != sink.dtype:
        torch.addmm(sink, grad_out.t(), inputs, out_dtype=sink.dtype, out=sink)
    else:
        sink.addmm_(grad_out.t().to(sink.dtype), inputs.to(sink.dtype))


@torch.library.custom_op("dflash::sink_linear", mutates_args=())
def sink_linear(x: torch.Tensor, weights: list[torch.Tensor], sinks: list[torch.Tensor]) -> torch.Tensor:
    """``x @ cat(weights).T``, whose backward adds each weight's gradient into its sink.

    Several weights are layers that read one input (a drafter layer's q, k and v
    projections): one GEMM of their stacked rows, and in the backward one
    input-gradient GEMM, where separate layers ran three of each and summed the three
    input gradients in another pass. Its output is split back per layer by the caller.

    A custom op with its own autograd rather than an ``autograd.Function``: Dynamo
    records an op as one node, where it traces a Function's forward and backward
    into subgraphs at every call, 46 calls per drafter step. On the CPU that cut
    Dynamo's tracing of the steps by half (BENCHMARKS.md, tenth session), time a
    warm launch spends before its first step."""
    return F.linear(x, stacked(weights))


def stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """The weights as one matrix; a single one as it is, not copied."""
    return weights[0] if len(weights) == 1 else torch.cat(weights)


@sink_linear.register_fake
def _(x, weights, sinks):
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))


def _save_operands(ctx, inputs, output) -> None:
    x, weights, sinks = inputs
    ctx.save_for_backward(x, *weights)
    ctx.sinks = sinks  # not saved: autograd's version check would refuse the sums once they grew


def _backward(ctx, grad: torch.Tensor):
    x, *weights = ctx.saved_tensors
    grad_rows, x_rows = grad.flatten(0, -2), x.flatten(0, -2)
    start = 0
    for weight, sink in zip(weights, ctx.sinks):
        # a column slice of the stacked gradient: cuBLAS reads it in place, with its row stride
        torch.ops.dflash.add_weight_grad(sink, grad_rows[:, start : start + weight.shape[0]], x_rows)
        start += weight.shape[0]
    return grad @ stacked(weights) if ctx.needs_input_grad[0] else None, [None] * len(weights), [None] * len(weights)


sink_linear.register_autograd(_backward, setup_context=_save_operands)


class Linear(nn.Linear):
    """``nn.Linear`` without bias that, once ``grad_sink`` is set, adds its weight's
    gradient into that buffer instead of ``weight.grad``.

    The weight must still require grad: autograd records the layer only if some input
    does, and ``fc`` reads the target's features, which do not."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.register_buffer("grad_sink", None, persistent=False)

    def trains_into_sink(self) -> bool:
        return self.grad_sink is not None and torch.is_grad_enabled()

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the GEMMs run in: autocast's, as autocast would cast (it leaves custom
        ops alone). The backward runs outside autocast, and its GEMMs must see the operands
        the forward's saw."""
        device = x.device.type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.trains_into_sink():
            return super().forward(x)
        dtype = self.compute_dtype(x)
        return sink_linear(x.to(dtype), [self.weight.to(dtype)], [self.grad_sink])


def project(x: torch.Tensor, layers: list[Linear]) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]``; while training (every layer has its ``grad_sink``),
    as one :func:`sink_linear` of the stacked weights. Otherwise layer by layer: stacking
    copies the weights, which costs little beside a training step's GEMMs of thousands of
    rows and more than the GEMMs themselves when decoding drafts a block of 16."""
    if len(layers) == 1 or not all(layer.trains_into_sink() for layer in layers):
        return [layer(x) for layer in layers]
    dtype = layers[0].compute_dtype(x)
    out = sink_linear(x.to(dtype), [layer.weight.to(dtype) for layer in layers],
                      [layer.grad_sink for layer in layers])
    return list(out.split([layer.out_features for layer in layers], dim=-1))
