"""Several GPUs over NCCL: group creation where subgroups leave ranks out, and every
target/drafter split end to end against the colocated run. Each test needs as many
visible GPUs as ranks and says so when it is skipped."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from runs import TINY, free_port, read_metrics, read_records

from dflash.distributed.protocol import Protocol, Timeouts
from dflash.distributed.tensor_parallel import transformers_unsupported
from dflash.distributed.topology import Topology

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def gpus(n: int):
    count = torch.cuda.device_count()
    return pytest.mark.skipif(count < n, reason=f"needs {n} GPUs (one per rank), {count} visible")


SHARDS = pytest.mark.skipif(transformers_unsupported() is not None, reason=str(transformers_unsupported()))


def _groups_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    proto = Protocol(Topology(2, rank, 1, 1, 1), device, Timeouts(init_s=120, warmup_s=120, step_s=120))
    proto.start()  # the drafter group [1] leaves rank 0 out
    with proto.phase("gloo subgroups that leave a rank out", 120, [1 - rank]):
        # the sequence that hung with an eagerly initialised NCCL default group
        dist.new_group([0], backend="gloo")
        everyone = dist.new_group(backend="gloo")
        dist.barrier(group=everyone)
    payload = torch.arange(1 << 20, dtype=torch.float32, device=device) * (1 if rank == 0 else 0)
    op = dist.isend if rank == 0 else dist.irecv
    group = proto.pairs[(0, 1)]
    with proto.phase("a megabyte on the pair group", 120, [1 - rank]):
        for work in dist.batch_isend_irecv([dist.P2POp(op, payload, 1 - rank, group=group)]):
            work.wait()
        torch.cuda.synchronize()
    steps = proto.agree_steps(5 if rank == 0 else None)
    Path(out, f"rank{rank}").write_text(json.dumps({"steps": steps, "sum": float(payload.sum())}))
    proto.close()


def _failing_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    proto = Protocol(Topology(2, rank, 1, 1, 1), device, Timeouts(init_s=120, warmup_s=120, step_s=120), eval_link=True)
    proto.start()
    sent = Path(out, "sent")
    if rank == 0:  # a bundle the drafter never takes, as when it fails before its first receive
        payload = torch.ones(1 << 24, device=device)
        dist.batch_isend_irecv([dist.P2POp(dist.isend, payload, 1, group=proto.pairs[(0, 1)])])
        sent.write_text("1")
        time.sleep(600)
    deadline = time.monotonic() + 120
    while not sent.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 never posted its send")
        time.sleep(0.05)
    try:
        raise RuntimeError("a drafter rank fails")
    except RuntimeError:
        proto.abort()  # what dflash.train does with any error
        Path(out, "aborted").write_text("1")
        raise


@gpus(2)
def test_a_failing_rank_exits_while_its_peer_still_waits_on_it(tmp_path):
    """A rank that fails must exit, so torchrun can end the run; NCCL's orderly
    shutdown instead waited for the peer's pending send, holding it alive and silent."""
    context = mp.get_context("spawn")
    port = free_port()
    workers = [context.Process(target=_failing_worker, args=(rank, port, str(tmp_path))) for rank in (0, 1)]
    for w in workers:
        w.start()
    try:
        workers[1].join(timeout=120)
        assert workers[1].exitcode not in (None, 0), "the failing rank did not exit"
        assert Path(tmp_path, "aborted").exists(), "the failing rank exited, but not through its abort"
    finally:
        for w in workers:
            w.kill()
            w.join()


@gpus(2)
def test_groups_that_leave_ranks_out_are_created_and_carry_data(tmp_path):
    mp.start_processes(_groups_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    expected = float(torch.arange(1 << 20, dtype=torch.float64).sum())
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}").read_text())
        assert result["steps"] == 5
        assert result["sum"] == pytest.approx(expected, rel=1e-6)


# the demo target, a few steps, strict compile guards, one length bucket
END_TO_END = TINY + ["compile.enabled=true", "train.batch_size=6", "train.max_steps=6", "train.buckets=[320]", "train.max_len=320"]


def train(nproc: int, output_dir: Path, extra: list[str]) -> None:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "WANDB_MODE": "disabled",
           "TORCHINDUCTOR_CACHE_DIR": str(ROOT / ".cache" / "inductor-tests")}
    args = END_TO_END + extra + [f"output_dir={output_dir}"]
    if nproc == 1:
        command = [sys.executable, "-m", "dflash.train", *args]
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    else:
        command = ["./launch.sh", *args]
        env.update(NPROC=str(nproc), PYTHON=sys.executable)
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    out = tmp_path_factory.mktemp("colocated")
    train(1, out, [])
    return [m["loss"] for m in read_metrics(out)]


@pytest.mark.parametrize(
    "targets,drafters",
    [
        pytest.param(1, 1, marks=gpus(2), id="T1D1"),
        pytest.param(1, 2, marks=gpus(3), id="T1D2"),
        pytest.param(2, 2, marks=gpus(4), id="T2D2"),
        pytest.param(1, 3, marks=gpus(4), id="T1D3"),
    ],
)
def test_split_trains_like_colocated(colocated, tmp_path, targets, drafters):
    train(targets + drafters, tmp_path, [f"topology.target_ranks={targets}"])
    losses = [m["loss"] for m in read_metrics(tmp_path)]
    # bf16 on the GPU; the gradient sum runs in another order over several drafters
    assert losses == pytest.approx(colocated, rel=2e-2)
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    assert [r["role"] for r in ranks] == ["target"] * targets + ["drafter"] * drafters
    assert all(r["steps"] == 6 for r in ranks)
    assert all(m["recompiles"] == 0 and m["cudagraph_skips"] == 0 and m["cudagraph_rerecords"] == 0 for m in read_metrics(tmp_path))
    assert (tmp_path / "export" / "model.safetensors").is_file()


