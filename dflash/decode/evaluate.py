"""Evaluating an export: speculative decoding over prompt sets, the lossless check
against plain greedy decoding, tau, and the report.

Decoding itself is :mod:`dflash.decode.speculative` (batch 1) and
:mod:`dflash.decode.batch` (many prompts at a time); this module runs them over
prompts, compares with the target's plain greedy outputs and writes what it found.

The report written to ``--out`` (default ``<output_dir>/eval.json``, next to the
export directory)::

    {
      "target": str, "drafter": str, "block_size": int,
      "tau_count": str,           # how a cycle is counted (dflash.decode.speculative.TAU_COUNT)
      "tau": float | null,        # mean of the results' tau at the first temperature
      "lossless": bool | null,    # every greedy result lossless; null without a greedy run
      "results": {
        "<dataset>": {            # "<dataset>@<T>" when several temperatures are given
          "dataset": str, "temperature": float,
          "tau": float | null,    # null when no response needed a drafting cycle
          "capped": int,          # responses that reached max_new_tokens without a stop token
          "tau_uncapped": float | null,              # tau of the others
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

import json
import logging
import time
from collections.abc import Generator, Mapping
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from dflash.data import template
from dflash.data.records import BadRecord, conversation_turns, iter_records, parse_turn
from dflash.decode.baseline import GreedyBaselines
from dflash.decode.batch import baseline_steps, speculative_batch_steps
from dflash.decode.speculative import TAU_COUNT, DecodeSettings, run_to_end
from dflash.model.drafter import DFlashDrafter, TargetHead

log = logging.getLogger(__name__)

BASELINE_FILE = "greedy_baseline.json"  # beside the report: the plain greedy outputs (dflash.decode.baseline)


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


def at_budget(tokens: list[int], max_new_tokens: int, eos_ids) -> bool:
    """A response that ran to the token budget without its stop token: often a loop a
    135M-class model falls into, which any predictor of text drafts almost perfectly."""
    return len(tokens) >= max_new_tokens and template.end_of_reply(tokens, eos_ids) is None


def budget_split(acceptance: list[list[int]], capped: list[bool]) -> dict:
    """How many responses hit the budget, and tau without them, so a mean inflated by
    degenerate repetition can be told from one that is not."""
    return {"capped": sum(capped), "tau_uncapped": tau([a for a, c in zip(acceptance, capped) if not c])}


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
        **budget_split(acceptance, [at_budget(t, max_new_tokens, eos_ids) for t in outputs]),
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
    drafter: DFlashDrafter,
    head: TargetHead,
    *,
    drafter_dir: str | Path,
    datasets: dict[str, str],
    out_path: str | Path,
    settings: DecodeSettings,
    target_name: str | None = None,
) -> dict:
    """Evaluate the export on every dataset (name: path) at every temperature of
    ``settings``, write the report to ``out_path``, return it.

    ``drafter`` is the export loaded from ``drafter_dir`` (:func:`load_export`, in the
    target's device and dtype), so what is measured is the artefact a serving engine
    would load, not the in-memory training copy. The plain
    greedy outputs are kept in ``greedy_baseline.json`` beside the report
    (:mod:`dflash.decode.baseline`): the run's evaluations while training and any later
    evaluation against the same target reuse them.
    """
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
        "tau_count": TAU_COUNT,
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
    """The report as a table; ``capped`` counts responses that ran to the budget, and
    ``tau*`` is tau without them."""
    rows = [f"{'dataset':<24} {'T':>4} {'prompts':>7} {'tokens':>7} {'tau':>6} {'capped':>6} {'tau*':>6} "
            f"{'lossless':>10} {'tok/s':>8}"]
    for key, r in report["results"].items():
        tau_s, uncapped = (f"{v:.2f}" if v is not None else "-" for v in (r["tau"], r.get("tau_uncapped")))
        departed = len(r.get("divergences") or [])
        lossless = {None: "-", True: "yes", False: f"NO {departed}/{r['prompts']}"}[r["lossless"]]
        rate = r["new_tokens"] / r["wall_s"] if r["wall_s"] else 0.0
        rows.append(f"{key:<24} {r['temperature']:>4g} {r['prompts']:>7} {r['new_tokens']:>7} {tau_s:>6} "
                    f"{r.get('capped', 0):>6} {uncapped:>6} {lossless:>10} {rate:>8.1f}")
    return "\n".join(rows)
