"""Serve a drafter in vLLM or SGLang and put the engine's acceptance next to dflash.eval's.

    python tools/serve_check.py --engine vllm DRAFTER TARGET [--eval-report eval.json]

Starts the engine's OpenAI-compatible server with DRAFTER as its DFlash speculative
model, sends a few greedy prompts (the first turns of the benchmark sets, built as z-lab's
harness builds them), reads the engine's acceptance and prints it next to the tau of a
``dflash.eval --sets`` report on the same sets. A large gap means the engine runs the
drafter differently from this project (layer ids, mask token, attention), not a worse
drafter. Without the engine installed it says so and exits 0.

Written for vLLM 0.25 or newer (``--speculative-config '{"method": "dflash", ...}'``;
acceptance from the Prometheus counters ``vllm:spec_decode_num_drafts`` and
``vllm:spec_decode_num_accepted_tokens`` on ``/metrics``: 1 + accepted / drafts) and for
SGLang with DFlash (``--speculative-algorithm DFLASH``, z-lab pins PR 23000; acceptance from
``meta_info.spec_accept_length`` of each ``/generate`` reply, averaged over requests as
z-lab's harness does).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ENGINES = ("vllm", "sglang")


def engine_installed(engine: str) -> bool:
    """Whether the engine's package can be imported here (without importing it: both pull
    in CUDA at import)."""
    return importlib.util.find_spec(engine) is not None


def block_size(drafter: str) -> int:
    """The drafter's block size: the engines draft ``block_size - 1`` tokens per cycle."""
    config = json.loads((Path(drafter) / "config.json").read_text())
    return int(config.get("block_size") or config.get("dflash_config", {}).get("block_size") or 16)


def server_command(engine: str, drafter: str, target: str, port: int, extra: list[str]) -> list[str]:
    """The command line that serves ``target`` with ``drafter`` as its DFlash drafter."""
    block = block_size(drafter)
    if engine == "vllm":
        spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": block - 1}
        return ["vllm", "serve", target, "--port", str(port), "--speculative-config", json.dumps(spec), *extra]
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", target, "--port", str(port),
            "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", drafter,
            "--speculative-num-draft-tokens", str(block), "--trust-remote-code", *extra]


def request(url: str, body: dict | None = None, timeout: float = 600) -> bytes:
    """GET (no body) or POST JSON; the response body."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return response.read()


def wait_ready(base: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Until ``/health`` answers; fails when the server exits or the time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was ready")
        try:
            request(base + "/health", timeout=5)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(5)
    raise TimeoutError(f"the server was not ready after {timeout_s:.0f} s")


def vllm_counters(base: str) -> dict[str, float]:
    """The speculative-decoding counters of vLLM's ``/metrics`` (summed over labels)."""
    counters: dict[str, float] = {}
    for line in request(base + "/metrics").decode().splitlines():
        match = re.match(r"vllm:spec_decode_num_(drafts|accepted_tokens)(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$",
                         line)
        if match:
            counters[match.group(1)] = counters.get(match.group(1), 0.0) + float(match.group(2))
    return counters


def vllm_acceptance(base: str, model: str, prompts: list[str], max_tokens: int, thinking: bool) -> float | None:
    """Mean tokens per verification over the prompts, from the counters' difference."""
    before = vllm_counters(base)
    for prompt in prompts:
        request(base + "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": thinking}})
    after = vllm_counters(base)
    drafts = after.get("drafts", 0.0) - before.get("drafts", 0.0)
    accepted = after.get("accepted_tokens", 0.0) - before.get("accepted_tokens", 0.0)
    return 1 + accepted / drafts if drafts else None


def sglang_acceptance(base: str, tokenizer_dir: str, prompts: list[str], max_tokens: int, thinking: bool
                      ) -> float | None:
    """Mean over requests of SGLang's per-request acceptance length."""
    from transformers import AutoTokenizer

    from dflash.decode.public_sets import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    lengths = []
    for prompt in prompts:
        text = render_prompt(tokenizer, [{"role": "user", "content": prompt}], thinking)
        out = json.loads(request(base + "/generate", {
            "text": text, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens}}))
        meta = (out[0] if isinstance(out, list) else out).get("meta_info") or {}
        if "spec_accept_length" in meta:
            lengths.append(float(meta["spec_accept_length"]))
    return sum(lengths) / len(lengths) if lengths else None


def first_turns(sets: str, sets_dir: str | None, per_set: int) -> dict[str, list[str]]:
    """The first user turn of the first ``per_set`` rows of each set (no shuffle)."""
    from dflash.decode.public_sets import PUBLIC_SETS, load_rows, parse_sets

    return {name: [PUBLIC_SETS[name].turns(row)[0] for row in load_rows(name, source)[:per_set]]
            for name, source in parse_sets(sets, sets_dir).items()}


def report_line(name: str, engine: float | None, ours: float | None) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    return f"{name:<12} {fmt(engine):>8} {fmt(ours):>12}"


def check(args: argparse.Namespace) -> list[str]:
    """Serve, measure every set, stop the server; the table's lines."""
    base = f"http://127.0.0.1:{args.port}"
    ours = json.loads(Path(args.eval_report).read_text())["results"] if args.eval_report else {}
    prompts = first_turns(args.sets, args.sets_dir, args.prompts)
    process = subprocess.Popen(server_command(args.engine, args.drafter, args.target, args.port, args.engine_args))
    try:
        wait_ready(base, process, args.startup_timeout)
        lines = [f"{'set':<12} {args.engine:>8} {'dflash.eval':>12}"]
        for name, texts in prompts.items():
            if args.engine == "vllm":
                engine = vllm_acceptance(base, args.target, texts, args.max_new_tokens, args.enable_thinking)
            else:
                engine = sglang_acceptance(base, args.target, texts, args.max_new_tokens, args.enable_thinking)
            lines.append(report_line(name, engine, ours.get(name, {}).get("tau")))
        return lines
    finally:
        process.terminate()
        process.wait(timeout=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=ENGINES, required=True)
    ap.add_argument("drafter", help="drafter directory in the z-lab layout")
    ap.add_argument("target", help="the target's local HF directory (also its tokenizer)")
    ap.add_argument("--eval-report", default=None, help="a dflash.eval --sets report to put next to the engine's")
    ap.add_argument("--sets", default="gsm8k,math500,humaneval,mbpp,mt-bench")
    ap.add_argument("--sets-dir", default=None, help="read each set from <dir>/<name>.jsonl instead of the hub")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--enable-thinking", action="store_true")
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--startup-timeout", type=float, default=1800)
    ap.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[],
                    help="the rest of the line goes to the engine's server as it is")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not engine_installed(args.engine):
        print(f"serve check skipped: {args.engine} is not installed in this environment "
              f"({sys.executable}); install it (see the docstring for the versions) to compare its acceptance")
        return 0
    print("\n".join(check(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