@pytest.mark.parametrize("ranks", [pytest.param(2, marks=gpus(2), id="x2"), pytest.param(4, marks=gpus(4), id="x4")])
def test_colocated_data_parallel_trains_like_one_process(tmp_path, ranks):
    """topology.mode=colocated over NCCL: every rank prefills and trains its share, the
    gradients are reduced over all, compiled with no recompile after warmup."""
    train(ranks, tmp_path, ["topology.mode=colocated", "train.batch_size=8", "train.max_steps=6"])
    reference = tmp_path.parent / f"{tmp_path.name}_one"
    train(1, reference, ["train.batch_size=8", "train.max_steps=6"])
    losses, expected = ([m["loss"] for m in read_metrics(d)] for d in (tmp_path, reference))
    assert losses == pytest.approx(expected, rel=2e-2)
    summaries = json.loads((tmp_path / "ranks.json").read_text())
    assert [(r["role"], r["steps"]) for r in summaries] == [("colocated", 6)] * ranks
    assert all(m["recompiles"] == 0 and m["cudagraph_skips"] == 0 and m["cudagraph_rerecords"] == 0 for m in read_metrics(tmp_path))
    assert (tmp_path / "export" / "model.safetensors").is_file()


@gpus(2)
def test_evaluation_while_training_on_target_rank_0(tmp_path):
    """eval.every on NCCL: the weights go over their own link, target rank 0 decodes in its
    waits on the eager layers, and no graph compiles after warmup on either side."""
    train(2, tmp_path, ["topology.target_ranks=1", "eval.enabled=true", "eval.every=3", "eval.max_prompts=4",
                        "eval.max_new_tokens=32", "eval.temperature=1.0"])
    evals = [r for r in read_records(tmp_path) if "eval/tau" in r]
    assert [r["step"] for r in evals] == [3]
    assert evals[0]["eval/lossless"] is True and evals[0]["eval/tau"] >= 1.0 and "eval/tau@1" in evals[0]
    assert evals[0]["eval/handoff_ms"] < 1000 and evals[0]["eval/slice_max_ms"] > 0
    assert evals[0]["eval/divergent_prompts"] == 0
    assert all(m["recompiles"] == 0 and m["cudagraph_skips"] == 0 and m["cudagraph_rerecords"] == 0 for m in read_metrics(tmp_path))
    assert "eval_s" in json.loads((tmp_path / "ranks.json").read_text())[0]


def _tensor_parallel_worker(rank: int, port: int, out: str) -> None:
    """A Qwen3-shaped random target whole and sharded over both GPUs (NCCL, bf16): the
    features of one prefill, side by side."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    from dflash.distributed.tensor_parallel import load_target
    from dflash.model.target import Target, TargetSource

    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    shape = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=4096)
    source = TargetSource("random", shape=shape, seed=3)
    ids = torch.randint(0, 4096, (2, 512), generator=torch.Generator().manual_seed(1)).to(device)
    whole = Target(source.model(device, torch.bfloat16), [1, 3, 5]).prefill(ids, topk=8)
    sharded = Target(load_target(source, device, torch.bfloat16, group), [1, 3, 5]).prefill(ids, topk=8)
    error = float((sharded.features.float() - whole.features.float()).norm() / whole.features.float().norm())
    # Where the runner-up is within bf16 rounding of the top logit either may win (5% of
    # positions tie outright in bf16): compare the top-1 where it leads by over 2%, five ulps.
    top1 = whole.topk_values[..., 0].float()
    decisive = top1 - whole.topk_values[..., 1].float() > 0.02 * top1.abs()
    agree = float((sharded.topk_indices[..., 0] == whole.topk_indices[..., 0])[decisive].float().mean())
    Path(out, f"rank{rank}").write_text(json.dumps({"error": error, "top1_agree": agree,
                                                    "decisive": float(decisive.float().mean())}))
    dist.destroy_process_group()


@gpus(2)
@SHARDS
def test_tensor_parallel_prefill_matches_one_gpu(tmp_path):
    """target.tensor_parallel=2 over NCCL: the sharded prefill's features are the one-GPU
    prefill's within bf16 rounding (the row-parallel sums run in another order)."""
    mp.start_processes(_tensor_parallel_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}").read_text())
        assert result["error"] < 2e-2 and result["decisive"] > 0.5 and result["top1_agree"] > 0.99, result


@gpus(4)
@SHARDS
def test_tensor_parallel_target_group_trains_like_colocated(colocated, tmp_path):
    """Ranks 0-1 hold one target sharded over two GPUs, ranks 2-3 train: the losses are the
    one-GPU run's within bf16 noise, rank 0 sends every bundle, rank 1 none."""
    train(4, tmp_path, ["topology.target_ranks=2", "target.tensor_parallel=2"])
    assert [m["loss"] for m in read_metrics(tmp_path)] == pytest.approx(colocated, rel=2e-2)
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    assert [r["role"] for r in ranks] == ["target", "target", "drafter", "drafter"]
    assert all(r["steps"] == 6 for r in ranks)
    assert ranks[0]["bytes_sent"] > 0 and ranks[1]["bytes_sent"] == 0
    assert all(m["recompiles"] == 0 and m["cudagraph_skips"] == 0 and m["cudagraph_rerecords"] == 0 for m in read_metrics(tmp_path))
    assert (tmp_path / "export" / "model.safetensors").is_file()
