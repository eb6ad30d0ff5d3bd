"""Choosing the layout: colocated or split, how many target ranks, which micro-batch.

The one home of the choice. It reads :class:`~dflash.run.settings.LayoutSettings` and
the :class:`~dflash.run.plan.Plan`, asks the cost model (:mod:`dflash.run.estimate`)
once per micro-batch size for what each role costs, and arranges the ranks from those
costs: a split changes which ranks hold what, not what a role costs. The choice depends
on the config and the device size only, so every rank makes the same one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dflash.distributed import tensor_parallel
from dflash.distributed.topology import (
    Topology,
    TopologyError,
    auto_target_ranks,
    nearest_allowed_split,
)
from dflash.model.drafter import DFlashDrafter
from dflash.run.estimate import Cost, active_params, role_costs
from dflash.run.plan import Plan
from dflash.run.settings import LayoutSettings

# The plan counts what a rank allocates; the caching allocator reserved up to 11% more on the
# H200 (the CUDA-graph pool and fragmentation of a 64k drafter step, BENCHMARKS.md), so a rank
# may plan on this share of its device.
USABLE_SHARE = 0.9

# What lowers each kind of rank's memory, for the message that refuses a plan
MEMORY_KEYS = {
    "drafter": "lower train.num_anchors, train.micro_batch_size or loss.chunk_size",
    "target": "shard the target over more ranks (target.tensor_parallel) or lower train.micro_batch_size",
    "colocated": "lower train.num_anchors, train.micro_batch_size or loss.chunk_size, or give each model ranks of "
                 "its own (topology.mode=disaggregated, two or more GPUs)",
}


class DoesNotFit(ValueError):
    """A plan that cannot run as configured; the message names the key to change."""


@dataclass(frozen=True)
class Layout:
    """One arrangement of ``world_size`` ranks, ``num_targets`` of them target ranks (0:
    colocated, in one process or data-parallel), at the micro-batch of ``cost``."""

    world_size: int
    num_targets: int
    auto_targets: int  # what topology.target_ranks=auto would take
    cost: Cost

    @property
    def colocated(self) -> bool:
        """Target and drafter in every process (one process, or colocated data-parallel)."""
        return self.num_targets == 0

    @property
    def samples_per_s(self) -> float:
        c = self.cost
        if self.colocated:
            return self.world_size / (1 / c.target_rate + 1 / c.drafter_rate)
        return min(self.num_targets * c.target_rate, (self.world_size - self.num_targets) * c.drafter_rate)

    @property
    def ranks(self) -> list[tuple[str, dict[str, float]]]:
        """Each kind of rank and its memory parts."""
        if self.colocated:
            return [("colocated", self.cost.colocated_gib)]
        return [("drafter", self.cost.drafter_gib), ("target", self.cost.target_gib)]

    @property
    def rank_gib(self) -> float:
        """The estimated memory of the fuller rank."""
        return max(sum(parts.values()) for _, parts in self.ranks)

    @property
    def name(self) -> str:
        if self.colocated:
            return "colocated data-parallel"
        k = self.cost.tensor_parallel
        name = f"{self.num_targets} target / {self.world_size - self.num_targets} drafter"
        return name + (f" ({self.num_targets // k} x TP{k})" if k > 1 else "")


def arrange(cost: Cost, world_size: int, num_targets: int, auto_targets: int) -> Layout:
    """The layout with ``num_targets`` target ranks; raises the :class:`TopologyError` of a
    split the batch or the nodes do not allow, with the key to change."""
    k = cost.tensor_parallel
    if k > 1 and world_size == 1:
        raise TopologyError(f"target.tensor_parallel={k} needs at least {k + 1} ranks (estimate.nproc, or torchrun)")
    if world_size > 1:
        topo = Topology(world_size, 0, num_targets, cost.micro_batch_size, cost.batch_size, k)
        tensor_parallel.check_placement(topo.target_groups, tensor_parallel.ranks_per_node(world_size))
    return Layout(world_size, num_targets, auto_targets, cost)


def layout_options(cost: Cost, world_size: int, auto_targets: int) -> list[Layout]:
    """Colocated (data-parallel) and every split of ``world_size`` ranks that the batch
    allows; raises the colocated layout's :class:`TopologyError` if it allows none."""
    k = cost.tensor_parallel
    splits = range(world_size) if k == 1 else range(k, world_size, k)  # a sharded target has no colocated layout
    options = []
    for targets in splits:
        try:
            options.append(arrange(cost, world_size, targets, auto_targets))
        except TopologyError:
            continue
    return options or [arrange(cost, world_size, 0, auto_targets)]


