"""Real acceptance while training: speculative decoding with the drafter's current weights.

Every ``eval.every`` optimizer steps the drafter's weights are copied, cast to the
target's dtype (what the export would hold), and run through :mod:`dflash.decode.speculative`'s
decoding loop on the held-out prompts: greedy (``tau``, ``lossless``, the
acceptance histogram) and, with ``eval.temperature``, sampled. The record goes to
``metrics.jsonl`` and W&B beside that step's ``tau_sim``, so a drafter that looks
good in training but accepts little at serving time shows at once.

Where it runs:

* colocated, in process, between two steps;
* disaggregated, on target rank 0. The first drafter rank sends the weights over a
  dedicated link (its own communicator, so the transfer can never queue behind a
  bundle) and goes on training. Target rank 0 receives them before its next
  micro-batch and decodes in slices of one batched drafting cycle, only while it waits for
  its drafters to take a bundle, so the drafters lose no more than the copy of the
  weights. The record comes back through the control store. On the CPU, where a
  gloo send cannot be polled, target rank 0 decodes at once when the weights
  arrive and the drafters wait for it.

A target rank that never waits (the target side is the bottleneck) gets through
its evaluation after its data ends; until then later evaluations are skipped and
counted, never queued.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedTokenizerBase

from dflash.decode.baseline import GreedyBaselines
from dflash.decode.evaluate import encode_prompt, evaluate_steps, load_prompts
from dflash.decode.speculative import DecodeSettings, decoding_attention, run_to_end
from dflash.distributed.protocol import Protocol
from dflash.model.drafter import DFlashDrafter, DrafterConfig, TargetHead
from dflash.model.target import Target

log = logging.getLogger(__name__)

SLOW_SLICE_MS = 250.0  # a slice this long holds up the target's next prefill: each is logged
OFFER_CHECK_S = 0.01  # while target rank 0 waits on its sends, how often it looks for weights offered


@dataclass(frozen=True)
class LiveEvalSettings:
    """Evaluations while training: every ``every`` steps, the held-out prompts decoded as
    ``decode`` says (at each of its temperatures)."""

    every: int
    prompts_path: str
    decode: DecodeSettings
    baseline_path: str | None = None  # the plain greedy outputs, kept across a resume (dflash.decode.baseline)

    def due(self, step: int, total_steps: int) -> bool:
        """After this step? The last step is left to the evaluation of the export."""
        return step % self.every == 0 and step < total_steps


def check_held_out_prompts(prompts_path: str, tokenizer: PreTrainedTokenizerBase | None,
                           template_kwargs: dict) -> None:
    """Read and encode the first held-out prompt at start, on the rank that evaluates:
    otherwise a wrong ``data.eval_path``, or a tokenizer that cannot render it, fails
    only at the export's evaluation, after training."""
    if tokenizer is None:
        raise ValueError("data.eval_path needs a tokenizer to encode its prompts and this target has none (a random "
                         "target): set target.tokenizer (e.g. target.tokenizer=demo) or eval.enabled=false")
    encode_prompt(tokenizer, load_prompts(prompts_path, 1)[0], template_kwargs)


def flat_weights(drafter: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """Every parameter, cast to ``dtype`` and concatenated, in ``parameters()`` order."""
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1).to(dtype) for p in drafter.parameters()])


