"""The cross-rank protocol over gloo: every phase in order, and a clear, bounded error
(rank, phase, missing peers) when a rank never arrives or never finishes its turn.

These tests hold on a loaded machine (the suite at ``-n 4`` on 2 busy cores): a bound
under test is timed only from the moment its ranks are all there (each marks that it is
up, after spawning and importing torch, which take a minute or more there, and the ranks
wait for each other's marks, not for the clock); the bounds of the test itself are
generous (:data:`UP_S`, :data:`ENDS_S`) and hold only a hang, which they still fail."""

import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from runs import free_port

from dflash.distributed.protocol import Protocol, ProtocolError, Timeouts
from dflash.distributed.topology import Topology
from dflash.distributed.watchdog import EXIT_CODE, GRACE_S

# Spawning a rank and importing torch: seconds on an idle machine, a minute or more on a busy one.
UP_S = 300
# Once every rank is up, each ends within this or the test fails as a hang; the bounds under
# test are seconds and the product's own are 60 s, so this only ever holds a hang.
ENDS_S = 300


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
    _arrive(Path(out), rank, range(world))
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
    _ended(_spawn(_every_phase, (world, targets, free_port(), str(tmp_path)), world), tmp_path)
    outcomes = {(tmp_path / f"rank{r}").read_text() for r in range(world)}
    turns = [r % 2 for r in range(world)]
    assert outcomes == {f"ok (7, 3, {turns}, 7, {list(range(world))})"}


def _until(ready: Callable[[], bool], bound_s: float = UP_S) -> None:
    """Until ``ready()``, at most ``bound_s``: ranks wait on each other's files and on the
    store's port, not on the clock."""
    until = time.monotonic() + bound_s
    while not ready() and time.monotonic() < until:
        time.sleep(0.05)


def _arrive(out: Path, rank: int, ranks: Iterable[int]) -> None:
    """Mark this rank up, then wait until the ``ranks`` are: what a bound measures is then
    the phase under test, not how much later another rank finished importing torch."""
    (out / f"up{rank}").touch()
    _until(lambda: all((out / f"up{r}").exists() for r in ranks))


def _spawn(fn: Callable, args: tuple, nprocs: int) -> list:
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn").processes


def _ended(processes: list, out: Path, ranks: Iterable[int] | None = None, bound_s: float = ENDS_S) -> None:
    """Until the ``ranks`` (all) have ended: at most :data:`UP_S` for every rank to be up
    (or gone), then ``bound_s``. A rank still running then is killed with the rest, and
    the test fails: a hang, whatever the machine's load."""
    ranks = range(len(processes)) if ranks is None else list(ranks)
    _until(lambda: all((out / f"up{r}").exists() or not p.is_alive() for r, p in enumerate(processes)))
    until = time.monotonic() + bound_s
    for r in ranks:
        processes[r].join(max(0.0, until - time.monotonic()))
    hung = [r for r in ranks if processes[r].is_alive()]
    if hung:
        for p in processes:
            p.kill()
        pytest.fail(f"ranks {hung} still running {bound_s} s after every rank was up: a hang")


def _elapsed(message: str) -> float:
    """The seconds ``_record`` measured for a failed phase."""
    return float(message.split(" after ")[1].split(" s")[0])


