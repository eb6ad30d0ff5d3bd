"""The cross-rank protocol over gloo: every phase in order, and a clear, bounded error
(rank, phase, missing peers) when a rank never arrives or never finishes its turn."""

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from runs import free_port

from dflash.distributed.protocol import Protocol, Timeouts
from dflash.distributed.topology import Topology
from dflash.distributed.watchdog import EXIT_CODE


def _protocol(rank: int, world: int, targets: int, port: int, timeouts: Timeouts) -> Protocol:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    topo = Topology(world, rank, targets, micro_batch_size=1, batch_size=world - targets)
    return Protocol(topo, torch.device("cpu"), timeouts)


def _record(out: Path, rank: int, body) -> None:
    """Run ``body``, writing its outcome to ``out/rank<r>`` (the test reads every rank's)."""
    began = time.monotonic()
    try:
        result = body()
        (out / f"rank{rank}").write_text(f"ok {result}")
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        (out / f"rank{rank}").write_text(f"{type(e).__name__} after {time.monotonic() - began:.1f} s: {e}")
        raise


def _every_phase(rank: int, world: int, targets: int, port: int, out: str) -> None:
    proto = _protocol(rank, world, targets, port, Timeouts(init_s=60, warmup_s=60, step_s=60))

    def body():
        proto.start()
        steps = proto.agree_steps(7 if rank == 0 else 99)
        start = proto.agree_start(3 if rank == proto.topo.metrics_rank else 99)
        reports = proto.warmup(lambda: None, turn=rank % 2, turns=2)
        if rank == proto.topo.metrics_rank:
            proto.announce_stop(steps)
        final = proto.final_step() if proto.topo.is_target else steps
        assert proto.stopped() or not proto.topo.is_target
        proto.export_written()
        summaries = proto.summaries({"rank": rank})
        proto.close()
        return steps, start, [r["turn"] for r in reports], final, [s["rank"] for s in summaries]

    _record(Path(out), rank, body)


@pytest.mark.parametrize("world,targets", [(3, 1), (4, 2)], ids=["T1D2", "T2D2"])
def test_every_phase_agrees(tmp_path, world, targets):
    mp.start_processes(_every_phase, args=(world, targets, free_port(), str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    outcomes = {(tmp_path / f"rank{r}").read_text() for r in range(world)}
    turns = [r % 2 for r in range(world)]
    assert outcomes == {f"ok (7, 3, {turns}, 7, {list(range(world))})"}


def _until(ready: Callable[[], bool], bound_s: float = 60) -> None:
    """Until ``ready()``, at most ``bound_s``: ranks wait on each other's files and on the
    store's port, not on the clock (spawning and importing torch take seconds under load)."""
    until = time.monotonic() + bound_s
    while not ready() and time.monotonic() < until:
        time.sleep(0.05)


def _listening(port: int) -> bool:
    """Whether rank 0's store accepts connections on ``port``."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _late_rank(rank: int, world: int, port: int, out: str, init_s: float) -> None:
    out = Path(out)
    if rank == world - 1:  # never arrives: waits until the others have named it, then leaves
        for r in range(world - 1):
            _until((out / f"rank{r}").exists)
        return
    if rank > 0:  # joins the store once it listens, so rank 0's start is not timed against it
        _until(lambda: _listening(port))
    proto = _protocol(rank, world, 1, port, Timeouts(init_s=init_s, warmup_s=60, step_s=60))
    try:  # exit quietly, so that the harness does not end the other rank before it reports
        _record(out, rank, proto.start)
    except Exception:  # noqa: BLE001 - recorded
        pass
    if rank == 0:  # rank 0 hosts the store: gone, it would end rank 1's wait early, naming rank 1 too
        _until((out / "rank1").exists)


def test_a_rank_that_never_arrives_is_named_within_the_init_timeout(tmp_path):
    init_s = 4
    mp.start_processes(_late_rank, args=(3, free_port(), str(tmp_path), init_s), nprocs=3, join=True, start_method="spawn")
    # Without torchrun rank 0 hosts the store and itself waits for its clients until the
    # timeout (under torchrun the agent hosts it), so rank 1 sees rank 0 missing too.
    message = (tmp_path / "rank1").read_text()
    assert "rank 1: joining the job did not complete within 4 s; waiting for ranks 0, 2" in message, message
    assert float(message.split(" after ")[1].split(" s")[0]) < init_s + 10
    assert "rank 0: joining the job" in (tmp_path / "rank0").read_text()


def _slow_turn(rank: int, port: int, out: str) -> None:
    proto = _protocol(rank, 2, 1, port, Timeouts(init_s=60, warmup_s=3, step_s=60))
    proto.start()
    _record(Path(out), rank, lambda: proto.warmup(lambda: time.sleep(60) if rank == 1 else None, turn=rank, turns=2))


def test_a_warmup_turn_that_overruns_is_named_and_its_rank_ends(tmp_path):
    """Rank 1 compiles (sleeps) past the warmup bound: rank 0, waiting at the turn's
    barrier, names it and fails. Rank 0 hosts the store, so what it names does not depend
    on when rank 1 ends; rank 1, if its own watchdog ends it first, ends with the
    watchdog's exit code, and is ended here otherwise."""
    context = mp.start_processes(_slow_turn, args=(free_port(), str(tmp_path)), nprocs=2, join=False,
                                 start_method="spawn")
    first, slow = context.processes
    first.join(timeout=120)
    if slow.is_alive():
        slow.terminate()
    slow.join(timeout=30)
    message = (tmp_path / "rank0").read_text()
    assert first.exitcode == 1, message
    assert ("compile warmup turn 1, ranks still compiling did not complete within 3 s; waiting for rank 1"
            in message), message
    assert slow.exitcode in (EXIT_CODE, -signal.SIGTERM), slow.exitcode
    assert not (tmp_path / "rank1").exists()  # rank 1 never finished its turn


def test_the_watchdog_ends_a_hung_phase_with_a_named_message():
    code = (
        "import time; from dflash.distributed.watchdog import Watchdog\n"
        "w = Watchdog(5)\n"
        "with w.phase('receiving micro-batch 12', 0.5, [2]):\n"
        "    time.sleep(30)\n"
    )
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_CODE
    assert "rank 5: receiving micro-batch 12 did not complete within 0.5 s; waiting for rank 2" in proc.stderr
    assert "time.sleep(30)" in proc.stderr or "line 4" in proc.stderr  # the stacks are dumped
    assert time.monotonic() - began < 25
