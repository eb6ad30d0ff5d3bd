"""The local engine: the target through transformers' ``generate``, in batches of prompts
sorted by length, seeded by their place so a sampled run is the same on any number of
ranks; and ``--throughput``, its tokens/s at random prompts."""

from __future__ import annotations

import copy
import logging
import time

import numpy as np
import torch
import transformers
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase

from dflash.data import template
from dflash.data.records import BadRecord
from dflash.decode.speculative import decoding_attention
from dflash.device import peak_memory_gib, pick_device, synchronize
from dflash.model.target import RANDOM, TargetSource
from dflash.regenerate.records import Conversation, Reply, Sampling, Work
from dflash.regenerate.shards import Progress, ShardWriter
from dflash.run.config import target_source

log = logging.getLogger("dflash.regenerate")


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


def load_local(cfg: DictConfig, sampling: Sampling) -> LocalTarget:
    """The target in bf16 on this rank's GPU, or in fp32 on the CPU."""
    source = target_source(cfg)
    if source.is_random:
        raise ValueError("target.path=random has random weights, whose replies are no data: it serves --throughput only")
    device, dtype = pick_device()
    model, tokenizer = source.load(device, dtype)
    return LocalTarget(model, tokenizer, sampling)


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
