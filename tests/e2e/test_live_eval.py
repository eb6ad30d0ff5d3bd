"""Speculative decoding while training (eval.every) gives what dflash.decode.speculative gives on the
checkpoint of the same step, colocated and disaggregated."""

import json
import logging
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import tiny_drafter, tiny_target, word_tokenizer
from runs import compose_cfg, read_records, run_colocated, run_disaggregated

from dflash.decode import live
from dflash.decode.batch import default_batch_size
from dflash.decode.live import (
    Evaluator,
    LiveEvalSettings,
    RemoteEval,
    flat_weights,
)
from dflash.decode.speculative import DecodeSettings
from dflash.distributed.protocol import Timeouts
from dflash.eval import main as eval_main
from dflash.model.drafter import TargetHead
from dflash.model.export import load_export, save_export
from dflash.model.target import Target
from dflash.run.metrics import MetricsLogger
from dflash.run.settings import live_eval_settings

pytestmark = pytest.mark.usefixtures("one_thread")

# long enough that the drafter accepts something at step 30 (an untrained one gives tau 1,
# which any weights would reproduce)
LIVE = ["eval.enabled=true", "eval.every=30", "eval.temperature=0.7", "eval.max_prompts=3", "eval.max_new_tokens=24",
        "checkpoint.every=30", "checkpoint.keep=3", "train.lr=1e-3", "train.max_steps=60", "data.max_samples=256",
        "train.num_anchors=32"]
EVAL_STEP = 30


def eval_of_checkpoint(run: Path, step: int, tmp: Path) -> dict:
    """``dflash.decode.speculative`` on the drafter weights of checkpoint ``step``, exported."""
    drafter = load_export(run / "export")
    state = {"model": drafter.state_dict()}
    dcp.load(state, checkpoint_id=str(run / "checkpoints" / f"step_{step:08d}"))
    drafter.load_state_dict(state["model"])
    export = save_export(drafter, tmp / "export", dtype="float32")
    return eval_main(["--target", "demo", "--drafter", str(export), "--data", "heldout=demo_heldout",
                      "--max-prompts", "3", "--max-new-tokens", "24", "--temperature", "0", "0.7", "--device", "cpu",
                      "--out", str(tmp / "eval.json")])


def check_against_checkpoint(run: Path, tmp: Path) -> None:
    evals = [r for r in read_records(run) if "eval/tau" in r]
    assert [r["step"] for r in evals] == [EVAL_STEP], "one evaluation (the last step is the export's)"
    live = evals[0]
    assert live["eval/tau"] > 1.0, "the drafter accepts nothing yet: the comparison would prove nothing"
    want = eval_of_checkpoint(run, EVAL_STEP, tmp)
    greedy, sampled = want["results"]["heldout@0"], want["results"]["heldout@0.7"]
    assert live["eval/tau"] == greedy["tau"] and live["eval/lossless"] is True and live["eval/divergent_prompts"] == 0
    assert {k: live[f"eval/hist_{k}"] for k in greedy["histogram"]} == greedy["histogram"]
    assert live["eval/tau@0.7"] == sampled["tau"]
    assert live["eval/tau_sim"] is not None


def test_colocated_eval_equals_dflash_eval_of_the_checkpoint(tmp_path):
    run_colocated(tmp_path / "run", LIVE)
    check_against_checkpoint(tmp_path / "run", tmp_path)


def test_disaggregated_eval_equals_dflash_eval_of_the_checkpoint(tmp_path):
    run_disaggregated(tmp_path / "run", 2, 1, LIVE)
    check_against_checkpoint(tmp_path / "run", tmp_path)
    target = json.loads((tmp_path / "run" / "ranks.json").read_text())[0]
    assert target["eval_s"] > 0 and target["eval_warm_s"] > 0, "target rank 0 warms the decoding before any bundle"
    live = next(r for r in read_records(tmp_path / "run") if "eval/tau" in r)
    assert live["eval/slice_max_ms"] > 0 and live["eval/handoff_ms"] > 0


def test_weights_round_trip_through_the_flat_buffer():
    src, dst = tiny_drafter(vocab=64, block_size=4), tiny_drafter(vocab=64, block_size=4)
    flat = flat_weights(src, torch.float32)
    assert flat.numel() == sum(p.numel() for p in src.parameters())
    torch.nn.utils.vector_to_parameters(flat, dst.parameters())
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_console_line_of_an_evaluation_says_how_far_from_lossless(tmp_path, caplog):
    metrics = MetricsLogger(tmp_path, {"mode": "disabled"}, {}, start_step=0)
    record = {"step": 40, "eval/tau": 1.0, "eval/lossless": False, "eval/divergent_prompts": 2,
              "eval/divergence_margin": 0.0123, "eval/s": 5.0}
    with caplog.at_level(logging.INFO, logger="dflash.run.metrics"):
        metrics.log_eval(record)
    assert "step 40: speculative decoding tau 1.000 (tau_sim -), lossless NO (2 prompts depart" in caplog.text
    assert "at most 0.0123" in caplog.text
    assert read_records(tmp_path)[0]["eval/divergent_prompts"] == 2


class _Sent:
    """A finished send: ``wait()`` once."""

    def __init__(self):
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


