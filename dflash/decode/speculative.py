"""Real speculative decoding with the HF target and an exported drafter.

Batch size 1, the way a drafter is served: the target prefills the prompt into
a KV cache; then each cycle the drafter fills the block ``[last, MASK x (B-1)]``
in one forward, the target verifies it in one forward, the longest accepted
prefix plus the target's own next token (the bonus) is kept, and the cache is
rolled back to the accepted prefix (:func:`snapshot`, :func:`roll_back`). Greedy
decoding must reproduce plain greedy decoding token for
token (``lossless``); the headline metric is ``tau``, the mean acceptance length
(accepted drafts + 1 per cycle), averaged per response and then over responses
as z-lab reports it.

This path shares nothing with training but the model definitions: context
features come from HF's ``output_hidden_states`` (layer id ``i`` is
``hidden_states[i + 1]``), not from training's hooks, so a layer-id slip on
either side shows up here as a low tau.

The report written to ``--out`` (default ``<output_dir>/eval.json``, next to the
export directory)::

    {
      "target": str, "drafter": str, "block_size": int,
      "tau": float | null,        # mean of the results' tau at the first temperature
      "lossless": bool | null,    # every greedy result lossless; null without a greedy run
      "results": {
        "<dataset>": {            # "<dataset>@<T>" when several temperatures are given
          "dataset": str, "temperature": float,
          "tau": float | null,    # null when no response needed a drafting cycle
          "histogram": {"1": int, ..., "<B>": int},  # cycles per acceptance length
          "lossless": bool | null,                   # null at temperature > 0
          "divergences": [{"prompt": int, "token": int, "margin": float}] | null,
                                                     # where greedy outputs departed, and the target's
                                                     # logit margin there; [] when lossless
          "prompts": int, "new_tokens": int, "cycles": int,
          "wall_s": float,                           # speculative decoding only
          "baseline_wall_s": float | null            # plain greedy decoding, T = 0 only
        }
      }
    }
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import time
from collections.abc import Collection, Generator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from dflash.data import template
from dflash.data.records import BadRecord, conversation_turns, iter_records, parse_turn
from dflash.decode.baseline import GreedyBaselines
from dflash.decode.selector import propose, sample
from dflash.model.drafter import DFlashDrafter, TargetHead
from dflash.model.export import load_export

log = logging.getLogger("dflash.decode.speculative")

BASELINE_FILE = "greedy_baseline.json"  # beside the report: the plain greedy outputs (dflash.decode.baseline)

T = TypeVar("T")


@dataclass(frozen=True)
class DecodeSettings:
    """How prompt sets are decoded and measured (the ``eval`` config group, the
    ``dflash.eval`` options)."""

    max_new_tokens: int = 256  # per response
    max_prompts: int = 64  # read from each prompt set
    temperatures: tuple[float, ...] = (0.0,)  # 0: greedy, with the lossless check
    seed: int = 0  # prompt i samples with a generator seeded seed + i
    block_size: int | None = None  # None: the drafter's
    template_kwargs: Mapping = field(default_factory=dict)  # data.chat_template_kwargs, as in training
    batch_size: int | None = None  # prompts decoded at once; None: 64 on a GPU, 32 on the CPU (dflash.decode.batch)

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
        object.__setattr__(self, "template_kwargs", dict(self.template_kwargs or {}))


# ---------------------------------------------------------------------------
# Decoding on token ids
# ---------------------------------------------------------------------------


def context_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """The drafter's context: the chosen layers' outputs side by side, ``[b, S, n*H]``."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def drafter_context(drafter: DFlashDrafter, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """What decoding keeps of a target forward for the drafter: its context features
    projected as the drafter's layers read them (:meth:`DFlashDrafter.context`), ``[b, S, H]``,
    in the target's dtype (the drafter's block embeddings come from the same weights)."""
    features = context_features(hidden_states, drafter.config.target_layer_ids)
    return drafter.context(features, features.dtype)


def window(features: torch.Tensor, first: int, keep: int | None) -> tuple[torch.Tensor, int]:
    """Context features ``[1, S, n*H]`` starting at position ``first``, cut to their last
    ``keep`` positions (``None``: all), and the position they then start at."""
    drop = 0 if keep is None else max(0, features.shape[1] - keep)
    return features[:, drop:], first + drop


def with_cache(model: nn.Module, cache: DynamicCache, **kwargs):
    """Forward with a KV cache under the keyword this transformers version expects
    (``cache`` in 5.x, where ``past_key_values`` is deprecated; only the latter in 4.57)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(**kwargs, **{name: cache}, use_cache=True)


