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
buffer is not part of the state dict).
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
def sink_linear(x: torch.Tensor, weight: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T``, whose backward adds the weight's gradient into ``sink``.

    A custom op with its own autograd rather than an ``autograd.Function``: Dynamo
    records an op as one node, where it traces a Function's forward and backward
    into subgraphs at every call, 46 calls per drafter step. On the CPU that cut
    Dynamo's tracing of the steps by half (docs/benchmarks/2026-12-03-h200-both-kernels-warm-launch.md), time a
    warm launch spends before its first step."""
    return F.linear(x, weight)


@sink_linear.register_fake
def _(x, weight, sink):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _save_operands(ctx, inputs, output) -> None:
    x, weight, sink = inputs
    ctx.save_for_backward(x, weight)
    ctx.sink = sink  # not saved: autograd's version check would refuse the sum once it grew


def _backward(ctx, grad: torch.Tensor):
    x, weight = ctx.saved_tensors
    torch.ops.dflash.add_weight_grad(ctx.sink, grad.flatten(0, -2), x.flatten(0, -2))
    return grad @ weight if ctx.needs_input_grad[0] else None, None, None


sink_linear.register_autograd(_backward, setup_context=_save_operands)


class Linear(nn.Linear):
    """``nn.Linear`` without bias that, once ``grad_sink`` is set, adds its weight's
    gradient into that buffer instead of ``weight.grad``.

    The weight must still require grad: autograd records the layer only if some input
    does, and ``fc`` reads the target's features, which do not."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.register_buffer("grad_sink", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_sink is None or not torch.is_grad_enabled():
            return super().forward(x)
        # Cast as autocast would (it leaves custom ops alone): the backward runs outside
        # autocast, and its GEMMs must see the operands the forward's saw.
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype
        return sink_linear(x.to(dtype), self.weight.to(dtype), self.grad_sink)
