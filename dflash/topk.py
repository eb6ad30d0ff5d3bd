"""The k largest entries of each row of a matrix as wide as an LM head's vocabulary.

``torch.topk`` over 152k-column rows was the largest piece of a DFlash2 step with no
FLOP in it. Both the selector's candidates (the loss's chunks) and the KL's teacher
logits (the target's prefill) take the top-k of such rows, so this is a leaf below both.
"""

from __future__ import annotations

import torch

# columns per segment (docs/benchmarks/2026-12-02-h200-gradient-fix-confirmed.md, "DFlash2 at
# block 8: the selector's top-k over segments")
SEGMENT = 128


def segment_maxima(x: torch.Tensor, segment: int) -> torch.Tensor:
    """The maximum of each whole segment of ``segment`` columns of ``x [rows, V]``
    (``[rows, 0]`` for ``segment`` 0 or a row shorter than one segment)."""
    rows, width = x.shape
    whole = width // segment if segment else 0
    return x[:, : whole * segment].reshape(rows, whole, segment).amax(-1) if whole else x.new_empty(rows, 0)


def top_k_of_rows(x: torch.Tensor, k: int, segment: int = SEGMENT,
                  maxima: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)`` of a row-major ``[rows, V]`` matrix: the same values (ids may
    differ only among equal values, as ``topk``'s own do), sorted, in 1.5 ms where ``topk``
    takes 3.9 (``[3584, 151936]`` bf16 logits, k = 16, on the H200).

    Each row is cut into segments of ``segment`` columns and only the ``k`` segments with
    the largest maxima are searched, with the columns past the last whole segment. That is
    exact: those ``k`` maxima are ``k`` entries at least the ``k``-th largest maximum ``m``,
    so every entry of the row's top ``k`` is ``>= m``; one in an unsearched segment would
    be ``<= m`` (its segment's maximum is), so it equals ``m`` and ties an entry searched.

    ``maxima [rows, V // segment]``, each whole segment's maximum, where a pass over ``x``
    already computed them (the loss's gradient kernel, :mod:`dflash.objective.xent`).
    """
    rows, width = x.shape
    whole = width // segment
    if whole < k:
        return x.topk(k, dim=-1)
    if maxima is None:
        maxima = segment_maxima(x, segment)
    first = maxima.topk(k, dim=-1).indices * segment  # [rows, k] first column of each searched segment
    columns = (first[:, :, None] + torch.arange(segment, device=x.device)).flatten(1)
    if width > whole * segment:
        columns = torch.cat([columns, torch.arange(whole * segment, width, device=x.device).expand(rows, -1)], 1)
    values, at = x.gather(1, columns).topk(k, dim=-1)
    return values, columns.gather(1, at)