def accept(
    drafts: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float,
    *,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """How many of the ``B - 1`` drafts the target keeps, and the token it adds after them.

    ``target_logits[i]`` is the target's prediction after ``[last, d_1..d_i]``.
    Greedy keeps the drafts that equal the target's argmax. Sampling is standard
    speculative sampling (accept ``d`` with probability ``min(1, p/q)``, resample a
    rejection from ``max(0, p - q)``), whose output is distributed exactly as
    sampling the target alone.
    """
    if temperature == 0:
        target = target_logits.argmax(-1)
        n = int((drafts == target[:-1]).cumprod(0).sum())
        return n, int(target[n])
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)
    rows = torch.arange(len(drafts), device=drafts.device)
    ratio = p[rows, drafts] / q[rows, drafts]
    u = torch.rand(len(drafts), device=drafts.device, generator=generator)
    n = int((u < ratio).cumprod(0).sum())
    if n == len(drafts):
        dist = p[n]
    else:
        dist = (p[n] - q[n]).clamp_min(0)
        if dist.sum() <= 0:  # p == q up to rounding: the rejection itself was rounding noise
            dist = p[n]
    return n, int(torch.multinomial(dist, 1, generator=generator))


def truncate(tokens: list[int], max_new_tokens: int, eos_ids: Collection[int]) -> list[int]:
    """Cut after the first stop token and at the budget; a cycle may overshoot both."""
    return tokens[: template.end_of_reply(tokens, eos_ids) or len(tokens)][:max_new_tokens]


def croppable(cache: DynamicCache) -> bool:
    """Whether cutting positions off the end takes the cache back to any earlier length:
    only when every layer keeps each position's keys and values. A sliding-window layer
    keeps the last window only, and a linear-attention layer one recurrent state that
    every token updates, so neither can give back the state before a rejected draft."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def snapshot(cache: DynamicCache) -> list[object | None]:
    """The cache at a block's start, for :func:`roll_back`: ``None`` for a layer that
    cropping puts back, a copy of every other (a sliding window or a recurrent state,
    small and of fixed size)."""
    return [None if type(layer) is DynamicLayer else copy.deepcopy(layer) for layer in cache.layers]


def roll_back(cache: DynamicCache, saved: list[object | None], dropped: int) -> None:
    """Back to the block's start: the last ``dropped`` positions cut off the layers that
    keep every position, the saved copies in place of the others."""
    for i, layer in enumerate(saved):
        if layer is None:
            cache.layers[i].crop(-dropped)  # negative = drop that many; 4.57 and 5.x agree on this spelling
        else:
            cache.layers[i] = layer


def decoding_attention() -> AbstractContextManager[None]:
    """The attention kernels decoding may use: every SDPA backend but cuDNN's.

    cuDNN attention, SDPA's first choice on an H200 for a verification's masked call,
    builds an execution plan for each new shape, and decoding gives every call a new
    key length. That cost 43-98 ms of host time per new length on an idle H200, and
    about 1 s for some lengths (BENCHMARKS.md); flash and memory-efficient attention
    take 0.2-0.6 ms at a new length. In a target rank's evaluation slice, the 1 s builds
    held back its next bundle. Speculative decoding here and regeneration's ``generate``
    run under it; training's prefill does not: it runs at a few fixed shapes.

    The backend flags are process-wide, so a sliced decoding enters this around each
    slice, never across a pause."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def run_to_end(steps: Generator[str, None, T]) -> T:
    """Drive a sliced decoding (below) to its end and return its result."""
    with decoding_attention():
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value


