"""``--decode NxM``: what an evaluation decodes, timed: N random prompts, M new tokens each,
speculative with a random drafter in batches and at batch 1, and the plain greedy baseline."""

from __future__ import annotations

import logging

import torch

from dflash.bench.timing import profile_table
from dflash.decode.batch import (
    default_batch_size,
    greedy_batch_steps,
    speculative_batch_steps,
)
from dflash.decode.evaluate import tau
from dflash.decode.speculative import run_to_end
from dflash.decode.speed import timed_decode
from dflash.model.drafter import DFlashDrafter, TargetHead
from dflash.model.target import random_target
from dflash.run.build import (
    Job,
)

log = logging.getLogger("dflash.bench")


def parse_decode(spec: str) -> list[tuple[int, int]]:
    """``"64x256,32x2048"`` as [(prompts, new tokens), ...]."""
    try:
        return [(int(n), int(m)) for n, m in (part.split("x") for part in spec.split(","))]
    except ValueError:
        raise SystemExit(f"--decode takes PROMPTSxNEW_TOKENS[,...], e.g. 64x256, not {spec!r}") from None


def run_decode(job: Job, specs: list[tuple[int, int]], batch_one: int = 2, profile: int = 0) -> dict:
    """Decoding speed at the target's shapes: per spec, the speculative decoding of the
    prompts (``eval.batch_size`` at a time), the first ``batch_one`` of them at batch 1
    (the loop before batching), and the plain greedy baseline in batches. ``profile > 0``:
    then one batch of the last spec's prompts, ``profile`` new tokens each, speculative and
    greedy, under the torch profiler."""
    device, dtype = job.device, job.dtype
    model = random_target(job.target_config, device, dtype, job.plan.seed)
    head = TargetHead.of(model)
    torch.manual_seed(job.plan.seed)
    with torch.device(device):
        drafter = DFlashDrafter(job.drafter)
    drafter.reset_parameters(job.cfg.drafter.init_std)
    drafter = drafter.to(dtype).eval().requires_grad_(False)
    batch_size = int(job.cfg.eval.batch_size or default_batch_size(device))
    generator = torch.Generator().manual_seed(job.plan.seed)
    rows = []
    for prompts, new_tokens in specs:
        lengths = torch.randint(64, 513, (prompts,), generator=generator).tolist()
        ids = [torch.randint(0, head.vocab_size, (1, n), generator=generator).to(device) for n in lengths]

        def speculative(batch: int, count: int) -> dict:
            decoded, seconds = timed_decode(speculative_batch_steps(
                model, drafter, head, ids[:count], max_new_tokens=new_tokens, batch_size=batch), device)
            cycles = sum(len(a) for _, a in decoded)
            tokens = sum(len(t) for t, _ in decoded)
            return {"role": "decode", "mode": f"speculative, batch {batch}", "prompts": count,
                    "new_tokens": tokens, "cycles": cycles, "wall_s": round(seconds, 2),
                    "tokens_per_s": round(tokens / seconds), "tau": round(tau([a for _, a in decoded]), 3),
                    "outputs": [t for t, _ in decoded]}

        run_to_end(speculative_batch_steps(model, drafter, head, ids[:2], max_new_tokens=2, batch_size=2))  # kernels
        batched = speculative(batch_size, prompts)
        single = speculative(1, min(batch_one, prompts)) if batch_one else None
        baseline, seconds = timed_decode(greedy_batch_steps(model, ids, new_tokens, batch_size=batch_size), device)
        tokens = sum(map(len, baseline))
        outputs = batched.pop("outputs")
        batched["evaluation_s"] = round(batched["wall_s"] + seconds, 2)
        if single:
            single.pop("outputs")
            rows.append(single)
        rows += [batched, {
            "role": "decode", "mode": f"greedy baseline, batch {batch_size}", "prompts": prompts,
            "new_tokens": tokens, "wall_s": round(seconds, 2), "tokens_per_s": round(tokens / seconds),
            "lossless_prompts": sum(a == b for a, b in zip(outputs, baseline)),
        }]
        log.info("%s", rows[-2:])
    report = {"decode": rows, "target": job.cfg.target.name, "dtype": str(dtype).removeprefix("torch."),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    if profile:
        batch = ids[:batch_size]
        speculative_table = profile_table(lambda: run_to_end(speculative_batch_steps(
            model, drafter, head, batch, max_new_tokens=profile, batch_size=batch_size)), device, calls=1)
        greedy_table = profile_table(lambda: run_to_end(greedy_batch_steps(
            model, batch, profile, batch_size=batch_size)), device, calls=1)
        report["profile"] = f"speculative decoding:\n{speculative_table}\ngreedy baseline:\n{greedy_table}"
    return report


def format_decode(report: dict) -> str:
    lines = [f"decoding, {report['target']} (random weights, {report['dtype']}) and a random drafter on "
             f"{report['device']} (torch {report['torch']})"]
    for r in report["decode"]:
        extra = "".join(f", {k} {r[k]}" for k in ("cycles", "tau", "evaluation_s", "lossless_prompts") if k in r)
        lines.append(f"  {r['mode']}: {r['prompts']} prompts, {r['new_tokens']} new tokens in {r['wall_s']} s, "
                     f"{r['tokens_per_s']} tokens/s{extra}")
    return "\n".join(lines)
