"""The objective's settings, in one frozen object beside the code that reads them.

A loss knob is a field here and a key of the same name in the config's ``loss`` group:
:meth:`ObjectiveConfig.of_loss` takes every such key, so the plan and the trainer carry
it without an edit of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from dflash.objective.loss import default_gamma


@dataclass(frozen=True)
class ObjectiveConfig:
    """What the drafter step's loss reads (:class:`dflash.run.step.DrafterTrainer`)."""

    block_size: int
    mask_token_id: int
    gamma: float  # the decay exp(-(k-1)/gamma) over a block's slots
    ce_weight: float = 1.0
    kl_weight: float = 0.0
    chunk_size: int = 1024  # rows of the LM head per pass over the vocabulary
    packed: bool = False  # rows hold several samples (train.packing): each anchor's context stops at its sample
    # DFlash2: the selector term's weight, reached after warmup + ramp (fractions of total_steps)
    selector_alpha: float = 1.0
    selector_warmup: float = 0.0
    selector_ramp: float = 0.0
    selector_stop_gradient: bool = False
    total_steps: int = 0  # the run's, set by the trainer's builder

    @classmethod
    def of_loss(cls, loss: Mapping, *, block_size: int, mask_token_id: int, packed: bool) -> ObjectiveConfig:
        """The settings of the ``loss`` group's keys that name a field (its others, such
        as ``kl_topk``, are the target's); ``gamma`` unset or 0 is the paper's for the
        block size (:func:`~dflash.objective.loss.default_gamma`)."""
        given = {f.name: loss[f.name] for f in fields(cls) if f.name in loss}
        return cls(**{**given, "gamma": given.get("gamma") or default_gamma(block_size), "block_size": block_size,
                      "mask_token_id": mask_token_id, "packed": packed})