@torch.inference_mode()
def speculative_steps(
    target_model: nn.Module,
    drafter: DFlashDrafter,
    head: TargetHead,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_ids: Collection[int] = (),
    generator: torch.Generator | None = None,
    block_size: int | None = None,
) -> Generator[str, None, tuple[list[int], list[int]]]:
    """Generate from ``prompt_ids`` ``[1, S]``, pausing after the prompt's prefill and
    after every drafting cycle (each pause yields what ran before it);
    returns (new tokens, acceptance length per cycle). The pauses let a target rank
    run an evaluation in the gaps between its training work (:mod:`dflash.decode.live`).

    Invariant between cycles: the target cache covers positions ``0..p-1`` and the
    drafter's context (:func:`drafter_context`) ``first..p-1``; the newest token sits at
    ``p`` and is in neither. ``first`` is 0 unless every drafter layer slides: then the
    context keeps only the positions a window reaches (``DrafterConfig.context_window``),
    and the drafter's sliding layers mask the rest of theirs. Each position's context is
    projected once; the drafter's layers rerun over the whole context each cycle (no
    drafter KV cache), which is slower but leaves no cache bookkeeping to get wrong.

    After a rejection the target cache goes back to the accepted prefix: cropped when
    every layer keeps all positions (:func:`croppable`); otherwise (sliding windows,
    linear attention) put back as it was at the block's start and fed the accepted
    tokens again, one more target forward of ``n + 1`` tokens in that cycle.
    """
    cfg = drafter.config
    block_size = block_size or cfg.block_size
    device = prompt_ids.device
    cache = DynamicCache(config=target_model.config)
    out = with_cache(target_model, cache, input_ids=prompt_ids, output_hidden_states=True, logits_to_keep=1)
    crop = croppable(cache)
    context, first = window(drafter_context(drafter, out.hidden_states), 0, cfg.context_window)
    new = sample(out.logits[0, -1:], temperature, generator).tolist()
    tokens, lengths = list(new), []
    yield "prompt prefill"  # a slice of its own
    while len(tokens) < max_new_tokens and not any(t in eos_ids for t in new):
        p = first + context.shape[1]
        block = torch.full((1, block_size), cfg.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = tokens[-1]
        hidden = drafter(
            context,
            head.embed(block),
            torch.arange(first, p, device=device)[None],
            torch.arange(p, p + block_size, device=device)[None],
            projected=True,
        )
        drafts, draft_logits = propose(drafter, head, hidden[0, 1:], tokens[-1], temperature, generator)
        block[0, 1:] = drafts
        saved = None if crop else snapshot(cache)
        out = with_cache(target_model, cache, input_ids=block, output_hidden_states=True)
        n, bonus = accept(drafts, draft_logits, out.logits[0].float(), temperature, generator=generator)
        if n + 1 < block_size and crop:  # negative crop = drop that many; 4.57 and 5.x agree on this spelling
            cache.crop(-(block_size - n - 1))
        elif n + 1 < block_size:
            roll_back(cache, saved, block_size)
            with_cache(target_model, cache, input_ids=block[:, : n + 1], logits_to_keep=1)
        context = torch.cat([context, drafter_context(drafter, out.hidden_states)[:, : n + 1]], dim=1)
        context, first = window(context, first, cfg.context_window)
        new = drafts[:n].tolist() + [bonus]
        tokens += new
        lengths.append(n + 1)
        yield "drafting cycle"
    return truncate(tokens, max_new_tokens, eos_ids), lengths


def speculative_generate(*args, **kwargs) -> tuple[list[int], list[int]]:
    """:func:`speculative_steps` in one call."""
    return run_to_end(speculative_steps(*args, **kwargs))


@torch.inference_mode()
def greedy_steps(
    target_model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids: Collection[int] = ()
) -> Generator[str, None, list[int]]:
    """Plain one-token-at-a-time greedy decoding, the reference ``lossless`` is judged
    against; pauses after every token."""
    cache = DynamicCache(config=target_model.config)
    logits = with_cache(target_model, cache, input_ids=prompt_ids, logits_to_keep=1).logits
    tokens: list[int] = []
    yield "baseline prefill"
    while True:
        tokens.append(int(logits[0, -1].argmax()))
        if len(tokens) >= max_new_tokens or tokens[-1] in eos_ids:
            return tokens
        step = torch.tensor([[tokens[-1]]], device=prompt_ids.device)
        logits = with_cache(target_model, cache, input_ids=step).logits
        yield "baseline token"


def greedy_generate(*args, **kwargs) -> list[int]:
    """:func:`greedy_steps` in one call."""
    return run_to_end(greedy_steps(*args, **kwargs))


@torch.inference_mode()
def divergence(target_model: nn.Module, prompt_ids: torch.Tensor, greedy: list[int], speculative: list[int]
               ) -> dict | None:
    """Where a greedy speculative output first departs from the plain greedy one, and by
    how much the target prefers the greedy token there: its logit minus the speculative
    token's, from one forward over the prompt and the shared prefix. ``None`` when the
    outputs are equal (both stop at the same stop token and budget, so a shared prefix
    means equal outputs).

    In bf16 the 16-token verification and the one-token baseline round differently, so
    a near-tie can break either way: a margin at the scale of that rounding is such a
    tie; a large one means the speculative loop kept a token the target ranks lower."""
    i = next((k for k, (a, b) in enumerate(zip(greedy, speculative)) if a != b), None)
    if i is None:
        return None
    prefix = torch.tensor([greedy[:i]], dtype=prompt_ids.dtype, device=prompt_ids.device)
    logits = target_model(input_ids=torch.cat([prompt_ids, prefix], dim=1), logits_to_keep=1).logits[0, -1].float()
    return {"token": i, "margin": float(logits[greedy[i]] - logits[speculative[i]])}


# ---------------------------------------------------------------------------
# Prompts, metrics, reports
# ---------------------------------------------------------------------------


def prompt_of(record: object) -> list[dict[str, str]]:
    """The turns before the first assistant turn (a record without one is a prompt
    too, so benchmark prompt sets need no placeholder replies)."""
    messages = []
    for turn in conversation_turns(record):
        message = parse_turn(turn)
        if message["role"] == "assistant":
            break
        messages.append(message)
    return messages


def load_prompts(path: str, max_prompts: int, key: str = "data.eval_path") -> list[list[dict[str, str]]]:
    """The first ``max_prompts`` prompts of a prompt set in any format training reads
    (:func:`dflash.data.records.iter_records`); unreadable records are skipped and counted.
    Errors name ``key``, the setting the path came from."""
    prompts, bad = [], []
    for where, record in iter_records(path, key):
        try:
            messages = prompt_of(record)
        except BadRecord as e:
            bad.append(f"{where}: {e}")
            continue
        if messages:
            prompts.append(messages)
        if len(prompts) >= max_prompts:
            break
    if bad:
        log.warning("skipped %d unreadable prompts, e.g. %s", len(bad), bad[0])
    if not prompts:
        raise ValueError(f"{key}={path!r} holds no prompts")
    return prompts


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], template_kwargs: Mapping | None = None
) -> torch.Tensor:
    """Chat-templated prompt ids ``[1, S]``, ending in the assistant header, rendered with
    the template arguments training used (``data.chat_template_kwargs``, e.g. Qwen3's
    ``enable_thinking``), so the drafter is measured in the context it learned: the
    renderer training uses (:func:`dflash.data.template.prompt_ids`).
    """
    return torch.tensor([template.prompt_ids(tokenizer, messages, template_kwargs)], dtype=torch.long)


