"""The vocabulary pass of the loss (``dflash::softmax_xent``): its Triton kernels
against the PyTorch formula, run by Triton's interpreter on the CPU and natively
on the GPU."""

import os
import subprocess
import sys

import pytest
import torch

from dflash.objective import xent
from dflash.topk import segment_maxima


def _case(rows, vocab, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 4
    for tied in (7, 7 + xent.STATS_BLOCK, vocab - 3):  # the first is the argmax, as in torch: ties in one lane and across
        logits[0, min(tied, vocab - 3)] = 60.0
    logits[1, vocab - 1] = 60.0  # the maximum in the last, partial block
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[2] = vocab - 1
    row_scale, label_scale = torch.rand(rows, generator=g), torch.rand(rows, generator=g)
    label_scale[3] = 0.0
    return [t.to(device) for t in (logits.to(dtype), labels, row_scale, label_scale)]


def _assert_matches_reference(inputs, segment=0):
    lse, label_logit, argmax, grad, maxima = xent._softmax_xent_triton(*inputs, segment)
    ref = xent.softmax_xent_reference(*inputs, segment)
    rows, vocab = inputs[0].shape
    assert torch.equal(maxima, ref[4]) and maxima.shape == (rows, vocab // segment if segment else 0)
    torch.testing.assert_close(lse, ref[0], rtol=1e-6, atol=1e-5)
    assert torch.equal(label_logit, ref[1])
    assert torch.equal(argmax, ref[2])
    assert grad.dtype == inputs[0].dtype
    # one rounding of the same fp32 value: at most one unit in the last place apart
    tol = 1e-6 if grad.dtype == torch.float32 else 8e-3
    torch.testing.assert_close(grad.float(), ref[3].float(), rtol=tol, atol=1e-7)


# rows, vocabulary, dtype, and the segments whose maxima the gradient pass also writes (96:
# not a divisor of the gradient's block, so computed apart)
INTERPRETED_CASES = [(6, 3 * xent.STATS_BLOCK + 5, torch.bfloat16, 128), (5, xent.STATS_BLOCK, torch.float32, 0),
                     (4, 100, torch.float32, 128), (4, xent.GRAD_BLOCK + 200, torch.bfloat16, 96)]


def test_kernels_equal_the_pytorch_formula_under_the_interpreter():
    """Partial last blocks, a vocabulary smaller than one block, ties and a zero label
    scale, on CPU tensors. In a fresh process: Triton reads ``TRITON_INTERPRET`` when
    it is imported, and the compiler may have imported it already."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["ok"] * len(INTERPRETED_CASES)


def test_the_cpu_runs_the_pytorch_formula():
    inputs = _case(4, 300, torch.float32, "cpu")
    for a, b in zip(torch.ops.dflash.softmax_xent(*inputs, 128), xent.softmax_xent_reference(*inputs, 128)):
        assert torch.equal(a, b)


def test_segment_maxima_are_each_whole_segments_maximum():
    logits = torch.randn(3, 300)
    maxima = segment_maxima(logits, 128)
    assert maxima.shape == (3, 2)
    assert torch.equal(maxima[:, 1], logits[:, 128:256].max(-1).values)
    assert segment_maxima(logits, 0).shape == (3, 0)


def test_reference_gradient_is_the_derivative_of_the_weighted_cross_entropy():
    logits, labels, row_scale, _ = _case(5, 40, torch.float32, "cpu")
    logits.requires_grad_()
    loss = (row_scale * torch.nn.functional.cross_entropy(logits, labels, reduction="none")).sum()
    (expected,) = torch.autograd.grad(loss, logits)
    lse, label_logit, _, grad, _ = xent.softmax_xent_reference(logits.detach(), labels, row_scale, row_scale)
    torch.testing.assert_close(grad, expected)
    torch.testing.assert_close((row_scale * (lse - label_logit)).sum(), loss.detach())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows, vocab, segment", [(64, 151936, 128), (64, 151936, 0), (33, 1000, 128)])
def test_kernels_equal_the_pytorch_formula_on_the_gpu(rows, vocab, segment):
    assert xent._triton() is not None
    _assert_matches_reference(_case(rows, vocab, torch.bfloat16, "cuda"), segment)


if __name__ == "__main__":
    for rows, vocab, dtype, segment in INTERPRETED_CASES:
        _assert_matches_reference(_case(rows, vocab, dtype, "cpu"), segment)
        print("ok")
