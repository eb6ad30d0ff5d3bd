"""python -m dflash.regenerate: the demo target rewrites the replies of a prompt set into a
file training reads; restarts, ranks and the merge change nothing; a server works too."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from runs import run_colocated
from transformers import GenerationMixin

from dflash.data.dataset import DataSettings, load_dataset
from dflash.data.template import reply_end_ids
from dflash.decode.speculative import greedy_generate
from dflash.distributed.protocol import free_port, set_rank_env
from dflash.model.target import TargetSource
from dflash.regenerate.local import LocalTarget
from dflash.regenerate.records import Sampling, unique_key
from dflash.regenerate.run import main
from dflash.regenerate.shards import drop_partial_line, parts_dir

pytestmark = pytest.mark.usefixtures("one_thread")

OLD = "an old reply"
# Eight records in the shapes data.path reads; short answers keep the test fast.
RECORDS = [
    {"id": "a", "conversations": [{"role": "user", "content": "count from 5 to 9"}, {"role": "assistant", "content": OLD}]},
    {"id": "b", "messages": [{"role": "user", "content": "3 letters from c"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "times table of 2 from 1 to 3"},
                                  {"from": "gpt", "value": ""}]},
    {"id": "d", "prompt": "count from 12 to 15"},
    {"id": "e", "conversations": [{"role": "user", "content": "count from 5 to 9"}, {"role": "assistant", "content": OLD},
                                  {"role": "user", "content": "4 letters from x"}, {"role": "assistant", "content": OLD}]},
    {"id": "f", "prompt": "3 letters down from k", "response": OLD},
    {"id": "g", "messages": [{"role": "user", "content": "count from 30 to 34"}]},
    {"id": "h", "messages": [{"role": "user", "content": "times table of 3 from 2 to 4"}]},
]
ARGS = ["target=demo", "--batch-size", "2", "--window", "1", "--max-new-tokens", "40", "--temperature", "0"]


def write_prompts(path: Path, records=RECORDS, extra_lines: list[str] = ()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(line + "\n" for line in extra_lines))
    return path


def regenerate(data: Path, out: Path, *extra: str) -> dict:
    return main([f"data.path={data}", "--out", str(out), *ARGS, *extra])


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, Path]:
    """The prompts and one uninterrupted single-process run over them."""
    tmp = tmp_path_factory.mktemp("straight")
    data = write_prompts(tmp / "prompts.jsonl")
    summary = regenerate(data, tmp / "regen.jsonl")
    assert summary["records"] == summary["regenerated"] == summary["written"] == 8
    assert summary["truncated"] == 0 and summary["skipped"] == {} and summary["tokens"] == summary["run_tokens"] > 0
    return data, tmp / "regen.jsonl"


def test_replies_are_the_targets_own_and_the_file_trains(straight, tmp_path):
    _, out = straight
    rows = read(out)
    assert [r["id"] for r in rows] == [r["id"] for r in RECORDS]
    assert [[m["role"] for m in r["conversations"]] for r in rows][4] == ["user", "assistant"] * 2
    replies = [m["content"] for r in rows for m in r["conversations"] if m["role"] == "assistant"]
    assert len(replies) == 9 and OLD not in replies and all(replies)
    assert rows[0]["conversations"][1]["content"] == "5 6 7 8 9"

    # Each reply, batched with left padding, is the target's plain greedy reply in its context,
    # the second turn's context holding the regenerated first reply.
    model, tokenizer = TargetSource("demo").load(torch.device("cpu"), torch.float32)
    local = LocalTarget(model, tokenizer, Sampling(max_new_tokens=40, temperature=0))
    for row in rows:
        turns = row["conversations"]
        for i, turn in enumerate(turns):
            if turn["role"] == "assistant":
                prompt = torch.tensor([local.encode(turns[:i])])
                expected = greedy_generate(model, prompt, 40, reply_end_ids(tokenizer, model.generation_config))
                assert tokenizer.decode(expected[:-1]) == turn["content"]

    dataset = load_dataset(DataSettings(str(out), 512, 2, strict=True), tokenizer)
    assert len(dataset) >= 8 and not dataset.skipped
    metrics = run_colocated(tmp_path / "run", [f"data.path={out}", "train.max_steps=2"])
    assert metrics


def test_a_restart_neither_duplicates_nor_skips(straight, tmp_path, monkeypatch):
    data, reference = straight
    out = tmp_path / "regen.jsonl"
    generate, calls = LocalTarget.generate, []

    def crash_on_the_third_batch(self, prompts, seed):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise RuntimeError("killed")
        return generate(self, prompts, seed)

    monkeypatch.setattr(LocalTarget, "generate", crash_on_the_third_batch)
    with pytest.raises(RuntimeError, match="killed"):
        regenerate(data, out)
    monkeypatch.undo()
    shard = parts_dir(out) / "rank0-of-1.jsonl"
    assert len(read(shard)) == 4 and not out.exists()
    with open(shard, "ab") as fh:  # a kill in the middle of a write
        fh.write(b'{"key": "c", "index": 2, "sta')

    summary = regenerate(data, out)
    assert summary["run_tokens"] < summary["tokens"]
    keys = [e["key"] for e in read(shard)]
    assert sorted(keys) == sorted(r["id"] for r in RECORDS)
    assert out.read_bytes() == reference.read_bytes()


def test_sampled_batches_are_seeded_each_by_its_place_and_a_rerun_writes_the_same_file(tmp_path, monkeypatch):
    """At temperature 1 every batch of every (window, round) starts from a random state of
    its own, the second round of a two-turn conversation included, and a second run in the
    same process (its random state moved on) writes the same bytes."""
    data = write_prompts(tmp_path / "prompts.jsonl", [RECORDS[0], RECORDS[4], RECORDS[7]])
    states: list[bytes] = []
    generate = GenerationMixin.generate

    def recorded(self, *args, **kwargs):
        states.append(torch.get_rng_state().numpy().tobytes())
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", recorded)
    runs = []
    for run in ("first", "second"):
        out = tmp_path / run / "regen.jsonl"
        summary = regenerate(data, out, "--temperature", "1.0", "--top-p", "0.5", "--batch-size", "1", "--window", "2")
        assert summary["written"] == 3
        runs.append(out.read_bytes())
    assert runs[0] == runs[1]
    first = states[: len(states) // 2]
    # window 0 holds the first two records: two batches in round 0, the two-turn record alone in
    # round 1; window 1 holds the third: so the (window, round, batch) places are (0, 0, 0),
    # (0, 0, 1), (0, 1, 0) and (1, 0, 0), and leaving any of the three out repeats a seed
    assert len(first) == 4
    assert len(set(first)) == 4 and first == states[len(states) // 2 :]


def _rank(rank: int, port: int, argv: list[str]) -> None:
    set_rank_env(rank, 2, port, local=True)
    torch.set_num_threads(1)
    main(argv)


def test_two_ranks_merge_to_the_single_process_file(straight, tmp_path):
    data, reference = straight
    out = tmp_path / "regen.jsonl"
    argv = [f"data.path={data}", "--out", str(out), *ARGS]
    mp.start_processes(_rank, args=(free_port(), argv), nprocs=2, join=True, start_method="spawn")
    assert sorted(p.name for p in parts_dir(out).glob("*.jsonl")) == ["rank0-of-2.jsonl", "rank1-of-2.jsonl"]
    assert out.read_bytes() == reference.read_bytes()


def test_truncated_and_bad_records_are_counted(tmp_path):
    records = RECORDS[:4] + [{"id": "z", "conversations": [{"role": "assistant", "content": "hi"}]}]
    data = write_prompts(tmp_path / "prompts.jsonl", records, ['{"id": "broken'])
    out = tmp_path / "regen.jsonl"
    summary = regenerate(data, out, "--max-new-tokens", "8")
    # "5 6 7 8 9" and "12 13 14 15" end within 8 tokens, the letters and the times table do not
    assert summary["records"] == 6 and summary["regenerated"] == 2 and summary["truncated"] == 2
    assert summary["skipped"] == {"broken JSON": 1, "starts with the assistant": 1}
    assert [r["id"] for r in read(out)] == ["a", "d"]

    kept = main([f"data.path={data}", "--out", str(out), "--merge", "--keep-truncated"])
    assert kept["written"] == 4 and kept["tokens"] == summary["tokens"]
    assert [r["id"] for r in read(out)] == ["a", "b", "c", "d"]


def test_keys_are_unique_and_a_half_line_is_cut(tmp_path):
    used = set()
    keys = [unique_key(w, r, used) for w, r in [("f:1", {"id": 7}), ("f:2", {"id": 7}), ("f:3", {}), ("f:4", "x")]]
    assert keys == ["7", "7#1", "f:3", "f:4"]
    shard = tmp_path / "shard.jsonl"
    shard.write_bytes(b'{"key": "a"}\n{"key": "b"}\n{"key"')
    drop_partial_line(shard)
    assert shard.read_bytes() == b'{"key": "a"}\n{"key": "b"}\n'


class FakeServer(BaseHTTPRequestHandler):
    """A chat-completions endpoint: it answers "1 2 <prompt>", breaks off where the prompt
    says "long", refuses "refuse", and fails the very first request with a 503."""

    requests: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def send(self, status: int, body: dict) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        self.send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(body)
        if len(self.requests) == 1:
            return self.send(503, {"error": "warming up"})
        prompt = body["messages"][-1]["content"]
        if "refuse" in prompt:
            return self.send(400, {"error": "prompt too long"})
        finish = "length" if "long" in prompt else "stop"
        message = {"role": "assistant", "content": f"1 2 {prompt}"}
        self.send(200, {"choices": [{"index": 0, "message": message, "finish_reason": finish}],
                        "usage": {"completion_tokens": len(prompt.split()) + 1}})


def test_server_mode_against_a_fake_server(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    records = RECORDS + [{"id": "long", "prompt": "a long one"}, {"id": "no", "prompt": "refuse this"}]
    data = write_prompts(tmp_path / "prompts.jsonl", records)
    out = tmp_path / "regen.jsonl"
    try:
        summary = main([f"data.path={data}", "--out", str(out), "--server", f"http://127.0.0.1:{server.server_port}/v1",
                        "--concurrency", "4", "--thinking", "off", "--temperature", "0.7", "--max-new-tokens", "64"])
    finally:
        server.shutdown()
    assert summary["records"] == 10 and summary["regenerated"] == 8 and summary["truncated"] == 1
    assert summary["skipped"] == {"rejected": 1}
    rows = read(out)
    assert [r["id"] for r in rows] == [r["id"] for r in RECORDS]
    assert rows[4]["conversations"][1]["content"] == "1 2 count from 5 to 9"
    bodies = FakeServer.requests
    assert len(bodies) == 1 + 9 + 1 + 1  # the refused 503, 9 replies, the truncated one, the rejected one
    assert all(b["model"] == "fake-model" and b["max_tokens"] == 64 and b["temperature"] == 0.7 for b in bodies)
    assert all(b["chat_template_kwargs"] == {"enable_thinking": False} for b in bodies)
    second_turn = next(b for b in bodies if len(b["messages"]) == 3)
    assert second_turn["messages"][1] == {"role": "assistant", "content": "1 2 count from 5 to 9"}
    tokenizer = TargetSource("demo").tokenizer()
    assert len(load_dataset(DataSettings(str(out), 512, 1, strict=True), tokenizer)) >= 8


def test_throughput_generates_exactly_the_new_tokens(tmp_path):
    report = main(["target=demo", "--throughput", "3", "--batch-size", "2", "--max-new-tokens", "6", "--prompt-len", "8",
                   "--out", str(tmp_path / "throughput.json")])
    assert report["generated_tokens"] == 18 and report["tokens_per_s"] > 0
    assert json.loads((tmp_path / "throughput.json").read_text())["batch_size"] == 2


def test_generation_runs_without_cudnn_attention_and_restores_the_choice():
    """Every decoding step has a new key length, and cuDNN attention builds a plan for
    each (``dflash.eval.decoding_attention``): ``generate`` runs with it off, and the
    process-wide choice is back afterwards."""
    model, tokenizer = TargetSource("demo").load(torch.device("cpu"), torch.float32)
    local = LocalTarget(model, tokenizer, Sampling(max_new_tokens=4, temperature=0))
    cudnn_during = []
    model.register_forward_pre_hook(lambda *_: cudnn_during.append(torch.backends.cuda.cudnn_sdp_enabled()))
    prompts = [local.encode([{"role": "user", "content": text}]) for text in ("1 2 3", "4 5")]
    assert len(local.generate(prompts, seed=0)) == 2
    assert cudnn_during and not any(cudnn_during)
    assert torch.backends.cuda.cudnn_sdp_enabled()
