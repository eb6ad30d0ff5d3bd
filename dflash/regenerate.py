"""Regenerate the assistant turns of a chat data set with the target itself.

    python -m dflash.regenerate target=qwen3_8b target.path=/models/Qwen3-8B data.path=prompts.jsonl \\
        --out data/regen.jsonl [--temperature T] [--top-p P] [--max-new-tokens N] [--thinking on|off]
    torchrun --nproc_per_node=8 -m dflash.regenerate ...        # one shard of the records per GPU
    python -m dflash.regenerate data.path=prompts.jsonl --out data/regen.jsonl --server http://localhost:8000
    python -m dflash.regenerate data.path=prompts.jsonl --out data/regen.jsonl --merge [--keep-truncated]
    python -m dflash.regenerate target=qwen3_8b target.path=random --throughput 256 --batch-size 64

The DFlash recipe trains the drafter on what the target itself answers, so that it
learns the target's distribution rather than the data set's. Every assistant turn is
regenerated in order, with the replies regenerated before it as context; a record that
ends in a user turn gets one reply more, so a bare prompt set works as well.

Each rank appends one line per finished record to its shard file in ``<out>.parts/``,
flushed and fsynced after every batch, and a restart skips the records any shard file
already holds: a crash costs at most the batch in flight, and nothing is written twice.
Records are keyed by their own ``id`` or else by ``file:line``. Rank ``r`` of ``W`` takes
the windows of ``batch_size x window`` consecutive records whose number is ``r`` modulo
``W``; a window's prompts are sorted by length and batched the same way whatever ``W``,
so a greedy run gives the same file on any number of ranks. When every shard is done
(rank 0, after a barrier over gloo; or ``--merge`` later), the output is written in
input order in one rename. A reply that reaches ``--max-new-tokens`` without the
end-of-turn token is counted and dropped (``--keep-truncated`` keeps it); the merge
decides, so the same shards can be merged either way.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import requests
import torch
import torch.distributed as dist
import transformers
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn
from tqdm import tqdm
from transformers import GenerationConfig, PreTrainedTokenizerBase

from dflash.data import template
from dflash.data.records import BadRecord, conversation_turns, iter_records, parse_turn
from dflash.decode.speculative import decoding_attention
from dflash.device import peak_memory_gib, pick_device, synchronize
from dflash.model.target import RANDOM, TargetSource
from dflash.run.config import compose_config, target_source

log = logging.getLogger("dflash.regenerate")

# Ranks finish their shards hours apart on a skewed data set; the merge waits for the last.
MERGE_WAIT = timedelta(hours=24)
PROGRESS_LOG_S = 30.0  # a progress line this often when stderr is a log file, not a terminal
REQUEST_TIMEOUT_S = 3600.0  # one long reply from a busy server
RETRIES = 5  # attempts per request on connection errors, timeouts, 5xx and 429
SHARD_KEY_PREFIX = '{"key": '  # every shard line starts so, so a restart reads keys alone


# ---------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    text: str
    tokens: int  # generated, the end-of-turn token included
    finished: bool  # ended with the end-of-turn token; False: broke off at max_new_tokens


@dataclass
class Conversation:
    """One record being regenerated: the turns before each reply, and the conversation so far."""

    index: int
    key: str
    chunks: list[list[dict[str, str]]]  # the user/system turns before each reply to generate
    messages: list[dict[str, str]] = field(default_factory=list)
    replies: int = 0
    tokens: int = 0
    status: str = "ok"  # ok | truncated | skipped
    reason: str = ""

    @classmethod
    def of(cls, index: int, key: str, turns: list[dict[str, str]]) -> Conversation:
        """Split at the assistant turns (their old content is dropped); trailing user or
        system turns ask for one reply more."""
        chunks, chunk = [], []
        for turn in turns:
            if turn["role"] == "assistant":
                chunks.append(chunk)
                chunk = []
            else:
                chunk.append(turn)
        if chunk:
            chunks.append(chunk)
        return cls(index, key, chunks)

    @property
    def done(self) -> bool:
        return self.status != "ok" or self.replies == len(self.chunks)

    def prompt(self) -> list[dict[str, str]]:
        """The context of the next reply: everything regenerated so far, then the next turns."""
        return self.messages + self.chunks[self.replies]

    def add(self, reply: Reply) -> None:
        """A reply that broke off ends the record: later turns would answer a cut context."""
        self.messages = self.prompt() + [{"role": "assistant", "content": reply.text}]
        self.replies += 1
        self.tokens += reply.tokens
        if not reply.finished:
            self.status = "truncated"
        elif not reply.text.strip():
            self.skip("empty reply: the target answered with nothing")

    def skip(self, reason: str) -> None:
        self.status, self.reason = "skipped", reason

    def entry(self) -> dict:
        """The record's line in a shard file, the key first (:data:`SHARD_KEY_PREFIX`)."""
        entry = {"key": self.key, "index": self.index, "status": self.status, "tokens": self.tokens}
        if self.status == "skipped":
            entry["reason"] = self.reason
        else:
            entry["record"] = {"id": self.key, "conversations": self.messages}
        return entry