def check_fits(layout: Layout) -> None:
    """Raise :class:`DoesNotFit` if a rank's estimate exceeds its device's :data:`USABLE_SHARE`."""
    device_gib = layout.cost.device_gib
    usable = USABLE_SHARE * device_gib
    for role, parts in layout.ranks:
        total = sum(parts.values())
        if total > usable:
            raise DoesNotFit(
                f"a {role} rank needs an estimated {total:.1f} GiB, over the {usable:.1f} GiB it may plan on "
                f"({USABLE_SHARE:.0%} of its device's {device_gib:.1f} GiB, the rest left to the allocator); "
                f"{MEMORY_KEYS[role]}; estimate.device_gib sets the device size"
            )


def fits(layout: Layout) -> bool:
    try:
        check_fits(layout)
    except DoesNotFit:
        return False
    return True


def fastest_fitting(options: list[Layout]) -> Layout:
    """The layout with the most predicted samples/s among those that fit; colocated on a tie."""
    fastest = sorted(options, key=lambda e: (e.samples_per_s, e.colocated), reverse=True)
    fitting = [e for e in fastest if fits(e)]
    if not fitting:  # raises, for the layout that comes nearest to fitting: its keys are the ones to change
        check_fits(min(options, key=lambda e: e.rank_gib))
    return fitting[0]


def flops_split(plan: Plan, models: tuple[torch.nn.Module, DFlashDrafter], world_size: int, k: int) -> int:
    """Target ranks of ``world_size`` from the FLOPs of both sides (the target's count takes
    the experts a token runs through, the drafter's the frozen LM head it runs through
    too), before the batch has a say (:func:`auto_targets`)."""
    target, drafter = models
    head_params = target.get_output_embeddings().weight.numel()
    drafter_params = sum(p.numel() for p in drafter.parameters()) + head_params
    return auto_target_ranks(world_size, active_params(target, target.config.get_text_config()), drafter_params,
                             plan.num_anchors, plan.max_len, k)


def auto_targets(split: int, world_size: int, micro_batch_size: int, plan: Plan, k: int) -> int:
    """``topology.target_ranks=auto``: the FLOPs' ``split`` moved to the nearest one the
    batch divides over at this micro-batch size."""
    return nearest_allowed_split(split, world_size, micro_batch_size, plan.batch_size, k)


def resolve_targets(settings: LayoutSettings, options: list[Layout]) -> int:
    """Target ranks for the world size of ``options``; 0 is colocated (one process, or
    data-parallel). ``topology.mode=auto`` with ``target_ranks=auto`` takes the layout the
    cost model predicts fastest among those that fit."""
    first = options[0]
    if first.world_size == 1 or settings.mode == "colocated":
        return 0
    if settings.target_ranks is not None:
        return settings.target_ranks
    if settings.mode == "disaggregated":
        return first.auto_targets
    return fastest_fitting(options).num_targets


