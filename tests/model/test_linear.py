"""The linear layer's weight gradient is summed in fp32 into its buffer, against a float64
reference; activation gradients, the state dict and layers without a buffer are untouched."""

import pytest
import torch
from torch import nn
from torch._dynamo.backends.debugging import aot_eager
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.model.linear import Linear


def layer(dtype: torch.dtype, device: str = "cpu") -> Linear:
    torch.manual_seed(0)
    lin = Linear(48, 40).to(device)
    lin.weight.data = lin.weight.data.to(dtype)
    lin.grad_sink = torch.zeros(40, 48, device=device)
    return lin


def passes(dtype: torch.dtype, device: str = "cpu", n: int = 3):
    """``n`` backward passes of one layer; returns the layer and each pass's (x, dy), both
    rounded to ``dtype`` as the layer's GEMMs see them."""
    lin = layer(dtype, device)
    g = torch.Generator(device).manual_seed(1)
    seen = []
    for _ in range(n):
        x = torch.randn(2, 24, 48, device=device, generator=g, requires_grad=True)
        dy = torch.randn(2, 24, 40, device=device, generator=g).to(dtype)
        lin(x).backward(dy)
        seen.append((x.detach().to(dtype), dy, x.grad))
    return lin, seen


def float64_sum(seen) -> torch.Tensor:
    return sum(dy.flatten(0, 1).double().T @ x.flatten(0, 1).double() for x, dy, _ in seen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_gradient_sums_in_fp32_and_activation_gradients_are_plain(dtype):
    lin, seen = passes(dtype)
    exact = float64_sum(seen)
    torch.testing.assert_close(lin.grad_sink.double(), exact, rtol=1e-6, atol=1e-5)
    assert lin.weight.grad is None
    if dtype == torch.bfloat16:  # each pass rounded to bf16 before the sum, as autograd's .grad would be
        rounded = sum((dy.flatten(0, 1).T @ x.flatten(0, 1)).float() for x, dy, _ in seen).double()
        assert (rounded - exact).abs().max() > 10 * (lin.grad_sink.double() - exact).abs().max()
    for x, dy, x_grad in seen:
        torch.testing.assert_close(x_grad, (dy @ lin.weight).float(), rtol=0, atol=0)


def test_autocast_over_fp32_weights_equals_bf16_weights():
    """A layer run under autocast casts as autocast would, forward and backward alike."""
    held = layer(torch.bfloat16)
    masters = layer(torch.float32)
    x = torch.randn(2, 24, 48)
    dy = torch.randn(2, 24, 40).bfloat16()
    held(x).backward(dy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = masters(x)
    out.backward(dy)
    assert torch.equal(held.grad_sink, masters.grad_sink)


def test_without_a_buffer_or_without_grad_it_is_nn_linear():
    lin = layer(torch.float32)
    plain = nn.Linear(48, 40, bias=False)
    plain.load_state_dict(lin.state_dict())
    assert set(lin.state_dict()) == {"weight"}
    x = torch.randn(3, 48)
    with torch.no_grad():
        assert torch.equal(lin(x), plain(x))
    lin.grad_sink = None
    lin(x).sum().backward()
    plain(x).sum().backward()
    assert torch.equal(lin.weight.grad, plain.weight.grad)


def test_a_layer_used_twice_in_a_compiled_graph_adds_both_uses():
    """The drafter's k/v projections run on the block and on the context: under
    ``torch.compile`` both backward GEMMs add into the one buffer, as in eager."""
    torch._dynamo.reset()
    sums = []
    for compiled in (False, True):
        lin = layer(torch.bfloat16)
        fn = (lambda a, b: lin(a).float().square().sum() + lin(b).float().sum())
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True) if compiled else fn
        g = torch.Generator().manual_seed(2)
        for _ in range(2):
            fn(torch.randn(5, 48, generator=g), torch.randn(7, 48, generator=g)).backward()
        sums.append(lin.grad_sink)
    assert sums[0].abs().sum() > 0
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-6, atol=1e-6)


class OpNames(TorchDispatchMode):
    """The names of the ops run while active (ops that others call inside not included)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("input_grad", [False, True])
def test_the_input_gradient_gemm_runs_only_for_an_input_that_needs_it(input_grad):
    """``fc`` reads the target's features, which need no gradient: its backward runs the
    weight-gradient GEMM only, not the ``[tokens, 5h]`` input-gradient one as well."""
    lin = layer(torch.bfloat16)
    x = torch.randn(2, 24, 48, requires_grad=input_grad)
    out = lin(x)
    with OpNames() as ops:
        out.backward(torch.randn_like(out))
    assert ops.names.count("dflash::add_weight_grad") == 1
    assert ("aten::matmul" in ops.names or "aten::mm" in ops.names) == input_grad
    assert lin.grad_sink.abs().sum() > 0


def test_dynamo_records_the_layer_as_one_op():
    """Traced as one node per call, not as an autograd.Function's forward and backward
    subgraphs: that was half of Dynamo's tracing of the drafter steps on the CPU."""
    torch._dynamo.reset()
    lin = layer(torch.bfloat16)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return aot_eager(gm, inputs)

    fn = torch.compile(lambda a: lin(a).float().sum() + lin(2 * a).float().sum(), backend=backend, fullgraph=True)
    fn(torch.randn(5, 48, requires_grad=True)).backward()
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.dflash.sink_linear.default) == 2
    assert not any("autograd_function" in str(t) for t in targets)


@pytest.mark.gpu
def test_weight_gradient_sums_in_fp32_inside_the_cublas_gemm():
    """On CUDA a bf16 layer's weight-gradient GEMM writes the fp32 sum itself (``addmm``
    with ``out_dtype``, in place): equal to a float64 sum of the bf16 operands to fp32
    precision, far closer than adding gradients rounded to bf16."""
    lin, seen = passes(torch.bfloat16, "cuda")
    exact = float64_sum(seen)
    error = (lin.grad_sink.double() - exact).abs().max()
    rounded = sum((dy.flatten(0, 1).T @ x.flatten(0, 1)).float() for x, dy, _ in seen).double()
    assert error < 1e-4 and (rounded - exact).abs().max() > 10 * error
    assert lin.weight.grad is None