# Keys of a drafter's config.json that loading understands: Qwen3Config's (transformers 4.57
# and 5.x spellings), what HF writes into every saved config, and the DFlash layout's own.
KNOWN_CONFIG_FIELDS = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
    "attention_bias", "attention_dropout", "hidden_act", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "initializer_range",
    "layer_types", "max_window_layers", "use_sliding_window", "sliding_window", "use_cache", "is_causal",
    "bos_token_id", "eos_token_id", "pad_token_id", "block_size", "num_target_layers", "dflash_config",
})
KNOWN_DFLASH_FIELDS = frozenset({
    "mask_token_id", "target_layer_ids", "block_size", "num_target_layers",
    "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",  # DFlash2
    # read so that the loader refuses them with its own reason
    "output_multiplier", "final_logit_softcapping", "input_embedding_scale", "causal", "use_swa",
})


def unknown_fields(config: Mapping) -> list[str]:
    """The keys of a drafter's ``config.json`` that no loader here reads: each may change
    what the drafter computes (a quantization, a vocabulary map, another attention), so a
    drafter carrying one would be scored as something it is not."""
    top = [k for k in config if k not in KNOWN_CONFIG_FIELDS]
    dflash = [f"dflash_config.{k}" for k in config.get("dflash_config") or {} if k not in KNOWN_DFLASH_FIELDS]
    return sorted(top) + sorted(dflash)


