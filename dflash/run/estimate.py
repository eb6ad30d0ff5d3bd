"""What a plan costs before anything is loaded: FLOPs, bytes, memory per rank, throughput.

``dry_run=true`` prints this and exits; every run logs it at start. Models are
built on the meta device, so nothing is read and no memory is taken. The FLOP
count is the one ``dflash.bench`` reports MFU with (docs/DESIGN.md section 6).
Memory is an estimate from the parts each rank holds (docs/DESIGN.md section 7
lists them); BENCHMARKS.md has measured peaks to compare with.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from dflash.data.bundle import MicroBatch, shapes
from dflash.data.dataset import synthetic_lengths
from dflash.distributed import tensor_parallel
from dflash.distributed.topology import Topology, TopologyError
from dflash.model.drafter import FULL, DrafterConfig
from dflash.model.target import decoder_layers
from dflash.objective.anchors import sample_starts
from dflash.run.build import Job, active_params, auto_split, meta_models, split_by_flops
from dflash.run.plan import Plan

GIB = 2**30
LAYOUT_MODES = ("auto", "colocated", "disaggregated")
H200_GIB = 139.8  # usable memory of one H200 as torch reports it
# The plan counts what a rank allocates; the caching allocator reserved up to 11% more on the
# H200 (the CUDA-graph pool and fragmentation of a 64k drafter step, BENCHMARKS.md), so a rank
# may plan on this share of its device.
USABLE_SHARE = 0.9
# Rates on one H200 at the Qwen3-8B shapes, fitted to the bench's rows from 768 to 32k tokens
# (BENCHMARKS.md, seventh session; each row within 0.1%): each role's matmuls at a share of the
# peak, and its attention, whose kernels run slower, per visible (query, key) pair at a rate of its
# own: SDPA's causal kernel for rows of one sample, flex attention for packed rows, and the
# drafter's flex attention forward and backward. Flex attention on FlashAttention-4's kernels
# (`compile.attention=flash`) has rates of its own, fitted to the same rows run both ways on one
# H200 (BENCHMARKS.md, ninth session). Other shapes follow from their FLOPs at these rates,
# unless a `dflash.bench` report is given.
MATMUL_MFU = {"target": 0.808, "drafter": 0.777}
ATTENTION_FLOPS = {"causal": 537e12, "packed": 312e12, "drafter": 247e12,
                   "packed flash": 412e12, "drafter flash": 419e12}
PEAK_FLOPS = 790e12


class DoesNotFit(ValueError):
    """A plan that cannot run as configured; the message names the key to change."""


def sliding_keys(d: DrafterConfig, context: float) -> float:
    """Keys a block query of a sliding layer sees, on average over the block's slots: the
    positions ``(p - window, p]`` of the query at ``p = anchor + slot``, for an anchor with
    ``context`` positions of its sample before it, and with ``sliding_causal`` false the
    block's later slots within the window too."""
    if d.sliding_window is None:
        return 0.0
    ahead = 0 if d.sliding_causal else sum(min(d.sliding_window - 1, d.block_size - 1 - slot)
                                           for slot in range(d.block_size))
    return (sum(min(d.sliding_window, context + slot + 1) for slot in range(d.block_size)) + ahead) / d.block_size


def drafter_attention_flops(d: DrafterConfig, seq_len: int, num_anchors: int, context: float | None = None) -> float:
    """The attention part of :func:`drafter_flops`, forward and backward: each block query
    over its anchor's ``context`` positions and its block in a full layer, over
    :func:`sliding_keys` in a sliding one."""
    q, tq = d.num_attention_heads * d.head_dim, num_anchors * d.block_size
    full_layers = d.attention_types.count(FULL)
    context = (seq_len - d.block_size) / 2 if context is None else context
    return (12 * q * (context + d.block_size) * tq * full_layers
            + 12 * q * sliding_keys(d, context) * tq * (d.num_layers - full_layers))


def drafter_flops(d: DrafterConfig, seq_len: int, num_anchors: int, vocab_size: int,
                  context: float | None = None) -> float:
    """Training FLOPs of one row, counted as in docs/DESIGN.md section 6, attention over the
    visible keys only. ``context`` is the mean count of an anchor's sample positions before
    it (:func:`anchor_context`); ``None``: ``(S - B)/2``, anchors spread over one sample of
    the row's length."""
    h, kv = d.hidden_size, d.num_key_value_heads * d.head_dim
    q = d.num_attention_heads * d.head_dim
    attention_linear, mlp = h * q * 2 + h * kv * 2, 3 * h * d.intermediate_size
    tq = num_anchors * d.block_size
    return dflash2_flops(d, num_anchors) + drafter_attention_flops(d, seq_len, num_anchors, context) + (
        6 * attention_linear * d.num_layers * tq
        + 6 * mlp * ((d.num_layers - 1) * tq + num_anchors * (d.block_size - 1))
        + 6 * (2 * h * kv) * d.num_layers * seq_len
        + 4 * (len(d.target_layer_ids) * h * h) * seq_len
        + 4 * h * vocab_size * num_anchors * (d.block_size - 1)
    )


