"""The target's plain greedy outputs, decoded once and kept.

The lossless check compares each greedy speculative output with the target's plain
greedy continuation of the same prompt. That continuation depends only on the target
(its weights, dtype and device), the prompt, the token budget and the stop tokens: a
frozen target gives the same one at every evaluation of a run, at the export's, and
to every drafter scored against the same target. Each output is kept under a key of
exactly those inputs, in memory and, given a path, in a small JSON file (a few hundred
bytes per prompt) that a resumed run or the next ``dflash.eval`` of the same target reads
back: at 2048 new tokens the baseline is one target forward per token, as many as the
speculative decoding's cycles times its acceptance length.

The target's identity is a fingerprint of its weights (float64 sums per tensor), not
its name: a random target of a given seed, a fine-tuned copy in the same directory, or
the same weights in another dtype each get their own outputs.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Collection, Sequence
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)


@torch.no_grad()
def fingerprint(model: nn.Module) -> str:
    """A digest of the model's weights, dtype and device type: two sums per tensor in
    float64, read back in one transfer."""
    named = list(model.state_dict().items())
    sums = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()]) for _, t in named]).cpu()
    first = named[0][1]
    text = json.dumps([[name, list(t.shape)] for name, t in named] + [str(first.dtype), first.device.type])
    return hashlib.sha256(text.encode() + sums.numpy().tobytes()).hexdigest()


class GreedyBaselines:
    """Plain greedy outputs by (target, prompt, budget, stop tokens); read from and
    written to ``path`` when given."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self.outputs: dict[str, list[int]] = {}
        self.fingerprints: dict[int, str] = {}  # by id(model): the weights are hashed once per model
        if self.path and self.path.is_file():
            try:
                self.outputs = json.loads(self.path.read_text())["outputs"]
            except (ValueError, KeyError, TypeError) as e:
                log.warning("%s is unreadable (%s): the greedy baseline is decoded again", self.path, e)

    def keys(self, model: nn.Module, prompts: Sequence[torch.Tensor], max_new_tokens: int,
             eos_ids: Collection[int]) -> list[str]:
        """One key per prompt ``[1, S]``."""
        if id(model) not in self.fingerprints:
            self.fingerprints[id(model)] = fingerprint(model)
        common = [self.fingerprints[id(model)], max_new_tokens, sorted(eos_ids)]
        return [hashlib.sha256(json.dumps(common + [ids[0].tolist()]).encode()).hexdigest() for ids in prompts]

    def get(self, key: str) -> list[int] | None:
        return self.outputs.get(key)

    def put(self, found: dict[str, list[int]]) -> None:
        """Keep new outputs and, with a path, rewrite the file (whole or not at all)."""
        self.outputs.update(found)
        if self.path and found:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".tmp_{self.path.name}")
            tmp.write_text(json.dumps({"outputs": self.outputs}) + "\n")
            tmp.replace(self.path)