def check_drafter_config(path: str | Path) -> dict:
    """A drafter directory's ``config.json``, refused with the reason when it is not a
    DFlash layout this decoding runs: no config, or fields it would ignore."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path}: no config.json; --drafter takes a drafter directory in the z-lab layout "
                         "(config.json + model.safetensors)")
    config = json.loads(config_path.read_text())
    unknown = unknown_fields(config)
    if unknown:
        raise ValueError(f"{path}: config.json has fields this decoding does not read, so the drafter would not be "
                         f"run as it was trained: {', '.join(unknown)}")
    return config


def check_compatible(target_model: nn.Module, drafter: DFlashDrafter) -> None:
    """Refuse a drafter made for another target, with the reason, instead of a shape
    error deep in a matmul or a silently low tau: it must read features of the target's
    width from layers the target has, draft in the target's vocabulary (it uses the
    target's embedding and LM head) and have been trained on a target of its depth."""
    text = target_model.config.get_text_config()
    cfg = drafter.config
    reasons = []
    if cfg.hidden_size != text.hidden_size:
        reasons.append(f"hidden size {cfg.hidden_size}, the target's is {text.hidden_size}")
    if cfg.vocab_size != text.vocab_size:
        reasons.append(f"vocabulary of {cfg.vocab_size}, the target's has {text.vocab_size}")
    if not 0 <= cfg.mask_token_id < text.vocab_size:
        reasons.append(f"mask id {cfg.mask_token_id} outside the target's vocabulary of {text.vocab_size}")
    if cfg.num_target_layers != text.num_hidden_layers:
        reasons.append(f"trained on a target of {cfg.num_target_layers} layers, this one has {text.num_hidden_layers}")
    if not all(0 <= i < text.num_hidden_layers - 1 for i in cfg.target_layer_ids):
        # HF's hidden_states[L] is taken after the final norm, unlike the other layers.
        reasons.append(f"target_layer_ids {cfg.target_layer_ids} beyond 0..{text.num_hidden_layers - 2}, the layers "
                       f"of this {text.num_hidden_layers}-layer target whose outputs it can read")
    if reasons:
        raise ValueError(f"the drafter does not fit this target: {'; '.join(reasons)}")


def tau(acceptance: list[list[int]]) -> float | None:
    """Mean over responses of each response's mean acceptance length (z-lab's convention)."""
    per_response = [sum(a) / len(a) for a in acceptance if a]
    return sum(per_response) / len(per_response) if per_response else None


def evaluate_steps(
    target_model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    drafter: DFlashDrafter,
    head: TargetHead,
    *,
    prompts: list[list[dict[str, str]]],
    settings: DecodeSettings,
    temperature: float = 0.0,
    baselines: GreedyBaselines | None = None,
) -> Generator[str, None, dict]:
    """Speculative decoding over ``prompts`` at ``temperature``, up to
    ``settings.max_new_tokens`` each, ``settings.batch_size`` prompts at a time
    (:mod:`dflash.decode.batch`); at temperature 0 also the lossless check.
    Responses end at the tokens of :func:`dflash.data.template.reply_end_ids`.
    Pauses after every prompt's prefill, drafting cycle, baseline step and divergence
    measure (``wall_s`` then includes whatever ran in the pauses).

    ``baselines`` keeps the plain greedy outputs across calls (and runs, with a file):
    those found are reused, the others decoded and added. The target is frozen, so the
    evaluations of a run decode the baseline once, not at every evaluation.

    Each prompt gets its own generator seeded ``settings.seed + index``, so a sampled
    response does not depend on which prompts ran before it or beside it.
    """
    from dflash.decode.batch import (  # it builds on this module
        baseline_steps,
        speculative_batch_steps,
    )

    check_compatible(target_model, drafter)
    block_size = settings.block_size or drafter.config.block_size
    max_new_tokens = settings.max_new_tokens
    device = head.embed_weight.device
    eos_ids = template.reply_end_ids(tokenizer, getattr(target_model, "generation_config", None))
    encoded = [encode_prompt(tokenizer, messages, settings.template_kwargs).to(device) for messages in prompts]
    generators = [torch.Generator(device).manual_seed(settings.seed + i) for i in range(len(prompts))]

    started = time.perf_counter()
    decoded = yield from speculative_batch_steps(
        target_model, drafter, head, encoded, max_new_tokens=max_new_tokens, temperature=temperature,
        eos_ids=eos_ids, generators=generators, block_size=block_size, batch_size=settings.batch_size,
    )
    outputs, acceptance = [tokens for tokens, _ in decoded], [lengths for _, lengths in decoded]
    wall_s = time.perf_counter() - started

    lossless = baseline_wall_s = divergences = None
    if temperature == 0:
        started = time.perf_counter()
        baseline = yield from baseline_steps(target_model, encoded, max_new_tokens, eos_ids, settings.batch_size,
                                             baselines or GreedyBaselines())
        baseline_wall_s = time.perf_counter() - started
        lossless = outputs == baseline
        divergences = []
        for k, (ids, greedy, speculative) in enumerate(zip(encoded, baseline, outputs)):
            if greedy != speculative:
                divergences.append({"prompt": k, **divergence(target_model, ids, greedy, speculative)})
                yield "divergence measure"

    cycles = [n for a in acceptance for n in a]
    return {
        "temperature": temperature,
        "tau": tau(acceptance),
        "histogram": {str(k): cycles.count(k) for k in range(1, block_size + 1)},
        "lossless": lossless,
        "divergences": divergences,
        "prompts": len(prompts),
        "new_tokens": sum(map(len, outputs)),
        "cycles": len(cycles),
        "wall_s": wall_s,
        "baseline_wall_s": baseline_wall_s,
    }


