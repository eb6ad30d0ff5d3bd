"""What a micro-batch costs each role before anything is loaded: FLOPs, bytes, memory, rates.

The cost model of :mod:`dflash.run.layout`, which arranges the ranks from these costs;
a role's cost does not depend on how the ranks are split, so it is counted once per
micro-batch size. Models are built on the meta device, so nothing is read and no
memory is taken. The FLOP count is the one ``dflash.bench`` reports MFU with
(docs/DESIGN.md section 6). Memory is an estimate from the parts each rank holds
(docs/DESIGN.md section 7 lists them); BENCHMARKS.md has measured peaks to compare with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PretrainedConfig

from dflash.data.bundle import MicroBatch, shapes
from dflash.data.dataset import synthetic_lengths
from dflash.model.drafter import FULL, DFlashDrafter, DrafterConfig
from dflash.model.fp8 import fp8_shaped
from dflash.model.target import decoder_layers
from dflash.objective.anchors import sample_starts
from dflash.run.plan import Plan
from dflash.run.settings import GIB, LayoutSettings

# Rates on one H200 at the Qwen3-8B shapes, fitted to the bench's rows from 768 to 32k tokens
# (docs/benchmarks/2026-12-02-h200-long-context-memory-rates.md; each row within 0.1%): each
# role's matmuls at a share of the peak, and its attention, whose kernels run slower, per visible
# (query, key) pair at a rate of its own: SDPA's causal kernel for rows of one sample, flex
# attention for packed rows, and the drafter's flex attention forward and backward. Flex attention
# on FlashAttention-4's kernels (`compile.attention=flash`) has rates of its own, fitted to the
# same rows run both ways on one H200 (docs/benchmarks/2026-12-03-h200-flash-attention-4.md).
# Other shapes follow from their FLOPs at these rates, unless a `dflash.bench` report is given.
MATMUL_MFU = {"target": 0.808, "drafter": 0.777}
ATTENTION_FLOPS = {"causal": 537e12, "packed": 312e12, "drafter": 247e12,
                   "packed flash": 412e12, "drafter flash": 419e12}
PEAK_FLOPS = 790e12


def active_params(module: torch.nn.Module, text: PretrainedConfig) -> float:
    """The parameters of ``module`` (a target or one of its layers) that one token runs
    through: of the routed experts (the ``experts`` modules' weights) only
    ``num_experts_per_tok`` of every expert count; the router, a shared expert and
    everything else count whole (tied weights once)."""
    experts = next((getattr(text, key) for key in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(text, key, None)), None)
    share = getattr(text, "num_experts_per_tok", 0) / experts if experts else 1.0
    return sum(p.numel() * (share if ".experts." in f".{name}" else 1.0) for name, p in module.named_parameters())


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


def fp8_linear_params(modules: list[torch.nn.Module]) -> int:
    """The weights of the linear layers in ``modules`` that FP8 matmuls take
    (:func:`dflash.model.fp8.fp8_shaped`)."""
    return sum(m.weight.numel() for module in modules for m in module.modules()
               if isinstance(m, torch.nn.Linear) and fp8_shaped(m))


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


def packed_attention(settings: LayoutSettings, plan: Plan) -> tuple[float | None, float | None, str]:
    """The anchor context and prefill keys per token of a packed plan, and where they come
    from. Packed rows attend within each sample, so both follow the sample lengths: those
    of ``data=synthetic`` with ``data.mean_length`` are drawn here; for other data the
    plan takes one sample per row, an upper bound."""
    if not plan.packing:
        return None, None, ""
    if settings.mean_length is None:
        return None, None, "attention counted as one sample per row (an upper bound for packed rows)"
    lengths = synthetic_lengths(4096, plan.max_len, settings.mean_length, np.random.default_rng(0)).astype(np.float64)
    before = float((lengths * (lengths - 1) / 2).sum() / lengths.sum())  # an anchor's mean position in its sample
    return before, before + 1, f"attention over samples of {settings.mean_length} tokens on average (data.mean_length)"


@dataclass(frozen=True)
class Cost:
    """What one micro-batch size costs each role, whichever way the ranks are split: the
    parameters, the FLOPs and rate of a sample, and the memory of a rank of each kind."""

    batch_size: int  # rows per optimizer step
    micro_batch_size: int
    target_params: int
    drafter_params: int
    head_params: int  # the frozen embedding and LM head a drafter rank holds
    bundle_bytes: int  # the largest bundle a target rank sends
    target_gib: dict[str, float]  # a target rank's parts, its bundles in flight counted
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
    def micro_per_step(self) -> int:
        """Micro-batches per optimizer step, over all drafter ranks."""
        return self.batch_size // self.micro_batch_size

    @property
    def colocated_gib(self) -> dict[str, float]:
        """A colocated rank's parts: both models' state, and the larger of the two working
        sets, since the prefill's is freed before the drafter step begins (the features it
        hands over are counted with the drafter's)."""
        target = {f"target {k}": v for k, v in self.target_gib.items() if k not in ("activations", "bundles in flight")}
        drafter = {f"drafter {k}": v for k, v in self.drafter_gib.items() if k != "activations"}
        working = max(self.target_gib.get("activations", 0.0), self.drafter_gib.get("activations", 0.0))
        return {**target, **drafter, "activations (the larger of the prefill's and the drafter step's)": working}


def bundle_bytes(plan: Plan, micro_batch_size: int, feature_dtype: torch.dtype) -> int:
    """Payload bytes of the largest bundle of ``plan`` at this micro-batch size."""
    sizes = {"b": micro_batch_size, "S": plan.padded_len, "n": plan.num_anchors, "F": plan.feature_dim,
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


def seconds_per_row(flops: float, attention_flops: float, role: str, attention: str) -> float:
    """A row's time on one H200 at the measured rates: its matmuls at ``role``'s share of the
    peak (:data:`MATMUL_MFU`) and its ``attention_flops`` at ``attention``'s rate
    (:data:`ATTENTION_FLOPS`)."""
    return (flops - attention_flops) / (MATMUL_MFU[role] * PEAK_FLOPS) + attention_flops / ATTENTION_FLOPS[attention]


def _rates(settings: LayoutSettings, plan: Plan, target: tuple[float, float], drafter: tuple[float, float],
           cuda_plan: bool) -> tuple[float, float, str]:
    """Samples/s of one target rank and one drafter rank, from each role's FLOPs and their
    attention part per sample."""
    if settings.rates_report is not None:
        rates = bench_rates(settings.rates_report)
        return rates["target_samples_per_s"], rates["drafter_samples_per_s"], f"measured in {settings.rates_path}"
    if not cuda_plan:
        return math.nan, math.nan, ""
    flash = " flash" if settings.flash else ""
    prefill = "packed" + flash if plan.packing else "causal"
    target_rate = 1 / seconds_per_row(*target, "target", prefill)
    drafter_rate = 1 / seconds_per_row(*drafter, "drafter", "drafter" + flash)
    rates = (f"matmuls at {MATMUL_MFU['target']:.1%} of peak in the prefill, {MATMUL_MFU['drafter']:.1%} in the "
             f"drafter step; attention at {ATTENTION_FLOPS[prefill] / 1e12:.0f} and "
             f"{ATTENTION_FLOPS['drafter' + flash] / 1e12:.0f} TFLOP/s{' on FlashAttention-4' if flash else ''}")
    return target_rate, drafter_rate, f"the rates measured on one H200 ({rates}) at these FLOPs{elsewhere(settings)}"


def elsewhere(settings: LayoutSettings) -> str:
    """Where the visible card is not the H200 whose rates the plan uses, that the figure is
    extrapolated to it, and how to measure its own."""
    if settings.card is None or "H200" in settings.card:
        return ""
    return (f", extrapolated to this {settings.card}, whose rates are not measured (estimate.rates=REPORT, "
            "a python -m dflash.bench report of this card, plans from its own)")


def role_costs(settings: LayoutSettings, plan: Plan, micro_batch_size: int,
               models: tuple[torch.nn.Module, DFlashDrafter], cuda_plan: bool) -> Cost:
    """The cost of ``plan`` at ``micro_batch_size`` on the meta-device ``models``, for GPUs
    (bf16, the H200's rates) where ``cuda_plan``, else for the CPU (float32, no rate)."""
    text = models[0].config.get_text_config()
    dtype = torch.bfloat16 if cuda_plan else torch.float32
    dtype_bytes = dtype.itemsize
    target, drafter = models
    drafter_cfg = drafter.config
    embed, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    target_params = sum(p.numel() for p in target.parameters())
    head_params = embed.numel() + (0 if lm_head is embed else lm_head.numel())
    drafter_params = sum(p.numel() for p in drafter.parameters())
    seq_len = plan.padded_len
    context, keys, attention_from = packed_attention(settings, plan)
    t_flops = prefill_flops(target, seq_len, bool(plan.topk), list(plan.layer_ids), keys)
    t_attention = prefill_attention_flops(target, seq_len, bool(plan.topk), list(plan.layer_ids), keys)
    d_flops = drafter_flops(drafter_cfg, seq_len, plan.num_anchors, text.vocab_size, context)
    d_attention = drafter_attention_flops(drafter_cfg, seq_len, plan.num_anchors, context)
    k = settings.tensor_parallel
    bundle = bundle_bytes(plan, micro_batch_size, dtype)
    micro, h = micro_batch_size, text.hidden_size
    tokens = micro * seq_len
    # target.fp8: the decoder layers' linear weights in one byte each (their per-channel scales,
    # 4 bytes a row, are a few MB)
    fp8_weights = fp8_linear_params(decoder_layers(target)) if settings.fp8_target and cuda_plan else 0
    target_gib = {
        # a tensor-parallel rank holds 1/k of every weight (norms and routers, a few MB, whole)
        "weights": (target_params * dtype_bytes - fp8_weights * (dtype_bytes - 1)) / k / GIB,
        # one decoder layer's working set at a time (its sharded MLP width 1/k), the captured
        # features, and the logits for the KL (gathered whole on every rank of a group)
        "activations": tokens * (6 * h + 3 * text.intermediate_size / k) * dtype_bytes / GIB
        + tokens * plan.feature_dim * dtype_bytes / GIB
        + (tokens * text.vocab_size * dtype_bytes / GIB if plan.topk else 0.0),
        "bundles in flight": settings.max_in_flight * bundle / GIB,
    }
    if settings.live_every:
        # the decoding copy of the drafter that evaluations while training run (rank 0; all, to be safe)
        target_gib["evaluation drafter"] = drafter_params * dtype_bytes / GIB
    queries = micro * plan.num_anchors * plan.block_size
    # Under CUDA graphs the step's graph copies the context features into its own input
    # buffer (they arrive at a new address every micro-batch), beside the bundle's copy.
    feature_copies = 2 if cuda_plan and settings.graphs else 1
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
        + 2 * min(plan.objective.chunk_size, queries) * text.vocab_size * 4 / GIB,
    }
    if settings.fp8_drafter and cuda_plan:
        # train.fp8: each linear weight cast to FP8 twice a step (rowwise for the forward, and along
        # the other side for the input gradient), a byte each
        drafter_gib["FP8 casts of the weights"] = 2 * fp8_linear_params([drafter]) / GIB
    target_rate, drafter_rate, rates_from = _rates(settings, plan, (t_flops, t_attention), (d_flops, d_attention),
                                                   cuda_plan)
    fp8 = [name for name, on in (("train.fp8", settings.fp8_drafter), ("target.fp8", settings.fp8_target)) if on]
    if fp8 and rates_from and settings.rates_report is None:
        rates_from += f" (FP8's rates are not measured yet: {' and '.join(fp8)} counted at bf16's)"
    return Cost(plan.batch_size, micro, target_params, drafter_params, head_params, bundle, target_gib,
                drafter_gib, settings.device_gib, t_flops, d_flops, target_rate, drafter_rate, rates_from, k,
                attention_from)