class Evaluator:
    """Holds a decoding copy of the drafter next to the target and evaluates it in
    slices: :meth:`advance` does one prompt's prefill, one drafting cycle of the batch
    (:mod:`dflash.decode.batch`) or one baseline step of the batch."""

    def __init__(self, target: Target, tokenizer: PreTrainedTokenizerBase, head: TargetHead, config: DrafterConfig,
                 settings: LiveEvalSettings):
        self.target, self.tokenizer, self.head, self.settings = target, tokenizer, head, settings
        self.prompts = load_prompts(settings.prompts_path, settings.decode.max_prompts)
        weight = head.embed_weight
        with torch.device(weight.device):  # its weights arrive with each evaluation: no host init of 1B parameters
            drafter = DFlashDrafter(config)
        self.drafter = drafter.to(weight.dtype).eval().requires_grad_(False)
        self.job: Generator[str, None, dict] | None = None
        self.last_slice = ""  # what the latest slice ran
        self.step = 0
        self.began = 0.0
        self.baselines = GreedyBaselines(settings.baseline_path)  # the frozen target's: decoded once

    @property
    def busy(self) -> bool:
        return self.job is not None

    def buffer(self) -> torch.Tensor:
        """Where the weights land: one element per parameter of the decoding copy."""
        weight = self.head.embed_weight
        size = sum(p.numel() for p in self.drafter.parameters())
        return torch.empty(size, dtype=weight.dtype, device=weight.device)

    def start(self, step: int, flat: torch.Tensor) -> None:
        torch.nn.utils.vector_to_parameters(flat, self.drafter.parameters())
        self.step, self.began, self.job = step, time.perf_counter(), self._run()

    def _run(self) -> Generator[str, None, dict]:
        results = yield from self._decode(self.settings.decode.max_new_tokens, self.baselines)
        return eval_record(self.step, results, time.perf_counter() - self.began)

    def _decode(self, max_new_tokens: int, baselines: GreedyBaselines) -> Generator[str, None, list[dict]]:
        """Every held-out prompt at every temperature, up to ``max_new_tokens`` each."""
        settings = replace(self.settings.decode, max_new_tokens=max_new_tokens)
        results = []
        for t in settings.temperatures:
            results.append((yield from evaluate_steps(
                self.target.model, self.tokenizer, self.drafter, self.head, prompts=self.prompts, settings=settings,
                temperature=t, baselines=baselines,
            )))
        return results

    def warm(self) -> float:
        """Decode every held-out prompt for two tokens, with whatever weights the copy
        holds, before any bundle is in flight; returns the seconds it took.

        On a GPU the first launch of a kernel (lazily loaded) and a library's first use
        at a new shape wait for every send in flight, and a target rank's sends stay in
        flight until a drafter takes them: each such first use cost about 1 s on two
        H200s (``tools/pending_send_probe.py``). An evaluation's eager decoding runs
        kernels that training never does; here they are loaded while nothing is in
        flight. The prefills are the shapes every evaluation runs, and one batched
        drafting cycle and one baseline step per batch load the attention and GEMM
        kernels of the cycles. Attention plans per key length are what it cannot cover; decoding
        avoids them (:func:`dflash.eval.decoding_attention`). The plain greedy outputs
        this decodes are cut short: not kept."""
        began = time.perf_counter()
        with self.target.eager():
            run_to_end(self._decode(2, GreedyBaselines()))
        return time.perf_counter() - began

    def advance(self) -> dict | None:
        """One slice of the running evaluation, on the eager target (decoding shapes change
        every call; the compiled prefill layers are kept for training). Returns the
        record when the evaluation ends."""
        with self.target.eager(), decoding_attention():
            try:
                self.last_slice = next(self.job)
            except StopIteration as done:
                self.job, self.last_slice = None, "wrap-up"
                return done.value
        return None

    def run(self, step: int, flat: torch.Tensor, interrupted: Callable[[], bool]) -> dict | None:
        """A whole evaluation at once (colocated); ``None`` when ``interrupted()`` turns
        true on the way, so that a SIGTERM reaches its checkpoint before the grace
        period ends, not after the evaluation."""
        self.start(step, flat)
        while (record := self.advance()) is None:
            if interrupted():
                self.abandon()
                return None
        return record

    def abandon(self) -> None:
        """Drop the running evaluation."""
        log.warning("the evaluation of step %d is abandoned: the run is stopping", self.step)
        self.job.close()
        self.job = None


