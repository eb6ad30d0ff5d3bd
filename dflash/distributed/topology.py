"""Who does what: target ranks, drafter ranks, and the deterministic micro-batch schedule.

Ranks ``0..T-1`` hold the frozen target and produce batch bundles; ranks
``T..N-1`` train the drafter. With ``T = 0`` (colocated data-parallel) every rank
holds both and produces the micro-batches it trains on itself. With tensor
parallelism ``k`` the target ranks form ``G = T / k`` groups of ``k`` consecutive
ranks, each holding one sharded replica: the schedule sees a group as one target,
all its ranks prefill the same micro-batch together and its first rank (the
leader) sends the bundle. Global micro-batch ``m`` is produced by target group
``m mod G`` (``G = T`` without tensor parallelism) and consumed by drafter
``(m // A) mod D`` (``A`` = gradient accumulation), so every send has exactly one
matching receive known in advance.
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
    tensor_parallel: int = 1  # k: target ranks per replica of the target

    def __post_init__(self):
        n, t, k = self.world_size, self.num_targets, self.tensor_parallel
        if not (t == 0 or 1 <= t < n):
            raise TopologyError(
                f"topology.target_ranks={t} with {n} processes: need 1 <= target_ranks < nproc "
                "(at least one target and one drafter rank), or topology.mode=colocated"
            )
        if k < 1:
            raise TopologyError(f"target.tensor_parallel={k}: need at least 1")
        if k > 1 and (t == 0 or t % k):
            raise TopologyError(
                f"target.tensor_parallel={k} shards each target replica over {k} target ranks, so "
                f"topology.target_ranks must be a positive multiple of {k} (it is {t}"
                f"{', colocated' if t == 0 else ''}); change topology.target_ranks or target.tensor_parallel"
            )
        per_step = self.micro_batch_size * self.num_drafters
        if self.batch_size % per_step:
            raise TopologyError(
                f"train.batch_size={self.batch_size} must be a multiple of train.micro_batch_size x drafter ranks "
                f"= {self.micro_batch_size} x {self.num_drafters} = {per_step}; change one of them or topology.target_ranks"
            )

    @property
    def num_groups(self) -> int:
        """G: target replicas, each one target in the schedule."""
        return self.num_targets // self.tensor_parallel

    @property
    def senders(self) -> list[int]:
        """The target ranks that send bundles: each group's first rank."""
        return list(range(0, self.num_targets, self.tensor_parallel))

    @property
    def target_groups(self) -> list[list[int]]:
        """The ranks of each target group, in group order."""
        return [self.group_of(leader) for leader in self.senders]

    def leader(self, target: int) -> int:
        """The sending rank of ``target``'s group."""
        return target - target % self.tensor_parallel

    def group_of(self, target: int) -> list[int]:
        """The ranks of ``target``'s group, itself included."""
        return list(range(self.leader(target), self.leader(target) + self.tensor_parallel))

    @property
    def is_sender(self) -> bool:
        """A target rank that sends bundles (a group's leader)."""
        return self.is_target and self.rank % self.tensor_parallel == 0

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
        """The rank that sends micro-batch ``m``: its group's leader (colocated, its consumer)."""
        return self.consumer(m) if self.colocated else (m % self.num_groups) * self.tensor_parallel

    def consumer(self, m: int) -> int:
        """Global rank of the drafter that trains on micro-batch ``m``."""
        return self.num_targets + (m // self.accumulation) % self.num_drafters

    def produced_by(self, target: int, first: int, last: int) -> list[int]:
        """Micro-batches in ``[first, last)`` that ``target`` produces (with its group), in order."""
        group, count = target // self.tensor_parallel, self.num_groups
        start = first + (group - first) % count
        return list(range(start, last, count))

    def consumed_by(self, drafter: int, first: int, last: int) -> list[int]:
        """Micro-batches in ``[first, last)`` that ``drafter`` consumes, in order."""
        return [m for m in range(first, last) if self.consumer(m) == drafter]


def auto_target_ranks(world_size: int, target_params: float, drafter_params: float, anchors: int, seq_len: int,
                      tensor_parallel: int = 1) -> int:
    """Split by FLOPs per sequence: the target prefill costs ``2 x P_t x S``, a drafter step
    about ``6 x P_d x anchors x 16`` (plus the LM head, counted in ``P_d``). Targets get
    their share of the GPUs in whole groups of ``tensor_parallel`` ranks, rounded, at least
    one group, and at least one drafter remains. Raises :class:`TopologyError` when one
    group leaves no drafter."""
    k = tensor_parallel
    if world_size <= k:
        raise TopologyError(f"target.tensor_parallel={k} with {world_size} processes leaves no drafter rank; "
                            "launch more processes or lower target.tensor_parallel")
    target_flops = 2 * target_params * seq_len
    drafter_flops = 6 * drafter_params * anchors * 16
    share = target_flops / (target_flops + drafter_flops)
    groups = min((world_size - 1) // k, max(1, round(world_size * share / k)))
    return groups * k


def nearest_allowed_split(split: int, world_size: int, micro_batch_size: int, batch_size: int,
                          tensor_parallel: int = 1) -> int:
    """``split`` target ranks, or, when :class:`Topology` refuses it (the batch does not divide
    over the drafter ranks it leaves), the nearest split it allows (the one with fewer target
    ranks on a tie); ``split`` itself when it allows none, so that :class:`Topology` names the
    key to change."""

    def allowed(targets: int) -> bool:
        try:
            Topology(world_size, 0, targets, micro_batch_size, batch_size, tensor_parallel)
        except TopologyError:
            return False
        return True

    return min(filter(allowed, range(1, world_size)), key=lambda t: (abs(t - split), t), default=split)
