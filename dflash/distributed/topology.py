"""Who does what: target ranks, drafter ranks, and the deterministic micro-batch schedule.

Ranks ``0..T-1`` hold the frozen target and produce batch bundles; ranks
``T..N-1`` train the drafter. With ``T = 0`` (colocated data-parallel) every rank
holds both and produces the micro-batches it trains on itself. Global micro-batch ``m`` is produced by target
``m mod T`` and consumed by drafter ``(m // A) mod D`` (``A`` = gradient
accumulation), so every send has exactly one matching receive known in advance.
Both sides walk their micro-batches in increasing ``m``; a rank that waits
always waits on a smaller ``m`` than the one it holds, so no cycle of waits
(deadlock) can form.
"""

from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    """An impossible split, reported before any process group exists."""


@dataclass(frozen=True)
class Topology:
    """This rank's place in a disaggregated job and the schedule every rank derives
    alike from the same five numbers, so no rank asks another who sends what."""

    world_size: int
    rank: int
    num_targets: int  # T; 0: colocated data-parallel
    micro_batch_size: int
    batch_size: int

    def __post_init__(self):
        n, t = self.world_size, self.num_targets
        if not (t == 0 or 1 <= t < n):
            raise TopologyError(
                f"topology.target_ranks={t} with {n} processes: need 1 <= target_ranks < nproc "
                "(at least one target and one drafter rank), or topology.mode=colocated"
            )
        per_step = self.micro_batch_size * self.num_drafters
        if self.batch_size % per_step:
            raise TopologyError(
                f"train.batch_size={self.batch_size} must be a multiple of train.micro_batch_size x drafter ranks "
                f"= {self.micro_batch_size} x {self.num_drafters} = {per_step}; change one of them or topology.target_ranks"
            )

    @property
    def num_drafters(self) -> int:
        return self.world_size - self.num_targets

    @property
    def accumulation(self) -> int:
        """Micro-batches each drafter runs per optimizer step."""
        return self.batch_size // (self.micro_batch_size * self.num_drafters)

    @property
    def colocated(self) -> bool:
        """Every rank prefills its own micro-batches and trains on them."""
        return self.num_targets == 0

    @property
    def is_target(self) -> bool:
        return self.rank < self.num_targets

    @property
    def drafter_ranks(self) -> list[int]:
        return list(range(self.num_targets, self.world_size))

    @property
    def metrics_rank(self) -> int:
        """The first drafter rank: it sees the reduced loss (rank 0 is a target, or
        colocated, rank 0 itself)."""
        return self.num_targets

    def producer(self, m: int) -> int:
        return self.consumer(m) if self.colocated else m % self.num_targets

    def consumer(self, m: int) -> int:
        """Global rank of the drafter that trains on micro-batch ``m``."""
        return self.num_targets + (m // self.accumulation) % self.num_drafters

    def produced_by(self, target: int, first: int, last: int) -> list[int]:
        """Micro-batches in ``[first, last)`` that ``target`` produces, in order."""
        start = first + (target - first) % self.num_targets
        return list(range(start, last, self.num_targets))

    def consumed_by(self, drafter: int, first: int, last: int) -> list[int]:
        """Micro-batches in ``[first, last)`` that ``drafter`` consumes, in order."""
        return [m for m in range(first, last) if self.consumer(m) == drafter]


def auto_target_ranks(world_size: int, target_params: float, drafter_params: float, anchors: int, seq_len: int) -> int:
    """Split by FLOPs per sequence: the target prefill costs ``2 x P_t x S``, a drafter step
    about ``6 x P_d x anchors x 16`` (plus the LM head, counted in ``P_d``). Targets get
    their share of the GPUs, rounded, at least one, and at least one drafter remains."""
    target_flops = 2 * target_params * seq_len
    drafter_flops = 6 * drafter_params * anchors * 16
    share = target_flops / (target_flops + drafter_flops)
    return min(world_size - 1, max(1, round(world_size * share)))