def eval_record(step: int, results: list[dict], seconds: float) -> dict:
    """The metrics of one evaluation: greedy first, then each sampled temperature."""
    greedy = results[0]
    record = {
        "step": step,
        "eval/tau": greedy["tau"],
        "eval/lossless": greedy["lossless"],
        "eval/new_tokens": greedy["new_tokens"],
        "eval/cycles": greedy["cycles"],
        "eval/s": round(seconds, 2),
        **{f"eval/hist_{k}": n for k, n in greedy["histogram"].items()},
        "eval/divergent_prompts": len(greedy["divergences"]),
    }
    if greedy["divergences"]:
        record["eval/divergence_margin"] = max(abs(d["margin"]) for d in greedy["divergences"])
    for r in results[1:]:
        record[f"eval/tau@{r['temperature']:g}"] = r["tau"]
    return record


class LocalEval:
    """Colocated: evaluate in process after every ``every``-th step."""

    def __init__(self, evaluator: Evaluator, total_steps: int):
        self.evaluator, self.total_steps = evaluator, total_steps

    def after_step(self, step: int, drafter: nn.Module, interrupted: Callable[[], bool]) -> list[dict]:
        if not self.evaluator.settings.due(step, self.total_steps) or interrupted():
            return []
        flat = flat_weights(drafter, self.evaluator.head.embed_weight.dtype)
        record = self.evaluator.run(step, flat, interrupted)
        return [] if record is None else [record]


class RemoteEval:
    """The first drafter rank's side: hand the weights to target rank 0 and collect
    the records it posts back."""

    def __init__(self, proto: Protocol, settings: LiveEvalSettings, dtype: torch.dtype, total_steps: int):
        self.proto, self.settings, self.dtype, self.total_steps = proto, settings, dtype, total_steps
        self.pending: int | None = None
        self.sending: tuple[dist.Work, torch.Tensor] | None = None
        self.skipped = 0
        self.handoff_ms = 0.0  # of the evaluation pending

    def after_step(self, step: int, drafter: nn.Module, interrupted: Callable[[], bool]) -> list[dict]:
        """Collect a finished evaluation and hand off the next one when due, unless the
        run is stopping (target rank 0 abandons a running evaluation itself)."""
        records = self._collect()
        if self.settings.due(step, self.total_steps) and not interrupted():
            if self.pending is not None:
                self.skipped += 1
                log.warning("step %d: the evaluation of step %d is still running on target rank 0; skipped (%d so far)",
                            step, self.pending, self.skipped)
            else:
                self._hand_off(step, drafter)
        return records

    def _hand_off(self, step: int, drafter: nn.Module) -> None:
        began = time.perf_counter()
        flat = flat_weights(drafter, self.dtype)
        work = dist.isend(flat, dst=0, group=self.proto.eval_link)
        self.proto.request_eval(step)
        self.sending, self.pending = (work, flat), step
        self.handoff_ms = 1e3 * (time.perf_counter() - began)

    def _collect(self) -> list[dict]:
        if self.pending is None:
            return []
        record = self.proto.eval_result(self.pending)
        if record is None:
            return []
        self.sending[0].wait()  # long done: target rank 0 took these weights
        self.sending = self.pending = None
        if record.get("abandoned"):
            log.warning("the evaluation of step %d was abandoned on target rank 0 (SIGTERM)", record["step"])
            return []
        record["eval/handoff_ms"] = round(self.handoff_ms, 2)
        return [record]

    def finish(self, completed: bool) -> list[dict]:
        """After the last step: wait for the evaluation still running, if any. A run
        that stopped early (SIGTERM) does not wait: target rank 0 abandons it, after
        taking the weights, which completes this rank's send."""
        if self.pending is None:
            return []
        if not completed:
            with self.proto.phase("handing the last weights to target rank 0", self.proto.timeouts.step_s, [0]):
                self.sending[0].wait()
            log.warning("the evaluation of step %d is abandoned: the run stopped", self.pending)
            self.sending = self.pending = None
            return []
        with self.proto.phase(f"waiting for the evaluation of step {self.pending} on target rank 0",
                              self.proto.timeouts.warmup_s, [0]):
            records = self._collect()
            while self.pending is not None:  # a record, or word that it was abandoned
                time.sleep(0.05)
                records = self._collect()
        return records