def _listening(port: int) -> bool:
    """Whether rank 0's store accepts connections on ``port``."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _late_rank(rank: int, world: int, port: int, out: str, init_s: float) -> None:
    out = Path(out)
    (out / f"up{rank}").touch()
    if rank == world - 1:  # never arrives: waits until the others have named it, then leaves
        _until(lambda: all((out / f"rank{r}").exists() for r in range(world - 1)))
        return
    if rank == 0:  # hosts the store once rank 1 is up, so rank 1 joins within rank 0's bound
        _until((out / "up1").exists)
    else:  # joins the store once it listens, after rank 0 arrived: rank 0 is never missing
        _until(lambda: _listening(port))
    proto = _protocol(rank, world, 1, port, Timeouts(init_s=init_s, warmup_s=60, step_s=60))
    try:  # exit quietly, so that the harness does not end the other rank before it reports
        _record(out, rank, proto.start)
    except Exception:  # noqa: BLE001 - recorded
        pass
    if rank == 0:  # rank 0 hosts the store: gone, it would end rank 1's wait early
        _until((out / "rank1").exists)


def test_a_rank_that_never_arrives_is_named_within_the_init_timeout(tmp_path):
    """Rank 2 never joins: ranks 0 and 1 each name it, and only it, after the start-up
    bound (not before it, nor at the 60 s of the other bounds). Rank 0 hosts the store
    (no torchrun) and joins first; rank 1 joins as soon as the store listens, so rank 0 is
    never missing for it. Rank 0 names rank 1 too only if rank 1 came 4 s after it."""
    init_s = 4
    _ended(_spawn(_late_rank, (3, free_port(), str(tmp_path), init_s), 3), tmp_path)
    message = (tmp_path / "rank1").read_text()
    assert message.endswith("rank 1: joining the job did not complete within 4 s; waiting for rank 2"), message
    first = (tmp_path / "rank0").read_text()
    assert first.endswith(("rank 0: joining the job did not complete within 4 s; waiting for rank 2",
                           "rank 0: joining the job did not complete within 4 s; waiting for ranks 1, 2")), first
    for text in (message, first):
        assert init_s <= _elapsed(text) < 30, text


def _slow_turn(rank: int, port: int, out: str) -> None:
    _arrive(Path(out), rank, range(2))
    proto = _protocol(rank, 2, 1, port, Timeouts(init_s=60, warmup_s=3, step_s=60))
    proto.start()
    _record(Path(out), rank, lambda: proto.warmup(lambda: time.sleep(600) if rank == 1 else None, turn=rank, turns=2))


def test_a_warmup_turn_that_overruns_is_named_and_its_rank_ends(tmp_path):
    """Rank 1 compiles (sleeps) past the warmup bound: rank 0, waiting at the turn's
    barrier, names it and fails. Rank 0 hosts the store, so what it names does not depend
    on when rank 1 ends; rank 1, if its own watchdog ends it first, ends with the
    watchdog's exit code, and is ended here otherwise."""
    first, slow = _spawn(_slow_turn, (free_port(), str(tmp_path)), 2)
    _ended([first, slow], tmp_path, ranks=[0])
    if slow.is_alive():
        slow.terminate()
    _ended([first, slow], tmp_path, ranks=[1])
    message = (tmp_path / "rank0").read_text()
    assert first.exitcode == 1, message
    assert message.endswith("rank 0: compile warmup turn 1, ranks still compiling did not complete within 3 s; "
                            "waiting for rank 1"), message
    assert 3 <= _elapsed(message) < 30, message
    assert slow.exitcode in (EXIT_CODE, -signal.SIGTERM), slow.exitcode
    assert not (tmp_path / "rank1").exists()  # rank 1 never finished its turn


class _Signalling:
    """A store that says when a wait on it has begun."""

    def __init__(self, store: dist.Store):
        self.store, self.waiting = store, threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self.waiting.set()
        self.store.wait(keys, timeout)


def test_a_store_that_goes_away_is_named_as_such_not_as_a_timeout():
    """The store's host ends while a rank waits on it: the rank says so at once, instead of
    a timeout that names every rank, itself too (what rank 1 said when rank 0, hosting the
    store, failed first)."""
    port = free_port()
    host = [dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)]
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    proto = Protocol(Topology(2, 1, 1, micro_batch_size=1, batch_size=1), torch.device("cpu"), Timeouts(60, 60, 60))
    proto.store = store = _Signalling(dist.PrefixStore("dflash", client))
    ender = threading.Thread(target=lambda: (store.waiting.wait(), host.clear()))  # the host's store stops
    ender.start()
    with pytest.raises(ProtocolError) as failed:
        proto.final_step()
    ender.join()
    assert str(failed.value).startswith("rank 1: waiting for the drafters to finish training failed: the rendezvous "
                                        "store stopped answering"), failed.value


def test_the_watchdog_ends_a_hung_phase_with_a_named_message():
    """It ends the process with its exit code, naming the phase, GRACE_S after the phase's
    bound (never before: torch's own timeout comes first) and long before the hung call
    would have returned; timed from the phase's start, which the child prints, not from
    the child's start-up."""
    code = (
        "import time; from dflash.distributed.watchdog import Watchdog\n"
        "w = Watchdog(5)\n"
        "print(time.monotonic(), flush=True)\n"
        "with w.phase('receiving micro-batch 12', 0.5, [2]):\n"
        "    time.sleep(600)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=ENDS_S)
    ended = time.monotonic()
    assert proc.returncode == EXIT_CODE, proc.stderr
    ended -= float(proc.stdout)  # one monotonic clock for every process (Linux)
    assert "rank 5: receiving micro-batch 12 did not complete within 0.5 s; waiting for rank 2" in proc.stderr
    assert "time.sleep(600)" in proc.stderr or "line 5" in proc.stderr  # the stacks are dumped
    assert 0.5 + GRACE_S <= ended < 60, ended
