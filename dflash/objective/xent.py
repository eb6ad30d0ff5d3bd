"""Softmax cross-entropy over the vocabulary in two memory-bound passes.

Per loss chunk the LM head writes ``[rows, V]`` logits (at Qwen3-8B shapes 4096 x
151936 bf16, 1.2 GB) and the loss needs three things of them: each row's
log-sum-exp and argmax, the label's logit, and the logits' gradient
``row_scale * softmax - label_scale * onehot``. The least traffic that takes is
two reads of the logits and one write of the gradient. Compiled from the plain
PyTorch formula, Inductor's kernels move more than that: ``logsumexp`` keeps max
and sum apart and the argmax is a third reduction (the timings are in
docs/benchmarks/2026-11-30-h200-compile-warm-starts-checkpoints.md, the vocabulary pass; ``python
tools/xent_probe.py`` measures them). Here, on CUDA, one Triton kernel reads each row
once for all the statistics (an online softmax whose running max also carries
the argmax), and a second writes the gradient. Elsewhere the op is the PyTorch
formula, which is also the reference the kernels are tested against.

With ``segment``, the gradient pass also writes each row's maxima over segments of
that many columns: what :func:`dflash.topk.top_k_of_rows` searches first for the
DFlash2 selector's candidates. As a pass of its own over the logits that took 1.28 ms
of a 74 ms DFlash2 micro-step on the H200; here it reads nothing more.

A custom op, so that the compiler calls it as it is and CUDA graphs record its
launches.
"""

from __future__ import annotations

import functools
import types

import torch

from dflash.topk import segment_maxima

# Columns per step of the statistics pass and per program of the gradient pass, warps per
# program, and how deep the statistics pass pipelines its loads: the fastest on the H200 of
# those tools/xent_probe.py tries (deeper pipelining was slower).
STATS_BLOCK, STATS_WARPS, STATS_STAGES = 2048, 8, 1
GRAD_BLOCK, GRAD_WARPS = 2048, 8