class EvalServer:
    """Target rank 0's side: receive weights as soon as they are offered; decode only
    when there is nothing else to do (``sliced``), or at once."""

    def __init__(self, proto: Protocol, evaluator: Evaluator, sliced: bool):
        self.proto, self.evaluator, self.sliced = proto, evaluator, sliced
        self.handled = 0
        self.eval_s = 0.0
        self.warm_s = 0.0
        self.slice_max_ms = 0.0  # the running evaluation's longest slice: the most it delayed a prefill
        self.slice_max_at = ""  # and what ran in it
        self.interrupted = False  # SIGTERM: decode nothing more
        self.next_offer_check = 0.0  # time.monotonic() of the next look for offered weights in idle()

    def warm(self) -> None:
        """Before the first bundle: :meth:`Evaluator.warm`."""
        self.warm_s = self.evaluator.warm()
        log.info("evaluation warm-up: %d held-out prompts decoded in %.1f s", len(self.evaluator.prompts), self.warm_s)

    def interrupt(self) -> None:
        """From the SIGTERM handler: only a flag; the running evaluation is dropped at
        the next slice."""
        self.interrupted = True

    def _abandon(self) -> None:
        """Drop the running evaluation and say so to the drafter that waits for it."""
        step = self.evaluator.step
        self.evaluator.abandon()
        self.proto.post_eval_result({"step": step, "abandoned": True})

    def serve(self) -> None:
        """Before each micro-batch: take offered weights (a few ms); unless sliced,
        decode them at once."""
        self.receive()
        while not self.sliced and self.idle():
            pass

    def receive(self) -> None:
        """Take the weights offered, if any, and start their evaluation."""
        step = self.proto.eval_requested()
        if step is None or step == self.handled or self.evaluator.busy:
            return
        flat = self.evaluator.buffer()
        dist.recv(flat, src=self.proto.topo.metrics_rank, group=self.proto.eval_link)
        self.handled = step
        self.evaluator.start(step, flat)
        self.slice_max_ms, self.slice_max_at = 0.0, ""

    def idle(self) -> bool:
        """One slice while the target would wait; False when there is nothing to do
        (after a SIGTERM, the running evaluation is dropped instead).

        Weights offered meanwhile are taken first (every ``OFFER_CHECK_S``): this rank
        waits here for a drafter to take a bundle, and if that drafter is the metrics
        rank, its send of the weights stays pending on its GPU until this rank receives
        them. Whatever waits for that GPU's work there (the first launch of a kernel, a
        ``cudaFree``) would wait for this rank, which would wait for it."""
        if time.monotonic() >= self.next_offer_check:
            self.next_offer_check = time.monotonic() + OFFER_CHECK_S
            self.receive()
        if self.interrupted and self.evaluator.busy:
            self._abandon()
        if not self.evaluator.busy:
            return False
        began = time.perf_counter()
        record = self.evaluator.advance()
        seconds = time.perf_counter() - began
        self.eval_s += seconds
        ms = 1e3 * seconds
        if ms > SLOW_SLICE_MS:
            log.info("evaluation of step %d: a slice (%s) took %.0f ms", self.evaluator.step, self.evaluator.last_slice, ms)
        if ms > self.slice_max_ms:
            self.slice_max_ms, self.slice_max_at = ms, self.evaluator.last_slice
        if record is not None:
            log.info("evaluation of step %d done in %.1f s; its longest slice (%s) took %.0f ms", record["step"],
                     record["eval/s"], self.slice_max_at, self.slice_max_ms)
            record["eval/slice_max_ms"] = round(self.slice_max_ms, 2)
            self.proto.post_eval_result(record)
        return True

    def until_stopped(self, total_steps: int) -> None:
        """After the data ends: serve evaluations until the drafters stop. Then take
        the weights still on their way, if any (that completes the drafter's send), and
        finish the evaluation running so the drafters can collect it; a run that
        stopped early (SIGTERM) abandons it instead."""
        while not self.proto.stopped():
            self.receive()
            if not self.idle():
                time.sleep(0.01)
        self.receive()
        if self.evaluator.busy and self.proto.final_step() < total_steps:
            self._abandon()
        while self.idle():
            pass