def source_turns(record: object) -> list[dict[str, str]]:
    """The turns of a record of any shape :mod:`dflash.data.records` reads. Unlike training
    (``parse_messages``), a record needs no reply and may hold empty ones: they are
    replaced, and a bare prompt is the common input."""
    turns = [parse_turn(turn) for turn in conversation_turns(record)]
    if next((t["role"] for t in turns if t["role"] != "system"), "assistant") == "assistant":
        raise BadRecord("starts with the assistant")
    return turns


def unique_key(where: str, record: object, used: set[str]) -> str:
    """The record's own ``id`` when it has one, else where it sits; a repeat gets ``#n``,
    so that no two records share a key and a restart skips exactly the finished ones."""
    own = record.get("id") if isinstance(record, Mapping) else None
    base = where if own is None else str(own)
    key, n = base, 0
    while key in used:
        n += 1
        key = f"{base}#{n}"
    used.add(key)
    return key


def keyed_records(path: str | Sequence[str], max_samples: int | None) -> Iterator[tuple[int, str, object]]:
    """``(index, key, record)`` of the first ``max_samples`` records, in input order."""
    used: set[str] = set()
    for index, (where, record) in enumerate(iter_records(path)):
        if max_samples is not None and index >= max_samples:
            return
        yield index, unique_key(where, record, used), record


@dataclass
class Work:
    keys: list[str]  # every record's key, in input order
    windows: dict[int, list[Conversation]]  # this rank's unfinished records, by window number
    skipped: list[Conversation]  # this rank's unfinished records that cannot be regenerated

    @property
    def pending(self) -> int:
        return sum(map(len, self.windows.values()))


def find_work(path: str | Sequence[str], max_samples: int | None, window_size: int, rank: int, *, world: int,
              done: set[str]) -> Work:
    """Read the input once: every key, and this rank's share of what is not done yet."""
    work = Work([], {}, [])
    for index, key, record in keyed_records(path, max_samples):
        work.keys.append(key)
        window = index // window_size
        if window % world != rank or key in done:
            continue
        try:
            conversation = Conversation.of(index, key, source_turns(record))
        except BadRecord as e:
            conversation = Conversation(index, key, [])
            conversation.skip(str(e))
            work.skipped.append(conversation)
        else:
            work.windows.setdefault(window, []).append(conversation)
    return work


# ---------------------------------------------------------------------------
# Shard files and the merge
# ---------------------------------------------------------------------------


