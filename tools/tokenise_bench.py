"""Tokenisation throughput and the cache's warm start, on a synthetic chat file.

    python tools/tokenise_bench.py [--samples 100000] [--work DIR]

Writes ``--samples`` conversations of the demo's counting task to one JSONL file,
then loads it twice through ``dflash.data.dataset.load_dataset`` with one cache
directory: the first load tokenises, checks and caches (cold), the second reads
the cache (warm). Prints one JSON line with both times.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from dflash.data.dataset import DataSettings, load_dataset
from dflash.model.target import resolve_path


def write_conversations(path: Path, count: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as fh:
        for _ in range(count):
            first = rng.randint(1, 400)
            last = first + rng.randint(5, 60)
            reply = " ".join(map(str, range(first, last + 1)))
            turns = [{"role": "user", "content": f"count from {first} to {last}"}, {"role": "assistant", "content": reply}]
            fh.write(json.dumps({"conversations": turns}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--work", default=None, help="directory for the file and the cache (default: a temp dir)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="dflash-tokenise-"))
    work.mkdir(parents=True, exist_ok=True)
    data, cache = work / f"chat_{args.samples}.jsonl", work / "cache"
    if not data.is_file():
        write_conversations(data, args.samples)
    shutil.rmtree(cache, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(resolve_path("demo"))
    times = []
    for _ in range(2):
        began = time.perf_counter()
        dataset = load_dataset(DataSettings(str(data), 320, 2, cache_dir=cache), tokenizer)
        times.append(time.perf_counter() - began)
    print(json.dumps({
        "samples": args.samples, "kept": len(dataset), "cold_s": round(times[0], 2),
        "tokenise_samples_per_s": round(args.samples / times[0]), "warm_s": round(times[1], 2),
        "cache_mb": round(sum(f.stat().st_size for f in cache.iterdir()) / 1e6, 1),
    }))


if __name__ == "__main__":
    main()