def dflash2_flops(d: DrafterConfig, num_anchors: int) -> float:
    """What a DFlash2 drafter adds to one row's training FLOPs (0 for DFlash): the last
    layer's MLP over every block row (its convolution at slot 1 reads slot 0), the
    kernel projections and taps of the two convolutions around each sublayer, and the
    selector: the gradient of the k logits it keeps and the low-rank scoring. Its
    candidates cost no FLOPs of their own: they are the top-k of the logits the loss's
    pass over the LM head computes anyway."""
    v2 = d.dflash2
    if v2 is None:
        return 0.0
    h, tq, td = d.hidden_size, num_anchors * d.block_size, num_anchors * (d.block_size - 1)
    k, r, taps = v2.selector_top_k, v2.selector_rank, v2.conv_kernel_size
    return (
        6 * 3 * h * d.intermediate_size * num_anchors
        + 6 * 2 * h * (2 * taps * h // v2.conv_group_size) * d.num_layers * tq
        + 24 * taps * h * d.num_layers * tq
        + 4 * k * h * td
        + 6 * h * r * td + 12 * k * r * td
    )


def _prefill_layers(model: torch.nn.Module, with_head: bool, layer_ids: list[int]) -> int:
    """How many decoder layers a prefill runs: all with the LM head, else up to the last
    captured one (``Target.prefill``)."""
    return len(decoder_layers(model)) if with_head else max(layer_ids) + 1


def prefill_attention_flops(model: torch.nn.Module, seq_len: int, with_head: bool, layer_ids: list[int],
                            keys_per_token: float | None = None) -> float:
    """The attention part of :func:`prefill_flops`: causal attention over ``keys_per_token``
    keys on average (:func:`keys_per_token`; ``None``: ``(S + 1)/2``, one sample filling the
    row) in every layer that runs."""
    text = model.config.get_text_config()
    q = text.num_attention_heads * (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    keys = (seq_len + 1) / 2 if keys_per_token is None else keys_per_token
    return _prefill_layers(model, with_head, layer_ids) * 4 * q * seq_len * keys


def prefill_flops(model: torch.nn.Module, seq_len: int, with_head: bool, layer_ids: list[int],
                  keys_per_token: float | None = None) -> float:
    """Inference FLOPs of one row over the decoder layers that run: 2 x params x tokens
    plus the attention (:func:`prefill_attention_flops`). Without the LM head the prefill
    stops after the last captured layer (``Target.prefill``); with it, every layer and the
    head run."""
    text = model.config.get_text_config()
    params = sum(active_params(layer, text)
                 for layer in decoder_layers(model)[:_prefill_layers(model, with_head, layer_ids)])
    if with_head:
        params += model.get_output_embeddings().weight.numel()
    return 2 * params * seq_len + prefill_attention_flops(model, seq_len, with_head, layer_ids, keys_per_token)


def anchor_context(batch: MicroBatch) -> float:
    """The mean count of positions of its own sample before each kept anchor of ``batch``
    (an unkept slot sees only its block): what the drafter's attention reads."""
    before = batch.anchors - sample_starts(batch.anchors, batch.position_ids)
    return float((before * batch.keep).float().mean())


def keys_per_token(batch: MicroBatch) -> float:
    """The mean count of keys a prefill token attends to under the packed causal mask."""
    return float((batch.position_ids + 1).float().mean())


def packed_attention(job: Job) -> tuple[float | None, float | None, str]:
    """The anchor context and prefill keys per token of a packed plan, and where they come
    from. Packed rows attend within each sample, so both follow the sample lengths: those
    of ``data=synthetic`` with ``data.mean_length`` are drawn here; for other data the
    plan takes one sample per row, an upper bound."""
    data = job.cfg.data
    if not job.plan.packing:
        return None, None, ""
    if data.path != "synthetic" or not data.get("mean_length"):
        return None, None, "attention counted as one sample per row (an upper bound for packed rows)"
    lengths = synthetic_lengths(4096, job.plan.max_len, data.mean_length, np.random.default_rng(0)).astype(np.float64)
    before = float((lengths * (lengths - 1) / 2).sum() / lengths.sum())  # an anchor's mean position in its sample
    return before, before + 1, f"attention over samples of {data.mean_length} tokens on average (data.mean_length)"


@dataclass
class Estimate:
    world_size: int
    num_targets: int
    auto_targets: int
    target_params: int
    drafter_params: int
    head_params: int
    bundle_bytes: int
    micro_per_step: int
    target_gib: dict[str, float]
    drafter_gib: dict[str, float]
    device_gib: float
    target_flops: float  # per sample
    drafter_flops: float  # per sample
    target_rate: float  # samples/s of one target rank (a group of k: k times this)
    drafter_rate: float  # samples/s of one drafter rank
    rates_from: str
    tensor_parallel: int = 1  # target ranks per target replica
    attention_from: str = ""  # where a packed plan's attention lengths come from

    @property
    def colocated(self) -> bool:
        """Target and drafter in every process (one process, or colocated data-parallel)."""
        return self.num_targets == 0

    @property
    def colocated_gib(self) -> dict[str, float]:
        """A colocated rank's parts: both models' state, and the larger of the two working
        sets, since the prefill's is freed before the drafter step begins (the features it
        hands over are counted with the drafter's)."""
        target = {f"target {k}": v for k, v in self.target_gib.items() if k not in ("activations", "bundles in flight")}
        drafter = {f"drafter {k}": v for k, v in self.drafter_gib.items() if k != "activations"}
        working = max(self.target_gib.get("activations", 0.0), self.drafter_gib.get("activations", 0.0))
        return {**target, **drafter, "activations (the larger of the prefill's and the drafter step's)": working}

    @property
    def samples_per_s(self) -> float:
        if self.colocated:
            return self.world_size / (1 / self.target_rate + 1 / self.drafter_rate)
        drafters = self.world_size - self.num_targets
        return min(self.num_targets * self.target_rate, drafters * self.drafter_rate)


def _bundle_bytes(plan: Plan, feature_dtype: torch.dtype) -> int:
    """Payload bytes of the largest bundle of ``plan``."""
    sizes = {"b": plan.micro_batch_size, "S": plan.padded_len, "n": plan.num_anchors, "F": plan.feature_dim,
             "k": plan.topk}
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes(sizes, feature_dtype))


def bench_rates(report: dict) -> dict:
    """Samples/s of one target rank and one drafter rank in a ``dflash.bench`` report: its
    last target row (compiled when the drafter is) and its last drafter row."""
    micro = report["shapes"]["micro_batch_size"]
    target = [r for r in report["rows"] if r["role"] == "target"][-1]
    drafter = [r for r in report["rows"] if r["role"] == "drafter"][-1]
    return {"target_samples_per_s": 1e3 * micro / target["step_ms"], "drafter_samples_per_s": drafter["samples_per_s"],
            "target_mode": target["mode"], "drafter_mode": drafter["mode"]}


def plans_for_cuda(job: Job, world_size: int) -> bool:
    """Whether the plan is for GPUs (bf16 weights, H200 rates) or the CPU (float32, no rate):
    ``estimate.device`` when set, so that a 1-GPU run can be planned from a machine without
    one; else the run this command would start here, on GPUs where there is one or where
    the plan spans several ranks."""
    device = job.cfg.estimate.device
    if device is None:
        return torch.cuda.is_available() or world_size > 1
    if device not in ("cuda", "cpu"):
        raise ValueError(f"estimate.device={device!r}: choose cuda, cpu or null (this machine's)")
    return device == "cuda"


def _device_gib(job: Job) -> float:
    configured = job.cfg.estimate.device_gib
    if configured:
        return float(configured)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GIB
    return H200_GIB


def seconds_per_row(flops: float, attention_flops: float, role: str, attention: str) -> float:
    """A row's time on one H200 at the measured rates: its matmuls at ``role``'s share of the
    peak (:data:`MATMUL_MFU`) and its ``attention_flops`` at ``attention``'s rate
    (:data:`ATTENTION_FLOPS`)."""
    return (flops - attention_flops) / (MATMUL_MFU[role] * PEAK_FLOPS) + attention_flops / ATTENTION_FLOPS[attention]


def _rates(job: Job, target: tuple[float, float], drafter: tuple[float, float], cuda_plan: bool
           ) -> tuple[float, float, str]:
    """Samples/s of one target rank and one drafter rank, from each role's FLOPs and their
    attention part per sample."""
    path = job.cfg.estimate.rates
    if path:
        rates = bench_rates(json.loads(Path(path).read_text()))
        return rates["target_samples_per_s"], rates["drafter_samples_per_s"], f"measured in {path}"
    if not cuda_plan:
        return math.nan, math.nan, ""
    flash = " flash" if job.compile.attention == "flash" else ""
    prefill = "packed" + flash if job.plan.packing else "causal"
    target_rate = 1 / seconds_per_row(*target, "target", prefill)
    drafter_rate = 1 / seconds_per_row(*drafter, "drafter", "drafter" + flash)
    rates = (f"matmuls at {MATMUL_MFU['target']:.1%} of peak in the prefill, {MATMUL_MFU['drafter']:.1%} in the "
             f"drafter step; attention at {ATTENTION_FLOPS[prefill] / 1e12:.0f} and "
             f"{ATTENTION_FLOPS['drafter' + flash] / 1e12:.0f} TFLOP/s{' on FlashAttention-4' if flash else ''}")
    return target_rate, drafter_rate, f"the rates measured on one H200 ({rates}) at these FLOPs"


def estimate(job: Job, world_size: int, targets: int | str, models: tuple | None = None) -> Estimate:
    """The cost of ``job`` on ``world_size`` ranks with ``targets`` target ranks (``auto``
    as the trainer would choose; 0 colocated, in one process or data-parallel). ``models``
    are :func:`meta_models` already built. Raises :class:`TopologyError` for an impossible
    split."""
    plan, text = job.plan, job.target_config.get_text_config()
    cuda_plan = plans_for_cuda(job, world_size)
    dtype = torch.bfloat16 if cuda_plan else torch.float32
    dtype_bytes = dtype.itemsize
    target, drafter = models or meta_models(job)
    drafter_cfg = drafter.config
    embed, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    target_params = sum(p.numel() for p in target.parameters())
    head_params = embed.numel() + (0 if lm_head is embed else lm_head.numel())
    drafter_params = sum(p.numel() for p in drafter.parameters())
    seq_len = plan.padded_len
    context, keys, attention_from = packed_attention(job)
    t_flops = prefill_flops(target, seq_len, bool(plan.topk), list(plan.layer_ids), keys)
    t_attention = prefill_attention_flops(target, seq_len, bool(plan.topk), list(plan.layer_ids), keys)
    d_flops = drafter_flops(drafter_cfg, seq_len, plan.num_anchors, text.vocab_size, context)
    d_attention = drafter_attention_flops(drafter_cfg, seq_len, plan.num_anchors, context)
    k = job.tensor_parallel
    if k > 1 and world_size == 1:
        raise TopologyError(f"target.tensor_parallel={k} needs at least {k + 1} ranks (estimate.nproc, or torchrun)")
    auto = split_by_flops(job, world_size, target, drafter) if world_size > 1 else 0
    num_targets = auto if targets == "auto" else int(targets)
    if world_size > 1:
        # raise with the key to change
        topo = Topology(world_size, 0, num_targets, plan.micro_batch_size, plan.batch_size, k)
        tensor_parallel.check_placement(topo.target_groups, tensor_parallel.ranks_per_node(world_size))
    bundle = _bundle_bytes(plan, dtype)
    micro, h = plan.micro_batch_size, text.hidden_size
    tokens = micro * seq_len
    in_flight = job.cfg.topology.max_in_flight if num_targets else 0
    target_gib = {
        # a tensor-parallel rank holds 1/k of every weight (norms and routers, a few MB, whole)
        "weights": target_params * dtype_bytes / k / GIB,
        # one decoder layer's working set at a time (its sharded MLP width 1/k), the captured
        # features, and the logits for the KL (gathered whole on every rank of a group)
        "activations": tokens * (6 * h + 3 * text.intermediate_size / k) * dtype_bytes / GIB
        + tokens * plan.feature_dim * dtype_bytes / GIB
        + (tokens * text.vocab_size * dtype_bytes / GIB if plan.topk else 0.0),
        "bundles in flight": in_flight * bundle / GIB,
    }
    if job.settings.live:
        # the decoding copy of the drafter that evaluations while training run (rank 0; all, to be safe)
        target_gib["evaluation drafter"] = drafter_params * dtype_bytes / GIB
    queries = micro * plan.num_anchors * plan.block_size
    # Under CUDA graphs the step's graph copies the context features into its own input
    # buffer (they arrive at a new address every micro-batch), beside the bundle's copy.
    feature_copies = 2 if cuda_plan and job.cfg.compile.mode == "reduce-overhead" else 1
    kv = drafter_cfg.num_key_value_heads * drafter_cfg.head_dim
    drafter_gib = {
        # fp32 master weights and gradient buffers; under autocast also the bf16 compute weights
        # (dflash.step.compute_copy). The linear layers' backward adds into the buffers: no
        # gradient of one backward is held beside them (dflash.model.linear).
        "weights and gradients": (4 + 4 + (dtype_bytes if cuda_plan else 0)) * drafter_params / GIB,
        "AdamW state": 8 * drafter_params / GIB,
        "frozen embedding and LM head": head_params * dtype_bytes / GIB,
        # Saved for the backward, as measured on the H200 at Qwen3-8B shapes (BENCHMARKS.md,
        # "The drafter's memory at long context"): per query token and layer 9h + 3i values
        # (projections, q/k norms and rotations, attention output, the MLP's three inputs);
        # per context token the features (twice under CUDA graphs), 3h for the projected
        # context and its norms, and each layer's K/V. Then one loss chunk's logits and their
        # gradient, counted as fp32 (compiled they are bf16; eager keeps fp32 copies).
        "activations": queries * drafter_cfg.num_layers * (9 * h + 3 * drafter_cfg.intermediate_size) * dtype_bytes / GIB
        + seq_len * micro * (feature_copies * plan.feature_dim + 3 * h + 2 * kv * drafter_cfg.num_layers)
        * dtype_bytes / GIB
        + 2 * min(plan.chunk_size, queries) * text.vocab_size * 4 / GIB,
    }
    target_rate, drafter_rate, rates_from = _rates(job, (t_flops, t_attention), (d_flops, d_attention), cuda_plan)
    return Estimate(
        world_size, num_targets, auto, target_params, drafter_params, head_params, bundle, plan.micro_per_step,
        target_gib, drafter_gib, _device_gib(job), t_flops, d_flops, target_rate, drafter_rate, rates_from, k,
        attention_from,
    )


def fits(e: Estimate) -> bool:
    try:
        check_fits(e)
    except DoesNotFit:
        return False
    return True


def layout_options(job: Job, world_size: int, models: tuple | None = None) -> list[Estimate]:
    """Colocated (data-parallel) and every split of ``world_size`` ranks that the batch
    allows, estimated on one pair of meta-device models (``models``, if already built);
    raises the colocated layout's :class:`TopologyError` if the batch allows none."""
    models = models or meta_models(job)
    options = []
    k = job.tensor_parallel
    splits = range(world_size) if k == 1 else range(k, world_size, k)  # a sharded target has no colocated layout
    for targets in splits:
        try:
            options.append(estimate(job, world_size, targets, models))
        except TopologyError:
            continue
    return options or [estimate(job, world_size, 0, models)]


def fastest_fitting(options: list[Estimate]) -> Estimate:
    """The layout with the most predicted samples/s among those that fit; colocated on a tie."""
    fastest = sorted(options, key=lambda e: (e.samples_per_s, e.colocated), reverse=True)
    fitting = [e for e in fastest if fits(e)]
    if not fitting:  # raises, for the layout that comes nearest to fitting: its keys are the ones to change
        check_fits(min(options, key=rank_gib))
    return fitting[0]


def rank_gib(e: Estimate) -> float:
    """The estimated memory of the fuller rank of a layout."""
    if e.colocated:
        return sum(e.colocated_gib.values())
    return max(sum(e.drafter_gib.values()), sum(e.target_gib.values()))


def of_layout(job: Job, options: list[Estimate], targets: int) -> Estimate:
    """The estimate of the layout with ``targets`` target ranks; a split the batch does not
    allow raises its :class:`TopologyError`, with the key to change."""
    found = [e for e in options if e.num_targets == targets]
    return found[0] if found else estimate(job, options[0].world_size, targets)


def format_options(options: list[Estimate], chosen: int, micro_batch_size: int, packing: bool = False) -> str:
    """The layouts side by side, the fuller rank's memory and the predicted rate per GPU
    (rows with ``packing``); ``chosen`` target ranks is this run's. Below them, a faster
    split that the batch does not divide, with a batch that would."""
    lines = ["  layouts (topology.mode=auto with topology.target_ranks=auto takes the fastest that fits):"]
    unit = "rows" if packing else "samples"
    names = [layout_name(e) for e in options]
    width = max(26, *map(len, names))
    for e, name in zip(options, names):
        verdict = "this run" if e.num_targets == chosen else "fits" if fits(e) else "does not fit"
        lines.append(f"    {name:<{width}} {rank_gib(e):6.1f} GiB per rank, {e.samples_per_s / e.world_size:6.2f} {unit}/s "
                     f"per GPU  {verdict}")
    barred = faster_split_barred_by_batch(options)
    if barred:
        targets, rate, micro_batches = barred
        drafters = options[0].world_size - targets
        lines.append(f"    ({targets} target / {drafters} drafter would predict {rate:.2f} {unit}/s per GPU, but the batch "
                     f"of {options[0].micro_per_step} micro-batches does not split\n     over {drafters} drafter ranks: "
                     f"train.batch_size={micro_batches * micro_batch_size} would allow it)")
    return "\n".join(lines)


def faster_split_barred_by_batch(options: list[Estimate]) -> tuple[int, float, int] | None:
    """The split the batch does not divide that predicts more than every split offered:
    (target ranks, samples/s per GPU, the fewest micro-batches per step that it divides),
    or None. Ranks hold the same whichever the split, so it fits where the others do; a
    tensor-parallel target is left out (its splits also depend on the group size)."""
    first = options[0]
    world = first.world_size
    if world < 2 or first.tensor_parallel > 1:
        return None
    offered = {e.num_targets for e in options}
    best = max((e.samples_per_s for e in options if not e.colocated), default=0.0)
    rate, targets = max(((min(t * first.target_rate, (world - t) * first.drafter_rate), t)
                         for t in range(1, world) if t not in offered), default=(0.0, 0))
    if rate <= best:
        return None
    drafters = world - targets
    return targets, rate / world, -(-first.micro_per_step // drafters) * drafters


def layout_name(e: Estimate) -> str:
    if e.colocated:
        return "colocated data-parallel"
    name = f"{e.num_targets} target / {e.world_size - e.num_targets} drafter"
    return name + (f" ({e.num_targets // e.tensor_parallel} x TP{e.tensor_parallel})" if e.tensor_parallel > 1 else "")


def resolve_targets(job: Job, options: list[Estimate]) -> int:
    """Target ranks for the world size of ``options`` (:func:`layout_options`); 0 is
    colocated (one process, or data-parallel). ``topology.mode=auto`` with
    ``target_ranks=auto`` takes the layout the estimate predicts fastest among those that
    fit."""
    topology, world_size = job.cfg.topology, options[0].world_size
    if topology.mode not in LAYOUT_MODES:
        raise TopologyError(f"topology.mode={topology.mode} is not one of {', '.join(LAYOUT_MODES)}")
    if topology.mode == "colocated" and topology.target_ranks not in ("auto", 0):
        raise TopologyError(f"topology.target_ranks={topology.target_ranks} splits the ranks into targets and "
                            "drafters, and topology.mode=colocated runs both on every rank: drop one of the two")
    if world_size == 1 or topology.mode == "colocated":
        return 0
    if topology.target_ranks != "auto":
        return int(topology.target_ranks)
    if topology.mode == "disaggregated":
        return auto_split(job, world_size)
    return fastest_fitting(options).num_targets


@dataclass(frozen=True)
class Layout:
    """What a run plans before it starts: its job (the micro-batch fitted), the layouts
    open to it (:func:`layout_options`) and the estimate of the one it takes."""

    job: Job
    options: list[Estimate]
    cost: Estimate

    @property
    def targets(self) -> int:
        """Target ranks of the layout taken; 0 colocated."""
        return self.cost.num_targets


def choose_layout(job: Job, world_size: int) -> Layout:
    """The micro-batch and the layout a run on ``world_size`` ranks takes, each planned once.

    ``train.micro_batch_size=auto`` is stepped down where the token budget's choice does not
    suit the ranks. The token budget (:func:`~dflash.run.plan.auto_micro_batch`) looks at
    tokens only, so a large target or drafter can get a micro-batch no rank holds, and a
    micro-batch too large to split the batch over every rank bars the colocated layout. So
    each micro-batch from the budget's choice down that divides the batch is planned as the
    run would plan it (``topology.mode`` and ``topology.target_ranks`` as set; under auto,
    the layout :func:`fastest_fitting` takes), and the largest whose layout fits a rank's
    memory is taken, unless a smaller one allows a layout predicted faster (a plan without
    rates, a CPU run's, has none faster). If none fits, the budget's choice is kept, and the
    refusal (dry run) or warning (run) names the keys to change. An explicit
    ``train.micro_batch_size`` is never changed. The choice depends on the config and the
    device size only, so every rank makes the same one.

    Raises :class:`TopologyError` where the batch allows no layout, and :class:`DoesNotFit`
    where ``topology.mode=auto`` has none that fits; a layout over a rank's memory is
    returned, for the caller to refuse or warn (:func:`check_fits`)."""
    models = meta_models(job)  # the models do not depend on the micro-batch
    if job.cfg.train.micro_batch_size != "auto":
        return _layout(job, world_size, models)
    budget = job.plan.micro_batch_size
    outcomes = {micro: _layout_or_refusal(replace(job, plan=replace(job.plan, micro_batch_size=micro)), world_size,
                                          models)
                for micro in range(budget, 0, -1) if job.plan.batch_size % micro == 0}
    best: Layout | None = None
    for outcome in outcomes.values():  # largest first; a smaller one only where strictly faster
        if isinstance(outcome, Layout) and fits(outcome.cost) and (
                best is None or outcome.cost.samples_per_s > best.cost.samples_per_s):
            best = outcome
    if best is None:
        return _layout(job, world_size, models)  # raises, or returns the layout that check_fits refuses
    micro = best.job.plan.micro_batch_size
    if micro == budget:
        return best
    note = _stepped_down(job.plan, micro, best.cost, [outcome for m, outcome in outcomes.items() if m > micro])
    return replace(best, job=replace(best.job, micro_batch_note=note))


def _layout(job: Job, world_size: int, models: tuple) -> Layout:
    options = layout_options(job, world_size, models)
    return Layout(job, options, of_layout(job, options, resolve_targets(job, options)))


def _layout_or_refusal(job: Job, world_size: int, models: tuple) -> Layout | TopologyError | DoesNotFit:
    """The layout ``job`` runs in, else why it has none."""
    try:
        return _layout(job, world_size, models)
    except (TopologyError, DoesNotFit) as refusal:
        return refusal


def _stepped_down(plan: Plan, micro: int, cost: Estimate, larger: list[Layout | Exception]) -> str:
    """Why the token budget's micro-batch (``plan``'s) gave way to ``micro``, whose layout
    is ``cost``: what kept out each of the ``larger`` ones (:func:`_layout_or_refusal`)."""
    reasons = []
    planned = [outcome.cost for outcome in larger if isinstance(outcome, Layout)]
    if any(isinstance(outcome, DoesNotFit) for outcome in larger) or not all(map(fits, planned)):
        reasons.append(f"to fit the {USABLE_SHARE * cost.device_gib:.1f} GiB a rank may plan on ({USABLE_SHARE:.0%} of "
                       f"estimate.device_gib={cost.device_gib:.1f})")
    if any(isinstance(outcome, TopologyError) for outcome in larger):
        reasons.append("to split the batch into whole micro-batches over the ranks")
    slower = [e.samples_per_s for e in planned if fits(e)]
    if slower:
        unit = "rows" if plan.packing else "samples"
        reasons.append(f"to allow a faster layout, {layout_name(cost)} ({cost.samples_per_s / cost.world_size:.2f} "
                       f"{unit}/s per GPU predicted, against {max(slower) / cost.world_size:.2f})")
    return f"stepped down from {plan.micro_batch_size} to {micro} {' and '.join(reasons)}"


# What lowers each kind of rank's memory, for the message that refuses a plan
MEMORY_KEYS = {
    "drafter": "lower train.num_anchors, train.micro_batch_size or loss.chunk_size",
    "target": "shard the target over more ranks (target.tensor_parallel) or lower train.micro_batch_size",
    "colocated": "lower train.num_anchors, train.micro_batch_size or loss.chunk_size, or give each model ranks of "
                 "its own (topology.mode=disaggregated, two or more GPUs)",
}


def check_fits(e: Estimate) -> None:
    """Raise :class:`DoesNotFit` if a rank's estimate exceeds its device's :data:`USABLE_SHARE`."""
    sides = [("drafter", e.drafter_gib), ("target", e.target_gib)]
    if e.colocated:
        sides = [("colocated", e.colocated_gib)]
    usable = USABLE_SHARE * e.device_gib
    for role, parts in sides:
        total = sum(parts.values())
        if total > usable:
            raise DoesNotFit(
                f"a {role} rank needs an estimated {total:.1f} GiB, over the {usable:.1f} GiB it may plan on "
                f"({USABLE_SHARE:.0%} of its device's {e.device_gib:.1f} GiB, the rest left to the allocator); "
                f"{MEMORY_KEYS[role]}; estimate.device_gib sets the device size"
            )


def _groups(num_targets: int, k: int) -> list[list[int]]:
    return [list(range(first, first + k)) for first in range(0, num_targets, k)]


def _gib(parts: dict[str, float]) -> str:
    return " + ".join(f"{v:.1f} {k}" for k, v in parts.items()) + f" = {sum(parts.values()):.1f} GiB"


def format_estimate(job: Job, e: Estimate) -> str:
    plan = job.plan
    lines = [f"plan for {job.cfg.target.name} ({job.source.path}) on {e.world_size} rank(s), "
             f"{e.device_gib:.1f} GiB per device:"]
    if e.colocated:
        ranks = "0" if e.world_size == 1 else f"0-{e.world_size - 1}"
        lines.append(f"  rank {ranks:<8} colocated  target and drafter in every process: {_gib(e.colocated_gib)}")
        if e.world_size > 1:
            lines.append(f"  data-parallel: {plan.micro_per_step // e.world_size} micro-batch(es) per rank per step, "
                         "drafter gradients reduced over all ranks; rank 0 writes metrics, checkpoints and the export")
    else:
        drafters = e.world_size - e.num_targets
        span = lambda a, b: f"{a}" if a == b else f"{a}-{b}"  # noqa: E731
        k = e.tensor_parallel
        shards = "" if k == 1 else f", 1/{k} per rank"
        lines += [
            f"  rank {span(0, e.num_targets - 1):<8} target     {e.target_params / 1e9:.2f}B frozen params{shards}: "
            f"{_gib(e.target_gib)}",
            f"  rank {span(e.num_targets, e.world_size - 1):<8} drafter    {e.drafter_params / 1e9:.3f}B trainable params: "
            f"{_gib(e.drafter_gib)}",
            f"  rank {e.num_targets:<8} metrics    writes metrics.jsonl, checkpoints and the export",
            f"  split: {e.num_targets} target / {drafters} drafter ranks (topology.target_ranks=auto would choose "
            f"{e.auto_targets}); {plan.micro_per_step // drafters} micro-batch(es) per drafter per step",
            *([f"  target groups: {e.num_targets // k} of {k} ranks on one node, transformers' tensor-parallel plan "
               f"({', '.join(f'{g[0]}-{g[-1]}' for g in _groups(e.num_targets, k))}); each group prefills "
               "as one target, its first rank sends the bundles"] if k > 1 else []),
            f"  bundle: {e.bundle_bytes / 1e6:.1f} MB per micro-batch of {plan.micro_batch_size}, "
            f"{e.bundle_bytes * e.micro_per_step / 1e9:.2f} GB per optimizer step",
        ]
    train = job.cfg.train
    how = (f"auto: the most that fit train.micro_batch_tokens={train.micro_batch_tokens} and divide the batch of "
           f"{plan.batch_size}" if train.micro_batch_size == "auto" else "train.micro_batch_size")
    if job.micro_batch_note:
        how += f", {job.micro_batch_note}"
    if plan.packing:
        lines.append(f"  micro-batch: {plan.micro_batch_size} packed row(s) of {plan.max_len} tokens ({how}); "
                     f"{plan.num_anchors} anchors per row, {1000 * plan.num_anchors / plan.max_len:.0f} per 1k tokens")
    else:
        lines.append(f"  micro-batch: {plan.micro_batch_size} sequence(s) of up to {plan.padded_len} tokens ({how})")
    lines.append(
        f"  FLOPs per {'row' if plan.packing else 'sample'}: target prefill {e.target_flops / 1e12:.1f} T, drafter step "
        f"{e.drafter_flops / 1e12:.1f} T (max_len {plan.max_len}, {plan.num_anchors} anchors, block {plan.block_size}"
        f"{'; ' + e.attention_from if e.attention_from else ''})"
    )
    if job.settings.live:
        every = job.settings.live.every
        where = "in process on rank 0" if e.colocated else "on target rank 0"
        lines.append(f"  eval: speculative decoding every {every} steps {where}, with a decoding copy of the "
                     f"drafter ({e.target_gib['evaluation drafter']:.1f} GiB, counted in the target's memory)")
    if e.rates_from:
        unit = "rows" if plan.packing else "samples"
        lines.append(
            f"  expected: target {e.target_rate:.2f}, drafter {e.drafter_rate:.2f} {unit}/s per rank, from "
            f"{e.rates_from}: {e.samples_per_s:.2f} {unit}/s, {e.samples_per_s / e.world_size:.2f} per GPU"
            + (f", {e.samples_per_s * plan.max_len / e.world_size:,.0f} tokens/s per GPU" if plan.packing else "")
        )
        if e.tensor_parallel > 1:
            lines.append(f"  (a group of {e.tensor_parallel} counted at {e.tensor_parallel}x one rank's rate: its "
                         "per-layer all-reduces are not counted, so the target side is an upper bound)")
    return "\n".join(lines)