def parts_dir(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def drop_partial_line(path: Path) -> None:
    """A kill mid-write leaves half a line at the end: cut it, so the next append starts clean."""
    if not path.exists():
        return
    with open(path, "r+b") as fh:
        end = pos = fh.seek(0, os.SEEK_END)
        while pos > 0:
            step = min(1 << 16, pos)
            fh.seek(pos - step)
            cut = fh.read(step).rfind(b"\n")
            if cut >= 0:
                pos += cut + 1 - step
                break
            pos -= step
        if pos != end:
            fh.truncate(pos)


def shard_keys(path: Path) -> Iterator[tuple[int, str]]:
    """``(offset, key)`` of every complete line, decoding only the key."""
    decoder = json.JSONDecoder()
    with open(path, "rb") as fh:
        while True:
            offset, raw = fh.tell(), fh.readline()
            if not raw.endswith(b"\n"):
                return  # the end, or half a line a running or killed writer left
            line = raw.decode("utf-8")
            if line.startswith(SHARD_KEY_PREFIX):
                yield offset, decoder.raw_decode(line, len(SHARD_KEY_PREFIX))[0]


def finished_keys(directory: Path) -> set[str]:
    return {key for path in sorted(directory.glob("*.jsonl")) for _, key in shard_keys(path)}


class ShardWriter:
    """Appends finished records to this rank's shard file, durably."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        drop_partial_line(path)
        self.fh = open(path, "ab")

    def write(self, conversations: Sequence[Conversation]) -> None:
        """One write, flush and fsync per batch: a crash loses at most the batch in flight."""
        if not conversations:
            return
        self.fh.write(b"".join(json.dumps(c.entry(), ensure_ascii=False).encode() + b"\n" for c in conversations))
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def close(self) -> None:
        self.fh.close()


def check_settings(directory: Path, settings: dict) -> None:
    """Shards made with another target or sampling would mix two distributions in one
    file: a restart must use the same ones."""
    path = directory / "settings.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old != settings:
            changed = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
            raise ValueError(f"{directory} holds replies made with other settings (was, now): {changed}; "
                             f"use the same options, or delete {directory} to start over")
        return
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".settings.{os.getpid()}.json"
    tmp.write_text(json.dumps(settings, indent=1) + "\n")
    os.replace(tmp, path)


def category(reason: str) -> str:
    return reason.split(":")[0]


def merge(keys: Sequence[str], directory: Path, out: Path, keep_truncated: bool) -> dict:
    """Write ``out`` in input order from the shard files, once every record has its line;
    the counts of the whole data set (all runs and ranks) come back."""
    found: dict[str, tuple[Path, int]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        for offset, key in shard_keys(path):
            found.setdefault(key, (path, offset))
    missing = [k for k in keys if k not in found]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(keys)} records have no result in {directory} yet "
                           f"(first: {missing[0]}); run the same command again to finish them")
    status, skipped, tokens, written = Counter(), Counter(), 0, 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp_{out.name}")
    with ExitStack() as stack:
        shards = {path: stack.enter_context(open(path, "rb")) for path in {p for p, _ in found.values()}}
        dst = stack.enter_context(open(tmp, "wb"))
        for key in keys:
            path, offset = found[key]
            shards[path].seek(offset)
            entry = json.loads(shards[path].readline())
            status[entry["status"]] += 1
            tokens += entry["tokens"]
            if entry["status"] == "skipped":
                skipped[category(entry["reason"])] += 1
            elif entry["status"] == "ok" or keep_truncated:
                dst.write(json.dumps(entry["record"], ensure_ascii=False).encode() + b"\n")
                written += 1
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, out)
    return {"records": len(keys), "regenerated": status["ok"], "truncated": status["truncated"],
            "keep_truncated": keep_truncated, "skipped": dict(sorted(skipped.items())), "tokens": tokens,
            "written": written, "out": str(out)}


# ---------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------


class Progress:
    """A tqdm bar on a terminal; in a log file the same figures as one line every
    :data:`PROGRESS_LOG_S` seconds, since carriage returns make a log unreadable."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.tty, self.enabled, self.total, self.desc = sys.stderr.isatty(), enabled, total, desc
        self.bar = tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, mininterval=1.0, smoothing=0.1,
                        disable=not (enabled and self.tty))
        self.samples = self.tokens = 0
        self.began = self.logged = time.perf_counter()

    def update(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        now = time.perf_counter()
        rate = f"{self.tokens / max(now - self.began, 1e-9):.0f} tokens/s"
        self.bar.set_postfix_str(rate, refresh=False)
        self.bar.update(samples)
        if self.enabled and not self.tty and (now - self.logged >= PROGRESS_LOG_S or self.samples == self.total):
            self.logged = now
            log.info("%s", tqdm.format_meter(self.samples, self.total, now - self.began, prefix=self.desc,
                                             unit="sample", postfix=rate))

    def close(self) -> None:
        self.bar.close()


# ---------------------------------------------------------------------------
# Generation with transformers
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How replies are drawn. ``None`` leaves the value to the target's generation
    config (or the server's default), the setting its authors recommend."""

    max_new_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    template_kwargs: Mapping = field(default_factory=dict)
    seed: int = 0


def generation_config(model: nn.Module, sampling: Sampling, stop: list[int] | int | None,
                      pad_id: int) -> GenerationConfig:
    """The target's own generation config with these overrides. Greedy resets the
    sampling knobs to transformers' neutral values: left at a sampling preset
    (Qwen3's 0.6/0.95/20) they are ignored but warned about on every call."""
    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=sampling.max_new_tokens, eos_token_id=stop, pad_token_id=pad_id)
    if sampling.temperature == 0:
        config.update(do_sample=False, temperature=1.0, top_p=1.0, top_k=50)
    elif sampling.temperature is not None:
        config.update(do_sample=True, temperature=sampling.temperature)
    if sampling.top_p is not None and config.do_sample:
        config.top_p = sampling.top_p
    return config


def batch_seed(seed: int, *where: int) -> int:
    """The sampling seed of one batch, a function of its place alone (window, round,
    batch), so a sampled run is the same on any number of ranks."""
    return int(np.random.SeedSequence([seed, *where]).generate_state(1)[0])


class LocalTarget:
    """The target through transformers' ``generate``: left-padded batches that stop where
    a reply ends (:func:`dflash.data.template.reply_end_ids`), as training's replies do.
    A template argument the chat template never reads (thinking asked of a template
    without it) is warned about rather than ignored silently."""

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, sampling: Sampling):
        self.model, self.tokenizer = model, tokenizer
        self.ends = template.reply_end_ids(tokenizer, model.generation_config)
        self.stop = sorted(self.ends)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop[0]
        self.config = generation_config(model, sampling, self.stop, self.pad_id)
        self.kwargs = dict(sampling.template_kwargs)
        unread = template.unread_kwargs(tokenizer, self.kwargs)
        if unread:
            log.warning("the chat template does not read %s: ignored", unread)
        self.max_positions = model.config.get_text_config().max_position_embeddings
        self.device = model.get_input_embeddings().weight.device

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt ids ending in the assistant header, rendered as training renders them
        (and a server); a template that refuses the conversation is a ``template`` problem."""
        return template.prompt_ids(self.tokenizer, messages, self.kwargs)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], seed: int) -> list[Reply]:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        torch.manual_seed(seed)
        with decoding_attention():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=self.config)
        return [self.reply(row) for row in out[:, width:].tolist()]

    def reply(self, tokens: list[int]) -> Reply:
        """Cut at the first end-of-turn token (what follows is padding); none: broken off."""
        end = template.end_of_reply(tokens, self.ends)
        if end is None:
            return Reply(self.tokenizer.decode(tokens), len(tokens), False)
        return Reply(self.tokenizer.decode(tokens[: end - 1]), end, True)


def prepare_round(target: LocalTarget, active: list[Conversation]) -> list[tuple[Conversation, list[int]]]:
    """This round's prompts, longest first (an out-of-memory shows at once), ties by input
    order; a prompt without room for ``max_new_tokens`` is skipped."""
    prompts = []
    budget = target.config.max_new_tokens
    for conversation in active:
        try:
            ids = target.encode(conversation.prompt())
        except BadRecord as e:
            conversation.skip(str(e))
            continue
        if len(ids) + budget > target.max_positions:
            conversation.skip(f"too long: {len(ids)} prompt tokens + {budget} new > {target.max_positions} positions")
            continue
        prompts.append((conversation, ids))
    prompts.sort(key=lambda p: (-len(p[1]), p[0].index))
    return prompts


def regenerate_local(target: LocalTarget, work: Work, batch_size: int, seed: int, *, writer: ShardWriter,
                     progress: Progress) -> int:
    """Each window in rounds: round ``r`` generates the ``r``-th reply of every record that
    needs one, in batches of similar length. Returns the tokens generated."""
    tokens = 0
    for number, window in work.windows.items():
        for round_ in range(max(len(c.chunks) for c in window)):
            active = [c for c in window if not c.done]
            prompts = prepare_round(target, active)
            refused = [c for c in active if c.done]
            writer.write(refused)
            progress.update(len(refused), 0)
            for b, start in enumerate(range(0, len(prompts), batch_size)):
                batch = prompts[start : start + batch_size]
                replies = target.generate([ids for _, ids in batch], batch_seed(seed, number, round_, b))
                for (conversation, _), reply in zip(batch, replies):
                    conversation.add(reply)
                finished = [c for c, _ in batch if c.done]
                writer.write(finished)
                generated = sum(r.tokens for r in replies)
                tokens += generated
                progress.update(len(finished), generated)
    return tokens


# ---------------------------------------------------------------------------
# Generation through an OpenAI-compatible server
# ---------------------------------------------------------------------------


class Rejected(Exception):
    """The server refused a request (HTTP 4xx): that record is skipped, the run goes on."""


class Server:
    """An OpenAI-compatible endpoint (vLLM, SGLang): one chat completion per reply. Each
    worker thread has its own HTTP session (``requests`` sessions are not shared safely)."""

    def __init__(self, url: str, model: str | None, sampling: Sampling):
        self.base = url.rstrip("/").removesuffix("/v1")
        self.sampling = sampling
        self.local = threading.local()
        self.model = model or self.served_model()

    def session(self) -> requests.Session:
        if not hasattr(self.local, "session"):
            self.local.session = requests.Session()
        return self.local.session

    def served_model(self) -> str:
        """The first model the server lists: the one it was started with."""
        try:
            response = self.session().get(f"{self.base}/v1/models", timeout=60)
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (requests.RequestException, ValueError, KeyError, IndexError) as e:
            raise RuntimeError(f"no model listed at {self.base}/v1/models ({e}): is the server up? "
                               "(--model names the model without asking)") from None

    def body(self, messages: list[dict[str, str]]) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": self.sampling.max_new_tokens}
        if self.sampling.temperature is not None:
            body["temperature"] = self.sampling.temperature
        if self.sampling.top_p is not None:
            body["top_p"] = self.sampling.top_p
        if self.sampling.template_kwargs:
            body["chat_template_kwargs"] = dict(self.sampling.template_kwargs)
        return body

    def chat(self, messages: list[dict[str, str]]) -> Reply:
        """One reply, retried with backoff on connection errors, timeouts, 5xx and 429."""
        error = ""
        for attempt in range(RETRIES):
            try:
                response = self.session().post(f"{self.base}/v1/chat/completions", json=self.body(messages),
                                               timeout=REQUEST_TIMEOUT_S)
            except (requests.ConnectionError, requests.Timeout) as e:
                error = f"{type(e).__name__}: {e}"
            else:
                if response.ok:
                    return self.reply(response.json())
                if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
                    raise Rejected(f"HTTP {response.status_code}: {response.text[:200]}")
                error = f"HTTP {response.status_code}: {response.text[:200]}"
            time.sleep(min(2**attempt, 30))
        raise RuntimeError(f"{self.base}/v1/chat/completions failed {RETRIES} times, last: {error}")

    @staticmethod
    def reply(data: dict) -> Reply:
        """``finish_reason == "length"`` is a reply that broke off at ``max_tokens``."""
        choice = data["choices"][0]
        tokens = (data.get("usage") or {}).get("completion_tokens", 0)
        return Reply(choice["message"].get("content") or "", tokens, choice.get("finish_reason") != "length")


def converse(server: Server, conversation: Conversation) -> Conversation:
    """Every reply of one record, in order, each with the ones before as context."""
    while not conversation.done:
        try:
            conversation.add(server.chat(conversation.prompt()))
        except Rejected as e:
            conversation.skip(f"rejected: {e}")
    return conversation


def regenerate_server(server: Server, work: Work, concurrency: int, writer: ShardWriter, *, progress: Progress
                      ) -> int:
    """Records in a pool of ``concurrency`` threads (the server batches them), written as
    they finish. A failure cancels what has not started. Returns the tokens generated."""
    tokens = 0
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="regenerate")
    try:
        futures = [pool.submit(converse, server, c) for window in work.windows.values() for c in window]
        for future in as_completed(futures):
            conversation = future.result()
            writer.write([conversation])
            tokens += conversation.tokens
            progress.update(1, conversation.tokens)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return tokens


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def sampling_of(args: argparse.Namespace, cfg: DictConfig) -> Sampling:
    kwargs = OmegaConf.to_container(cfg.data.get("chat_template_kwargs") or OmegaConf.create({}))
    return Sampling(args.max_new_tokens, args.temperature, args.top_p, kwargs, args.seed)


def settings_of(args: argparse.Namespace, cfg: DictConfig, sampling: Sampling) -> dict:
    """What a restart must keep: the data, the model and how replies are drawn."""
    model = {"server": args.server, "model": args.model} if args.server else {"target": str(cfg.target.path)}
    return {"data": OmegaConf.to_container(cfg.data.path) if OmegaConf.is_config(cfg.data.path) else cfg.data.path,
            **model, "max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "chat_template_kwargs": dict(sampling.template_kwargs), "seed": sampling.seed}


def load_local(cfg: DictConfig, sampling: Sampling) -> LocalTarget:
    """The target in bf16 on this rank's GPU, or in fp32 on the CPU."""
    source = target_source(cfg)
    if source.is_random:
        raise ValueError("target.path=random has random weights, whose replies are no data: it serves --throughput only")
    device, dtype = pick_device()
    model, tokenizer = source.load(device, dtype)
    return LocalTarget(model, tokenizer, sampling)