@torch.library.custom_op("dflash::softmax_xent", mutates_args=())
def softmax_xent(
    logits: torch.Tensor, labels: torch.Tensor, row_scale: torch.Tensor, label_scale: torch.Tensor, segment: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``logits [rows, V]``: ``(lse, label_logit, argmax, grad, maxima)``.

    ``lse`` and ``label_logit`` are fp32 ``[rows]``, ``argmax`` int64 ``[rows]`` (the
    first maximum, as ``torch.argmax``), and ``grad [rows, V]`` in the logits' dtype
    is ``row_scale[:, None] * softmax(logits) - label_scale[:, None] * onehot(labels)``,
    computed in fp32 and rounded once. ``maxima [rows, V // segment]`` in the logits'
    dtype holds the maximum of each whole segment of ``segment`` columns (``[rows, 0]``
    for ``segment`` 0)."""
    if logits.is_cuda and _triton() is not None:
        return _softmax_xent_triton(logits, labels, row_scale, label_scale, segment)
    return softmax_xent_reference(logits, labels, row_scale, label_scale, segment)


@softmax_xent.register_fake
def _(logits, labels, row_scale, label_scale, segment=0):
    rows = logits.shape[0]
    fp32 = logits.new_empty(rows, dtype=torch.float32)
    maxima = logits.new_empty(rows, logits.shape[1] // segment if segment else 0)
    return fp32, fp32.clone(), logits.new_empty(rows, dtype=torch.int64), torch.empty_like(logits), maxima


def softmax_xent_reference(
    logits: torch.Tensor, labels: torch.Tensor, row_scale: torch.Tensor, label_scale: torch.Tensor, segment: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`softmax_xent` in plain PyTorch."""
    x = logits.float()
    lse = x.logsumexp(-1)
    label_logit = x.gather(1, labels[:, None]).squeeze(1)
    vocab = torch.arange(x.shape[1], device=x.device)
    grad = row_scale[:, None] * (x - lse[:, None]).exp() - torch.where(vocab == labels[:, None], label_scale[:, None], 0.0)
    return lse, label_logit, x.argmax(-1), grad.to(logits.dtype), segment_maxima(logits, segment)


def _softmax_xent_triton(logits, labels, row_scale, label_scale, segment=0):
    kernels = _triton()
    logits, labels = logits.contiguous(), labels.contiguous()
    rows, vocab = logits.shape
    lse = logits.new_empty(rows, dtype=torch.float32)
    label_logit = torch.empty_like(lse)
    argmax = logits.new_empty(rows, dtype=torch.int64)
    grad = torch.empty_like(logits)
    fused = segment > 0 and GRAD_BLOCK % segment == 0  # the gradient's blocks hold whole segments
    maxima = logits.new_empty(rows, vocab // segment) if fused else segment_maxima(logits, segment)
    if rows:
        kernels.row_stats[(rows,)](
            logits, labels, lse, label_logit, argmax, vocab, BLOCK=STATS_BLOCK, STAGES=STATS_STAGES, num_warps=STATS_WARPS
        )
        kernels.logits_grad[(rows, -(-vocab // GRAD_BLOCK))](
            logits, labels, lse, row_scale.float().contiguous(), label_scale.float().contiguous(), grad,
            maxima if fused else grad, vocab, maxima.shape[1],  # unread unless fused
            BLOCK=GRAD_BLOCK, SEGMENT=segment if fused else 0, num_warps=GRAD_WARPS,
        )
    return lse, label_logit, argmax, grad, maxima


@functools.cache
def _triton():
    """The Triton kernels, or None where Triton is not installed (CPU-only wheels)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def row_stats(logits, labels, lse_out, label_out, argmax_out, vocab, BLOCK: tl.constexpr, STAGES: tl.constexpr):
        # Each of the BLOCK lanes keeps its own running max m, sum s of exp(x - m), and the
        # first column where m was reached: one exp per element, since only one of the
        # two terms of the usual online update is not exp(0). Lanes merge at the end.
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * vocab
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], -3.0e38, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        first = tl.zeros([BLOCK], tl.int32)
        for start in tl.range(0, vocab, BLOCK, num_stages=STAGES):
            c = start + cols
            x = tl.load(base + c, mask=c < vocab, other=float("-inf")).to(tl.float32)
            e = tl.exp(-tl.abs(x - m))
            up = x > m
            s = tl.where(up, s * e + 1.0, s + e)
            first = tl.where(up, c, first)
            m = tl.maximum(m, x)
        top = tl.max(m, 0)
        total = tl.sum(s * tl.exp(m - top), 0)
        tl.store(lse_out + row, top + tl.log(total))
        tl.store(argmax_out + row, tl.min(tl.where(m == top, first, vocab), 0).to(tl.int64))
        tl.store(label_out + row, tl.load(base + tl.load(labels + row)).to(tl.float32))

    @triton.jit
    def logits_grad(logits, labels, lse, row_scale, label_scale, grad, maxima, vocab, segments,
                    BLOCK: tl.constexpr, SEGMENT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = c < vocab
        x = tl.load(logits + row * vocab + c, mask=inside, other=float("-inf")).to(tl.float32)
        g = tl.load(row_scale + row) * tl.exp(x - tl.load(lse + row))
        g -= tl.where(c == tl.load(labels + row), tl.load(label_scale + row), 0.0)
        tl.store(grad + row * vocab + c, g.to(grad.dtype.element_ty), mask=inside)
        if SEGMENT > 0:  # a segment past the vocabulary's end is not whole: not stored
            top = tl.max(tl.reshape(x, [BLOCK // SEGMENT, SEGMENT]), 1)
            s = tl.program_id(1) * (BLOCK // SEGMENT) + tl.arange(0, BLOCK // SEGMENT)
            tl.store(maxima + row * segments + s, top.to(maxima.dtype.element_ty), mask=s < segments)

    return types.SimpleNamespace(row_stats=row_stats, logits_grad=logits_grad)
