"""Warm starts of the compile warmup: the first rank of a role hands what it compiled to the
ranks of its later turns through the rendezvous store, so they load instead of compiling
without sharing a cache directory; and the cache directory outlives the launch by default."""

import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch._inductor.config
import torch.distributed as dist
import torch.multiprocessing as mp
from runs import free_port
from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

from dflash.compile import use_cache_dir, warm_source, warmup_turn
from dflash.distributed.protocol import (
    STORE_CHUNK_BYTES,
    Protocol,
    Timeouts,
    get_bytes,
    put_bytes,
    set_rank_env,
)
from dflash.distributed.topology import Topology
from dflash.run.config import compose_config

WORLD, TURNS = 3, 2  # target 0; drafters 1 (turn 0, sends) and 2 (turn 1, receives)


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Forward and backward are one matmul each: inductor emits extern calls only, so a
    cold compile costs seconds on the CPU (a pointwise op would build a C++ kernel)."""
    return x @ w


def _rank(rank: int, port: int, out: str) -> None:
    # Each rank has its own cache directory, so a later turn cannot hit the first one's disk.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(out) / f"cache{rank}")
    torch._inductor.config.compile_threads = 1  # no worker pool to start on a small CPU runner
    torch.set_num_threads(1)
    set_rank_env(rank, WORLD, port)
    topo = Topology(WORLD, rank, 1, micro_batch_size=1, batch_size=WORLD - 1)
    proto = Protocol(topo, torch.device("cpu"), Timeouts(init_s=60, warmup_s=60, step_s=60))
    proto.start()
    index = rank if topo.is_target else rank - topo.num_targets
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g, requires_grad=True)
    compiled = torch.compile(project, backend="inductor", dynamic=False, fullgraph=True)

    def warm() -> None:
        if not topo.is_target:
            compiled(x, w).square().sum().backward()

    reports = proto.warmup(warm, warmup_turn(index == 0, index, TURNS), TURNS, share=not topo.is_target)
    if not topo.is_target:
        w.grad = None
        y = compiled(x, w)
        y.square().sum().backward()
        expected = x @ w.detach()
        torch.testing.assert_close(y, expected)
        torch.testing.assert_close(w.grad, 2 * x.T @ expected)
    if rank == topo.metrics_rank:
        (Path(out) / "warmup.json").write_text(json.dumps(reports))
    proto.close()


def test_a_later_turn_loads_the_artifacts_its_first_rank_compiled(tmp_path):
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="spawn")
    target, first, later = json.loads((tmp_path / "warmup.json").read_text())
    assert target["cache"] == "nothing compiled" and not target["artifacts_sent"] + target["artifacts_received"]
    assert first["cache"] == "compiled" and first["fx_cache_misses"] == 2  # forward and backward
    assert first["artifacts_sent"] > 0 and first["artifacts_received"] == 0
    assert later["turn"] == 1 and later["artifacts_received"] == first["artifacts_sent"]
    assert (later["fx_cache_hits"], later["fx_cache_misses"]) == (2, 0)
    assert (later["aot_cache_hits"], later["aot_cache_misses"]) == (1, 0)
    assert later["cache"] == "received" and later["artifacts_sent"] == 0
    # what the later rank loaded came through the store, into its own directory
    assert any((tmp_path / "cache2" / "fxgraph").rglob("*")) and not (tmp_path / "cache2" / "triton").exists()


def test_values_larger_than_the_store_accepts_travel_in_chunks():
    """The libuv TCPStore server drops a client that sends one value over 8 MiB."""
    store = dist.PrefixStore("dflash", dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False))
    data = os.urandom(20 * 10**6)
    put_bytes(store, "big", data)
    assert int(store.get("big/chunks")) == -(-len(data) // STORE_CHUNK_BYTES) > 2
    assert get_bytes(store, "big") == data
    put_bytes(store, "none", b"")
    assert get_bytes(store, "none") == b""


@pytest.mark.parametrize(
    "counts,received,source",
    [
        ({"graphs": 0}, 0, "nothing compiled"),
        ({"graphs": 2, "fx_cache_misses": 1, "fx_cache_hits": 3}, 0, "compiled"),
        ({"graphs": 2}, 0, "compiled"),  # a backend without a cache (aot_eager)
        ({"graphs": 2, "fx_cache_hits": 4, "aot_cache_hits": 2}, 0, "loaded from disk"),
        ({"graphs": 2, "fx_cache_hits": 4, "aot_cache_hits": 2}, 1000, "received"),
        ({"graphs": 2, "fx_cache_hits": 4, "aot_cache_misses": 1}, 1000, "compiled"),
    ],
)
def test_warm_source(counts, received, source):
    zero = dict.fromkeys(("fx_cache_hits", "fx_cache_misses", "aot_cache_hits", "aot_cache_misses"), 0)
    assert warm_source({**zero, **counts}, received) == source


def test_a_rank_whose_received_code_misses_is_told_why(monkeypatch, caplog):
    """Under plain torchrun a rank's GPU is cuda:LOCAL_RANK, and compiled code is keyed by
    the device index: what the role's first rank hands over misses, and the rank says so."""
    from torch._dynamo.utils import counters

    from dflash import compile as compile_module

    def warm() -> None:  # the graph compiled although the received code was loaded
        counters["stats"]["unique_graphs"] += 1
        counters["inductor"]["fxgraph_cache_miss"] += 1

    monkeypatch.setattr(compile_module, "load_artifacts", lambda data: len(data))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    with caplog.at_level(logging.WARNING, logger="dflash.compile"):
        report = compile_module.staggered_warmup(warm, 1, 2, receive=lambda: b"code")
    assert report["cache"] == "compiled" and report["artifacts_received"] == 4
    assert "runs on cuda:3" in caplog.text and "--virtual-local-rank" in caplog.text

    caplog.clear()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with caplog.at_level(logging.WARNING, logger="dflash.compile"):
        compile_module.staggered_warmup(warm, 1, 2, receive=lambda: b"code")
    assert "still compiled (cache misses)" in caplog.text and "cuda:" not in caplog.text


def _cache_dir_of(*overrides: str) -> str:
    return use_cache_dir(compose_config(list(overrides)).compile.cache_dir)


def test_the_cache_dir_outlives_the_launch_by_default(monkeypatch, tmp_path):
    # importing torch._dynamo wrote inductor's default under /tmp here; it counts as unset
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # restored after the test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    default = str(tmp_path / "xdg" / "dflash" / "compile")
    assert _cache_dir_of() == default
    assert cache_dir() == default  # where inductor puts its FX graph and AOTAutograd caches
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _cache_dir_of() == str(tmp_path / "home" / ".cache" / "dflash" / "compile")
    assert _cache_dir_of("compile.cache_dir='~/shared'") == str(tmp_path / "home" / "shared")


def test_a_chosen_inductor_cache_dir_wins_over_the_default(monkeypatch, tmp_path):
    """Benchmarks and sweeps pick a fresh cache through TORCHINDUCTOR_CACHE_DIR; only an
    explicit compile.cache_dir overrides it, and null leaves inductor its own choice."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "fresh"))
    assert _cache_dir_of() == str(tmp_path / "fresh")
    assert _cache_dir_of("compile.cache_dir=null") == str(tmp_path / "fresh")
    assert _cache_dir_of(f"compile.cache_dir={tmp_path / 'explicit'}") == str(tmp_path / "explicit")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert _cache_dir_of("compile.cache_dir=null") == default_cache_dir()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
