"""The transport over gloo: fp32 and bf16 round trips (with and without the top-k
logits), and a BundleError naming the one header field that does not match.

One spawned pair runs every case in sequence, each on its own process group, so
an error case's unreceived payload can never be matched by a later receive.
"""

import dataclasses
import os
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.data.bundle import MicroBatch, random_prefill
from dflash.distributed.transport import (
    BundleError,
    BundleReceiver,
    BundleSender,
    Expected,
)
from dflash.model.target import PrefillOutput

BLOCK = 4
BASE_EXPECTED = dict(max_batch=2, num_anchors=3, feature_dim=12, feature_dtype=torch.float32, topk=3, buckets=[16, 32],
                     block_size=BLOCK)

# name: (what the target sends, what the drafter expects instead of BASE_EXPECTED, the one problem named)
CASES = {
    "fp32": (dict(), dict(), None),
    "bf16": (dict(dtype=torch.bfloat16), dict(feature_dtype=torch.bfloat16), None),
    "bf16_no_topk": (dict(dtype=torch.bfloat16, topk=0, batch=1, seq_len=32), dict(feature_dtype=torch.bfloat16, topk=0), None),
    "anchors": (dict(anchors=4), dict(), ["4 anchors", "train.num_anchors=3"]),
    "dtype": (dict(dtype=torch.bfloat16), dict(), ["feature dtype", "bfloat16", "expected torch.float32"]),
    "topk": (dict(topk=5), dict(), ["top-k 5", "loss.kl_topk=3"]),
    "topk_missing": (dict(topk=0), dict(), ["top-k 0", "loss.kl_topk=3"]),
    "bucket": (dict(seq_len=20), dict(), ["length 20", "not a bucket of [16, 32]"]),
    "batch": (dict(batch=3), dict(), ["batch 3", "train.micro_batch_size=2"]),
    "block_size": (dict(), dict(block_size=2 * BLOCK), [f"block size {BLOCK}", f"drafter.block_size={2 * BLOCK}"]),
}


def make_bundle(batch=2, seq_len=16, anchors=3, feature_dim=12, dtype=torch.float32, topk=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    mb = MicroBatch(
        input_ids=torch.randint(0, 50, (batch, seq_len), generator=g),
        loss_mask=torch.randint(0, 2, (batch, seq_len), generator=g),
        lengths=torch.randint(1, seq_len + 1, (batch,), generator=g),
        anchors=torch.randint(0, seq_len, (batch, anchors), generator=g),
        keep=torch.rand(batch, anchors, generator=g) > 0.3,
        epoch=3 + seed,
    )
    features = (torch.randn(batch, seq_len, feature_dim, generator=g) * 10).to(dtype)
    if not topk:
        return mb, PrefillOutput(features)
    values = torch.randn(batch, seq_len, topk, generator=g).sort(-1, descending=True).values
    return mb, PrefillOutput(features, values, torch.randint(0, 50, (batch, seq_len, topk), generator=g))


def sender(group) -> BundleSender:
    return BundleSender({1: group}, torch.device("cpu"), block_size=BLOCK)


def expected(**changes) -> Expected:
    return Expected(**{**BASE_EXPECTED, **changes})


def _worker(rank, port, out):
    threading.Timer(60, lambda: os._exit(3)).start()  # never hang the suite
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    groups = [dist.new_group([0, 1]) for _ in CASES]
    senders = []  # alive until exit: they own the buffers in flight
    results = {}
    for m, (group, (name, (sent, wanted, _))) in enumerate(zip(groups, CASES.items())):
        if rank == 0:
            senders.append(sender(group))
            senders[-1].send(1, m, *make_bundle(**sent, seed=m))
            continue
        try:
            _, batch, prefill = BundleReceiver({0: group}, torch.device("cpu"), expected(**wanted)).receive(0, m)
            results[name] = ("ok", dataclasses.asdict(batch), dataclasses.asdict(prefill))
        except Exception as e:  # noqa: BLE001 - the test inspects the type and message
            results[name] = ("error", type(e).__name__, str(e))
    if rank == 1:
        torch.save(results, out)
    dist.barrier()
    os._exit(0)  # leave the error cases' unmatched sends behind


@pytest.fixture(scope="module")
def received(tmp_path_factory):
    from runs import (
        free_port,  # here, not at the top: spawned workers need not import the trainer
    )

    out = tmp_path_factory.mktemp("bundles") / "received.pt"
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2] is None])
def test_round_trip(received, name):
    m = list(CASES).index(name)
    status, *got = received[name]
    assert status == "ok", got
    batch, prefill = make_bundle(**CASES[name][0], seed=m)
    got_batch, got_prefill = got
    for field in ("input_ids", "loss_mask", "lengths", "anchors"):
        assert got_batch[field].dtype == torch.int64, field
        assert torch.equal(got_batch[field], getattr(batch, field).long()), field
    assert got_batch["keep"].dtype == torch.bool and torch.equal(got_batch["keep"], batch.keep)
    assert got_batch["epoch"] == batch.epoch
    assert got_prefill["features"].dtype == prefill.features.dtype
    assert torch.equal(got_prefill["features"], prefill.features)  # bit for bit, bf16 included
    if prefill.topk_values is None:
        assert got_prefill["topk_values"] is None and got_prefill["topk_indices"] is None
    else:
        assert got_prefill["topk_values"].dtype == torch.float32
        assert torch.equal(got_prefill["topk_values"], prefill.topk_values)
        assert torch.equal(got_prefill["topk_indices"], prefill.topk_indices)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2] is not None])
def test_mismatched_field_is_a_clear_error(received, name):
    status, kind, message = received[name]
    assert status == "error" and kind == BundleError.__name__, (status, kind, message)
    assert "does not match this drafter" in message
    problems = message.split(": ", 1)[1].split("; ")
    assert len(problems) == 1, f"{name}: only one field differs, yet the message names {problems}"
    for part in CASES[name][2]:
        assert part in problems[0], f"{name}: {part!r} not in {message!r}"


def test_random_prefill_gives_distinct_top_k_ids_as_topk_does():
    """Noise prefills (warmup, benchmarks, GPU tests) carry what a real prefill carries: the
    loss writes each teacher column's gradient once, so repeated ids would make it depend
    on which write lands last."""
    out = random_prefill(3, 50, 8, torch.float32, 6, 10, "cpu")
    ids = out.topk_indices
    assert ids.min() >= 0 and ids.max() < 10
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()
    assert (out.topk_values.diff(dim=-1) <= 0).all()