def regenerate(args: argparse.Namespace, cfg: DictConfig) -> dict | None:
    """This rank's shard, then (rank 0, once every rank is done) the merge and the summary."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo", timeout=MERGE_WAIT)
    out = Path(args.out)
    directory = parts_dir(out)
    sampling = sampling_of(args, cfg)
    done = finished_keys(directory)
    work = find_work(cfg.data.path, cfg.data.max_samples, args.batch_size * args.window, rank, world=world, done=done)
    check_settings(directory, settings_of(args, cfg, sampling))  # after the input proved readable
    log.info("rank %d of %d: %d records, %d done before, %d to regenerate here, %d unreadable", rank, world,
             len(work.keys), len(done & set(work.keys)), work.pending, len(work.skipped))
    writer = ShardWriter(directory / f"rank{rank}-of-{world}.jsonl")
    writer.write(work.skipped)
    progress = Progress(work.pending, "regenerate" if world == 1 else f"rank 0 of {world}", enabled=rank == 0)
    began = time.perf_counter()
    try:
        if work.pending == 0:
            tokens = 0
        elif args.server:
            tokens = regenerate_server(Server(args.server, args.model, sampling), work, args.concurrency, writer,
                                       progress=progress)
        else:
            tokens = regenerate_local(load_local(cfg, sampling), work, args.batch_size, sampling.seed, writer=writer,
                                      progress=progress)
    finally:
        progress.close()
        writer.close()
    run = torch.tensor([tokens, time.perf_counter() - began], dtype=torch.float64)
    if world > 1:  # every shard is written once this returns
        dist.all_reduce(run[:1])
        dist.all_reduce(run[1:], op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
    if rank:
        return None
    summary = merge(work.keys, directory, out, args.keep_truncated)
    summary.update(run_tokens=int(run[0]), run_s=round(float(run[1]), 2))
    return summary


def format_summary(s: dict) -> str:
    skipped = sum(s["skipped"].values())
    reasons = ", ".join(f"{k}: {v}" for k, v in s["skipped"].items())
    fate = "kept" if s["keep_truncated"] else "dropped; --keep-truncated keeps them"
    lines = [
        f"records read:      {s['records']}",
        f"regenerated:       {s['regenerated']}",
        f"skipped:           {skipped}" + (f" ({reasons})" if reasons else ""),
        f"truncated:         {s['truncated']} ({fate})",
        f"tokens generated:  {s['tokens']}",
    ]
    if "run_tokens" in s:
        rate = s["run_tokens"] / s["run_s"] if s["run_s"] else 0.0
        lines.append(f"this run:          {s['run_tokens']} tokens in {s['run_s']:.1f} s, {rate:.1f} tokens/s")
    lines.append(f"wrote {s['written']} conversations to {s['out']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Throughput
# ---------------------------------------------------------------------------


def throughput_source(cfg: DictConfig, seed: int) -> TargetSource:
    """The configured target, or random weights at the preset's shape when no path is set."""
    target = cfg.target
    path = RANDOM if OmegaConf.is_missing(target, "path") else target.path
    return TargetSource(path, target.trust_remote_code, target.get("shape"), seed)