def faster_split_barred_by_batch(options: list[Layout]) -> tuple[int, float, int] | None:
    """The split the batch does not divide that predicts more than every split offered:
    (target ranks, samples/s per GPU, the fewest micro-batches per step that it divides),
    or None. Ranks hold the same whichever the split, so it fits where the others do; a
    tensor-parallel target is left out (its splits also depend on the group size)."""
    first = options[0]
    world, cost = first.world_size, first.cost
    if world < 2 or cost.tensor_parallel > 1:
        return None
    offered = {e.num_targets for e in options}
    best = max((e.samples_per_s for e in options if not e.colocated), default=0.0)
    rate, targets = max(((min(t * cost.target_rate, (world - t) * cost.drafter_rate), t)
                         for t in range(1, world) if t not in offered), default=(0.0, 0))
    if rate <= best:
        return None
    drafters = world - targets
    return targets, rate / world, -(-cost.micro_per_step // drafters) * drafters


@dataclass(frozen=True)
class LayoutChoice:
    """The layout a run takes, the ones open to it at the same micro-batch, and why an
    auto micro-batch took fewer rows than the token budget allows ("": it did not)."""

    taken: Layout
    options: list[Layout]
    note: str = ""

    @property
    def targets(self) -> int:
        """Target ranks of the layout taken; 0 colocated."""
        return self.taken.num_targets


def choose_layout(settings: LayoutSettings, plan: Plan, models: tuple[torch.nn.Module, DFlashDrafter],
                  world_size: int) -> tuple[Plan, LayoutChoice]:
    """The plan with its micro-batch, and the layout a run on ``world_size`` ranks takes.

    ``plan`` carries the token budget's micro-batch (:func:`~dflash.run.plan.auto_micro_batch`)
    or the one ``train.micro_batch_size`` asks for; an asked one is never changed. The budget
    looks at tokens only, so a large target or drafter can get a micro-batch no rank holds,
    and a micro-batch too large to split the batch over every rank bars the colocated
    layout. So each micro-batch from the budget's down that divides the batch is costed
    once, its layouts arranged as the run would take them (``topology.mode`` and
    ``topology.target_ranks`` as set; under auto, the one :func:`fastest_fitting` takes),
    and the largest whose layout fits a rank's memory is taken, unless a smaller one allows
    a layout predicted faster (a plan without rates, a CPU run's, has none faster). If none
    fits, the budget's is kept, and the refusal (dry run) or warning (run) names the keys
    to change.

    Raises :class:`TopologyError` where the batch allows no layout, and :class:`DoesNotFit`
    where ``topology.mode=auto`` has none that fits; a layout over a rank's memory is
    returned, for the caller to refuse or warn (:func:`check_fits`)."""
    cuda_plan, k = settings.for_cuda(world_size), settings.tensor_parallel
    split = flops_split(plan, models, world_size, k) if world_size > 1 else 0

    def at(micro: int) -> LayoutChoice:
        options = layout_options(role_costs(settings, plan, micro, models, cuda_plan), world_size,
                                 auto_targets(split, world_size, micro, plan, k) if world_size > 1 else 0)
        return LayoutChoice(_of(options, resolve_targets(settings, options)), options)

    budget = plan.micro_batch_size
    if not settings.auto_micro_batch:
        return plan, at(budget)
    outcomes = {micro: _or_refusal(at, micro) for micro in range(budget, 0, -1) if plan.batch_size % micro == 0}
    best: LayoutChoice | None = None
    for outcome in outcomes.values():  # largest first; a smaller one only where strictly faster
        if isinstance(outcome, LayoutChoice) and fits(outcome.taken) and (
                best is None or outcome.taken.samples_per_s > best.taken.samples_per_s):
            best = outcome
    if best is None:
        return plan, at(budget)  # raises, or returns the layout that check_fits refuses
    micro = best.taken.cost.micro_batch_size
    if micro == budget:
        return plan, best
    note = _stepped_down(plan, best.taken, [outcome for m, outcome in outcomes.items() if m > micro])
    return replace(plan, micro_batch_size=micro), replace(best, note=note)


def _of(options: list[Layout], targets: int) -> Layout:
    """The layout of ``options`` with ``targets`` target ranks; a split the batch does not
    allow raises its :class:`TopologyError`."""
    found = [e for e in options if e.num_targets == targets]
    first = options[0]
    return found[0] if found else arrange(first.cost, first.world_size, targets, first.auto_targets)


def _or_refusal(at, micro: int) -> LayoutChoice | TopologyError | DoesNotFit:
    """The layout at ``micro``, else why it has none."""
    try:
        return at(micro)
    except (TopologyError, DoesNotFit) as refusal:
        return refusal


def _stepped_down(plan: Plan, taken: Layout, larger: list[LayoutChoice | Exception]) -> str:
    """Why the token budget's micro-batch (``plan``'s) gave way to that of ``taken``: what
    kept out each of the ``larger`` ones (:func:`_or_refusal`)."""
    reasons = []
    planned = [outcome.taken for outcome in larger if isinstance(outcome, LayoutChoice)]
    device_gib = taken.cost.device_gib
    if any(isinstance(outcome, DoesNotFit) for outcome in larger) or not all(map(fits, planned)):
        reasons.append(f"to fit the {USABLE_SHARE * device_gib:.1f} GiB a rank may plan on ({USABLE_SHARE:.0%} of "
                       f"estimate.device_gib={device_gib:.1f})")
    if any(isinstance(outcome, TopologyError) for outcome in larger):
        reasons.append("to split the batch into whole micro-batches over the ranks")
    slower = [e.samples_per_s for e in planned if fits(e)]
    if slower:
        unit = "rows" if plan.packing else "samples"
        reasons.append(f"to allow a faster layout, {taken.name} ({taken.samples_per_s / taken.world_size:.2f} "
                       f"{unit}/s per GPU predicted, against {max(slower) / taken.world_size:.2f})")
    return (f"stepped down from {plan.micro_batch_size} to {taken.cost.micro_batch_size} "
            f"{' and '.join(reasons)}")


def format_options(options: list[Layout], chosen: int, micro_batch_size: int, packing: bool = False) -> str:
    """The layouts side by side, the fuller rank's memory and the predicted rate per GPU
    (rows with ``packing``); ``chosen`` target ranks is this run's. Below them, a faster
    split that the batch does not divide, with a batch that would."""
    lines = ["  layouts (topology.mode=auto with topology.target_ranks=auto takes the fastest that fits):"]
    unit = "rows" if packing else "samples"
    width = max(26, *(len(e.name) for e in options))
    for e in options:
        verdict = "this run" if e.num_targets == chosen else "fits" if fits(e) else "does not fit"
        lines.append(f"    {e.name:<{width}} {e.rank_gib:6.1f} GiB per rank, {e.samples_per_s / e.world_size:6.2f} "
                     f"{unit}/s per GPU  {verdict}")
    barred = faster_split_barred_by_batch(options)
    if barred:
        targets, rate, micro_batches = barred
        drafters = options[0].world_size - targets
        lines.append(f"    ({targets} target / {drafters} drafter would predict {rate:.2f} {unit}/s per GPU, but the batch "
                     f"of {options[0].cost.micro_per_step} micro-batches does not split\n     over {drafters} drafter "
                     f"ranks: train.batch_size={micro_batches * micro_batch_size} would allow it)")
    return "\n".join(lines)


def _groups(num_targets: int, k: int) -> list[list[int]]:
    return [list(range(first, first + k)) for first in range(0, num_targets, k)]


def _gib(parts: dict[str, float]) -> str:
    return " + ".join(f"{v:.1f} {k}" for k, v in parts.items()) + f" = {sum(parts.values()):.1f} GiB"


def format_layout(settings: LayoutSettings, plan: Plan, choice: LayoutChoice) -> str:
    """What the layout taken costs, rank by rank: the start log's and the dry run's plan."""
    e, c = choice.taken, choice.taken.cost
    lines = [f"cost of {settings.target} on {e.world_size} rank(s), {c.device_gib:.1f} GiB per device:"]
    if e.colocated:
        ranks = "0" if e.world_size == 1 else f"0-{e.world_size - 1}"
        lines.append(f"  rank {ranks:<8} colocated  target and drafter in every process: {_gib(c.colocated_gib)}")
        if e.world_size > 1:
            lines.append(f"  data-parallel: {plan.micro_per_step // e.world_size} micro-batch(es) per rank per step, "
                         "drafter gradients reduced over all ranks; rank 0 writes metrics, checkpoints and the export")
    else:
        drafters = e.world_size - e.num_targets
        span = lambda a, b: f"{a}" if a == b else f"{a}-{b}"  # noqa: E731
        k = c.tensor_parallel
        shards = "" if k == 1 else f", 1/{k} per rank"
        lines += [
            f"  rank {span(0, e.num_targets - 1):<8} target     {c.target_params / 1e9:.2f}B frozen params{shards}: "
            f"{_gib(c.target_gib)}",
            f"  rank {span(e.num_targets, e.world_size - 1):<8} drafter    {c.drafter_params / 1e9:.3f}B trainable params: "
            f"{_gib(c.drafter_gib)}",
            f"  rank {e.num_targets:<8} metrics    writes metrics.jsonl, checkpoints and the export",
            f"  split: {e.num_targets} target / {drafters} drafter ranks (topology.target_ranks=auto would choose "
            f"{e.auto_targets}); {plan.micro_per_step // drafters} micro-batch(es) per drafter per step",
            *([f"  target groups: {e.num_targets // k} of {k} ranks on one node, transformers' tensor-parallel plan "
               f"({', '.join(f'{g[0]}-{g[-1]}' for g in _groups(e.num_targets, k))}); each group prefills "
               "as one target, its first rank sends the bundles"] if k > 1 else []),
            f"  bundle: {c.bundle_bytes / 1e6:.1f} MB per micro-batch of {plan.micro_batch_size}, "
            f"{c.bundle_bytes * c.micro_per_step / 1e9:.2f} GB per optimizer step",
        ]
    how = (f"auto: the most that fit train.micro_batch_tokens={settings.micro_batch_tokens} and divide the batch of "
           f"{plan.batch_size}" if settings.auto_micro_batch else "train.micro_batch_size")
    if choice.note:
        how += f", {choice.note}"
    if plan.packing:
        lines.append(f"  micro-batch: {plan.micro_batch_size} packed row(s) of {plan.max_len} tokens ({how}); "
                     f"{plan.num_anchors} anchors per row, {1000 * plan.num_anchors / plan.max_len:.0f} per 1k tokens")
    else:
        lines.append(f"  micro-batch: {plan.micro_batch_size} sequence(s) of up to {plan.padded_len} tokens ({how})")
    lines.append(
        f"  FLOPs per {'row' if plan.packing else 'sample'}: target prefill {c.target_flops / 1e12:.1f} T, drafter step "
        f"{c.drafter_flops / 1e12:.1f} T (max_len {plan.max_len}, {plan.num_anchors} anchors, block {plan.block_size}"
        f"{'; ' + c.attention_from if c.attention_from else ''})"
    )
    if settings.live_every:
        where = "in process on rank 0" if e.colocated else "on target rank 0"
        lines.append(f"  eval: speculative decoding every {settings.live_every} steps {where}, with a decoding copy of "
                     f"the drafter ({c.target_gib['evaluation drafter']:.1f} GiB, counted in the target's memory)")
    if c.rates_from:
        unit = "rows" if plan.packing else "samples"
        lines.append(
            f"  expected: target {c.target_rate:.2f}, drafter {c.drafter_rate:.2f} {unit}/s per rank, from "
            f"{c.rates_from}: {e.samples_per_s:.2f} {unit}/s, {e.samples_per_s / e.world_size:.2f} per GPU"
            + (f", {e.samples_per_s * plan.max_len / e.world_size:,.0f} tokens/s per GPU" if plan.packing else "")
        )
        if c.tensor_parallel > 1:
            lines.append(f"  (a group of {c.tensor_parallel} counted at {c.tensor_parallel}x one rank's rate: its "
                         "per-layer all-reduces are not counted, so the target side is an upper bound)")
    return "\n".join(lines)
