"""The two DFlash2 additions to a DFlash drafter: grouped dynamic convolutions and the
candidate selector.

Both are named and shaped as in the released ``DFlash2DraftModel`` checkpoints
(z-lab/dflash ``dflash/model.py``; the checkpoint fixture in
``tests/fixtures/dflash2_reference.json``), so a state dict exports unrenamed:

- ``layers.N.attention_conv`` and ``layers.N.mlp_conv``: ``base_kernel [2, K, H]``
  and ``kernel_projection [2*K*G, H]`` (``G = H / conv_group_size``).
- ``candidate_selector``: ``hidden_projection [r, H]``, ``predecessor_codebook [V, r]``
  and ``successor_codebook [V, r]``; the codebooks are bare parameters, not
  embeddings, so their names carry no ``.weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model.linear import Linear


def block_causal_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block: int) -> torch.Tensor:
    """Causal depthwise convolution inside each block of ``block`` rows.

    ``x [b, n*block, H]``; ``delta [b, n*block, K, G]`` are the per-row kernel
    corrections, one scalar per channel group and tap; ``base [K, H]`` the shared
    kernel. Row ``t`` of a block is ``sum_k (base[k] + delta[t, k]) * x[t - k]``, with
    ``x`` zero before the block's first row: a block never reads another block, as at
    inference, where the block is alone.
    """
    b, rows, hidden = x.shape
    taps, groups = delta.shape[-2:]
    xs = x.view(b, rows // block, block, groups, hidden // groups)
    delta = delta.view(b, rows // block, block, taps, groups, 1)
    out = torch.zeros_like(xs)
    for k in range(taps):
        keep = max(block - k, 0)
        shifted = F.pad(xs[:, :, :keep], (0, 0, 0, 0, block - keep, 0))
        out = out + shifted * (base[k].to(x.dtype).view(groups, -1) + delta[..., k, :, :])
    return out.view_as(x)


class GroupedCausalConv(nn.Module):
    """A pair of block-causal convolutions around one sublayer (attention or MLP).

    ``prepare`` convolves the sublayer's input; ``finish`` its output. Both kernels'
    per-row corrections come from one projection of the sublayer's input, so the output
    side reuses what ``prepare`` computed. Starts as the identity (tap 0 of the base
    kernel one, the rest and the projection zero): a new DFlash2 drafter computes
    exactly what the DFlash drafter with the same weights computes.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"drafter.conv_group_size={group_size} must divide the hidden size {hidden_size}")
        self.kernel_size, self.groups = kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = Linear(hidden_size, 2 * kernel_size * self.groups)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved input and the output side's corrections."""
        delta = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.groups))
        return block_causal_conv(x, delta[..., 0, :, :], self.base_kernel[0], block), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, block: int) -> torch.Tensor:
        return block_causal_conv(y, delta, self.base_kernel[1], block)


class CandidateSelector(nn.Module):
    """Rescores the LM head's top-k candidates of a slot with a low-rank transition term.

    The score of candidate ``c`` after predecessor ``p`` at a slot with hidden state
    ``h`` is ``logit(c) + <P[p] * (W h), S[c]>``: the unary logit plus a bilinear term
    of the predecessor's and the candidate's codebook rows, gated per rank by the slot's
    projected hidden state. Drafting walks the block left to right, each slot's pick
    becoming the next one's predecessor (:mod:`dflash.decode.selector`).

    The successor codebook starts at zero, so a new selector adds nothing and drafts
    exactly the unary argmax; the predecessor codebook and the projection start random,
    so the first gradient step reaches every parameter.
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"drafter.selector_top_k={top_k} must lie in 1..{vocab_size} (the vocabulary)")
        self.top_k = top_k
        self.hidden_projection = Linear(hidden_size, rank)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.hidden_projection.weight, std=std)
        nn.init.normal_(self.predecessor_codebook, std=std)
        nn.init.zeros_(self.successor_codebook)

    def transition(self, hidden: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """``[..., k]`` transition scores of ``candidates [..., k]`` after ``predecessors [...]``
        at slots with ``hidden [..., H]``. The codebook rows are looked up with ``embedding``:
        indexing's backward adds repeated rows' gradients with atomic adds across CPU
        threads, so DFlash2 runs differed from one another in the 7th digit; embedding's
        backward adds them in a fixed order."""
        context = F.embedding(predecessors, self.predecessor_codebook) * self.hidden_projection(hidden).to(
            self.predecessor_codebook.dtype)
        return (F.embedding(candidates, self.successor_codebook) * context.unsqueeze(-2)).sum(-1)