def throughput(cfg: DictConfig, prompts: int, batch_size: int, prompt_len: int, *, sampling: Sampling) -> dict:
    """Generation throughput on random-token prompts: no tokenizer, exactly
    ``max_new_tokens`` per prompt (the end-of-turn token is held back), so random
    weights at a preset's shape measure what a real target of that shape would."""
    source = throughput_source(cfg, sampling.seed)
    device, dtype = pick_device()
    model, _ = source.load(device, dtype)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(vocab, (prompts, prompt_len), generator=torch.Generator().manual_seed(sampling.seed))
    config = generation_config(model, sampling, model.generation_config.eos_token_id, 0)
    config.min_new_tokens = sampling.max_new_tokens

    def run(batch: torch.Tensor, config: GenerationConfig) -> int:
        batch = batch.to(device)
        with torch.inference_mode(), decoding_attention():
            out = model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), generation_config=config)
        return out[:, batch.shape[1] :].numel()

    warm = copy.deepcopy(config)
    warm.update(max_new_tokens=2, min_new_tokens=2)
    run(ids[:batch_size], warm)  # kernels chosen and memory pooled before the clock starts
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    began = time.perf_counter()
    generated = sum(run(ids[i : i + batch_size], config) for i in range(0, prompts, batch_size))
    synchronize(device)
    seconds = time.perf_counter() - began
    return {
        "target": cfg.target.name, "path": source.path,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "transformers": transformers.__version__,
        "prompts": prompts, "batch_size": batch_size, "prompt_len": prompt_len,
        "new_tokens": sampling.max_new_tokens, "do_sample": bool(config.do_sample),
        "generated_tokens": generated, "wall_s": round(seconds, 3),
        "tokens_per_s": round(generated / seconds, 1), "prompts_per_s": round(prompts / seconds, 3),
        "peak_gib": peak_memory_gib(device),
    }


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dflash.regenerate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides: target=..., target.path=..., data.path=...")
    ap.add_argument("--out", help="the regenerated JSONL; shards and progress go to <out>.parts/")
    ap.add_argument("--temperature", type=float, default=None, help="0: greedy; default: the target's generation config")
    ap.add_argument("--top-p", type=float, default=None, help="default: the target's generation config")
    ap.add_argument("--max-new-tokens", type=int, default=2048, help="per reply; a longer one is truncated")
    ap.add_argument("--batch-size", type=int, default=64, help="prompts per generate call (local target)")
    ap.add_argument("--window", type=int, default=16,
                    help="batches whose prompts are sorted by length together; also the unit of a rank's shard")
    ap.add_argument("--thinking", choices=["on", "off"], default=None,
                    help="data.chat_template_kwargs.enable_thinking, for templates that read it (Qwen3)")
    ap.add_argument("--keep-truncated", action="store_true",
                    help="keep replies that reached --max-new-tokens without the end-of-turn token")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (local target)")
    ap.add_argument("--server", default=None, help="URL of an OpenAI-compatible server (vLLM, SGLang) to ask instead")
    ap.add_argument("--model", default=None, help="model name on the server; default: the first it lists")
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight to the server")
    ap.add_argument("--merge", action="store_true", help="only write --out from finished shards")
    ap.add_argument("--throughput", type=int, default=0, metavar="N",
                    help="instead, time generation from N random-token prompts at the target's shape")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of --throughput")
    args = ap.parse_intermixed_args(argv)
    if not args.throughput and not args.out:
        ap.error("--out is required")
    return args


def config_of(args: argparse.Namespace) -> DictConfig:
    """The Hydra config of the overrides, with ``--thinking`` as a template argument."""
    cfg = compose_config(["wandb.mode=disabled", *args.overrides])
    if args.thinking is not None:
        with open_dict(cfg):
            if cfg.data.get("chat_template_kwargs") is None:
                cfg.data.chat_template_kwargs = {}
            cfg.data.chat_template_kwargs.enable_thinking = args.thinking == "on"
    return cfg


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = config_of(args)
    if (args.throughput or args.merge) and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise SystemExit("--throughput and --merge run in one process, not under torchrun")
    if args.throughput:
        report = throughput(cfg, args.throughput, args.batch_size, args.prompt_len, sampling=sampling_of(args, cfg))
        print(json.dumps(report, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        return report
    if args.merge:
        keys = [key for _, key, _ in keyed_records(cfg.data.path, cfg.data.max_samples)]
        summary = merge(keys, parts_dir(Path(args.out)), Path(args.out), args.keep_truncated)
    else:
        summary = regenerate(args, cfg)
    if summary is not None:
        print(format_summary(summary))
    return summary


if __name__ == "__main__":
    main()