class _Store:
    """The metrics rank's view of target rank 0's answers."""

    def __init__(self, answers: list[dict | None]):
        self.answers = answers
        self.timeouts = Timeouts(init_s=5, warmup_s=5, step_s=5)

    def eval_result(self, step: int) -> dict | None:
        return self.answers.pop(0)

    def phase(self, what: str, timeout_s: float, peers=()):
        return nullcontext()


def test_an_abandoned_evaluation_is_collected_as_nothing_and_frees_the_next():
    """Target rank 0 answers an abandoned evaluation with a tombstone: the drafter's wait
    ends, its send is completed once, and the next due step hands off again."""
    remote = RemoteEval(_Store([None, {"step": 2, "abandoned": True}]), None, torch.float32, total_steps=10)
    sent = _Sent()
    remote.sending, remote.pending = (sent, torch.zeros(1)), 2
    assert remote.finish(completed=True) == []
    assert remote.pending is None and sent.waits == 1


class _Offers:
    """Target rank 0's view of the store: weights of ``step`` offered from the start."""

    def __init__(self, step: int):
        self.step = step
        self.topo = SimpleNamespace(metrics_rank=1)
        self.eval_link = None
        self.results: list[dict] = []

    def eval_requested(self) -> int:
        return self.step

    def post_eval_result(self, record: dict) -> None:
        self.results.append(record)


class _OneSliceEvaluator:
    """An evaluation that ends at its first slice."""

    def __init__(self):
        self.busy, self.step, self.last_slice = False, 0, "all of it"

    def buffer(self) -> torch.Tensor:
        return torch.zeros(3)

    def start(self, step: int, flat: torch.Tensor) -> None:
        self.busy, self.step = True, step

    def advance(self) -> dict:
        self.busy = False
        return {"step": self.step, "eval/s": 0.1}


def test_target_rank_0_takes_offered_weights_while_it_waits_on_its_sends(monkeypatch):
    """While the target waits for a drafter to take a bundle it runs ``idle``: weights offered
    in the meantime are received there and evaluated. Under NCCL the metrics rank's send
    of them stays pending on its GPU until then, and whatever waits for that GPU's work
    would wait for target rank 0, itself waiting on that drafter."""
    received = []
    monkeypatch.setattr(live.dist, "recv", lambda t, src, group: received.append(src))
    proto = _Offers(step=40)
    server = live.EvalServer(proto, _OneSliceEvaluator(), sliced=True)
    assert server.idle() is True  # received, then one slice
    assert received == [1] and server.handled == 40 and [r["step"] for r in proto.results] == [40]
    server.next_offer_check = 0.0  # look again at once: the same offer is not taken twice
    assert server.idle() is False and received == [1]


def test_an_evaluation_budget_below_one_is_refused_at_start():
    cfg = compose_cfg(["eval.every=5", "eval.max_new_tokens=0"])
    with pytest.raises(ValueError, match="eval.max_new_tokens=0 must be at least 1"):
        live_eval_settings(cfg)
    with pytest.raises(ValueError, match="eval.batch_size=0 must be at least 1, or null"):
        live_eval_settings(compose_cfg(["eval.every=5", "eval.batch_size=0"]))


def test_the_evaluation_batch_follows_the_device_unless_set():
    """64 prompts at once on a GPU, 32 on the CPU, or ``eval.batch_size``."""
    assert default_batch_size(torch.device("cuda")) == 64 and default_batch_size(torch.device("cpu")) == 32
    assert live_eval_settings(compose_cfg(["eval.every=5"])).decode.batch_size is None
    assert live_eval_settings(compose_cfg(["eval.every=5", "eval.batch_size=8"])).decode.batch_size == 8


def test_evaluation_slices_decode_without_cudnn_attention_and_leave_the_choice_to_training(tmp_path):
    """cuDNN attention builds a plan per new key length (up to about 1 s on an H200) and
    decoding gives every call a new one: every forward of an evaluation, warm-up and
    slices, runs with it off, and between slices, where the target's training prefills
    run, the process-wide choice is back as it was."""
    (tmp_path / "heldout.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"w{i} w{i + 1} w{i + 2}"}]}) + "\n" for i in range(3)))
    model = tiny_target()
    drafter = tiny_drafter()
    settings = LiveEvalSettings(5, str(tmp_path / "heldout.jsonl"), DecodeSettings(max_new_tokens=6, max_prompts=3))
    evaluator = Evaluator(Target(model, [1, 2, 3]), word_tokenizer(), TargetHead.of(model), drafter.config, settings)
    cudnn_during = []
    model.register_forward_pre_hook(lambda *_: cudnn_during.append(torch.backends.cuda.cudnn_sdp_enabled()))
    assert torch.backends.cuda.cudnn_sdp_enabled()

    evaluator.warm()
    warm_forwards = len(cudnn_during)
    evaluator.start(5, flat_weights(drafter, torch.float32))
    slices = 0
    while evaluator.advance() is None:
        slices += 1
        assert torch.backends.cuda.cudnn_sdp_enabled(), "the choice leaked out of a slice"
    assert warm_forwards > 0 and slices > 3 and len(cudnn_during) > warm_forwards
    assert not any(cudnn_during)