def evaluate(*args, **kwargs) -> dict:
    """:func:`evaluate_steps` in one call."""
    return run_to_end(evaluate_steps(*args, **kwargs))


def evaluate_datasets(
    target_model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    drafter_dir: str | Path,
    head: TargetHead,
    *,
    datasets: dict[str, str],
    out_path: str | Path,
    settings: DecodeSettings,
    target_name: str | None = None,
) -> dict:
    """Evaluate the export on every dataset (name: path) at every temperature of
    ``settings``, write the report to ``out_path``, return it.

    The drafter is loaded from its export directory, so what is measured is the
    artefact a serving engine would load, not the in-memory training copy. The plain
    greedy outputs are kept in ``greedy_baseline.json`` beside the report
    (:mod:`dflash.decode.baseline`): the run's evaluations while training and any later
    evaluation against the same target reuse them.
    """
    drafter = load_export(drafter_dir, head.embed_weight.device, head.embed_weight.dtype)
    baselines = GreedyBaselines(Path(out_path).with_name(BASELINE_FILE))
    temperatures = settings.temperatures
    results = {}
    for name, path in datasets.items():
        prompts = load_prompts(path, settings.max_prompts)
        for t in temperatures:
            key = name if len(temperatures) == 1 else f"{name}@{t:g}"
            r = evaluate(target_model, tokenizer, drafter, head, prompts=prompts, settings=settings, temperature=t,
                         baselines=baselines)
            results[key] = {"dataset": name, **r}
            log.info("%s: tau %s, lossless %s, %d tokens in %.1f s", key, r["tau"], r["lossless"],
                     r["new_tokens"], r["wall_s"])
            if r["divergences"]:
                log.warning("%s: %s", key, describe_divergences(r["divergences"], r["prompts"]))
    first = [r["tau"] for r in results.values() if r["temperature"] == temperatures[0] and r["tau"] is not None]
    greedy = [r["lossless"] for r in results.values() if r["lossless"] is not None]
    report = {
        "target": target_name or str(getattr(target_model.config, "name_or_path", "")),
        "drafter": str(drafter_dir),
        "block_size": settings.block_size or drafter.config.block_size,
        "tau": sum(first) / len(first) if first else None,
        "lossless": all(greedy) if greedy else None,
        "results": results,
    }
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


def describe_divergences(divergences: list[dict], prompts: int) -> str:
    """One line on the prompts whose speculative output departed from plain greedy."""
    margins = [abs(d["margin"]) for d in divergences]
    first = ", ".join(f"prompt {d['prompt']} token {d['token']} ({d['margin']:+.3g})" for d in divergences[:3])
    return (f"{len(divergences)} of {prompts} prompts depart from plain greedy decoding; the target's logit margin "
            f"between the two tokens there is at most {max(margins):.3g} (first: {first}). Margins at the "
            "scale of the dtype's rounding are near-ties broken differently; large ones point to a bug")


def format_table(report: dict) -> str:
    rows = [f"{'dataset':<24} {'T':>4} {'prompts':>7} {'tokens':>7} {'tau':>6} {'lossless':>10} {'tok/s':>8}"]
    for key, r in report["results"].items():
        tau_s = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        departed = len(r.get("divergences") or [])
        lossless = {None: "-", True: "yes", False: f"NO {departed}/{r['prompts']}"}[r["lossless"]]
        rate = r["new_tokens"] / r["wall_s"] if r["wall_s"] else 0.0
        rows.append(
            f"{key:<24} {r['temperature']:>4g} {r['prompts']:>7} {r['new_tokens']:>7} {tau_s:>6} {lossless:>10} {rate:>8.1f}"
        )
    return "\n".join(rows)
