"""The cross-rank protocol of a disaggregated run: its groups and its phases, in order.

Both roles hold one :class:`Protocol` and call the same phases in the same
order, so a phase cannot exist on one side only::

    start()                 join, create the groups, first contact on every link
    agree_steps(n)          target rank 0 announces the step count (it read the data)
    agree_start(s)          the metrics rank announces the resume step
    warmup(warm, turn)      staggered compile turns (later turns load the compiled artifacts
                            of their role's first rank), then everyone's warmup report
    ... training: bundles on the pair groups, gradients on the drafter group;
        targets ask proceed(m) before each micro-batch (the group's leader polls the
        stop signal and tells its group), the metrics rank calls announce_stop(step) ...
    final_step()            targets wait for that announcement
    export_written()        the metrics rank has written export/
    summaries(summary)      every rank's end-of-run summary
    close()

Two planes. Tensors (bundles, gradients) travel on NCCL groups on the GPU
(gloo on the CPU): one group per (target, drafter) pair, so a pair's messages
never queue behind another pair's, and one group of the drafter ranks. With a
tensor-parallel target (``target.tensor_parallel=k``) each group of ``k`` target
ranks also has a group of its own for the sharded prefill's reductions, and only
its leader has pairs: a follower sends nothing. Control
(step counts, barriers, warmup turns, the stop signal, summaries) travels
through the rendezvous store: every control phase is "each rank writes its key,
then waits for the keys of the ranks it needs", so a rank that waits too long
knows exactly which ranks never arrived and says so. No gloo group is needed,
so no group ever leaves a rank out on one backend and not another.

Why NCCL is initialised lazily (no ``device_id`` in ``init_process_group``):
once the default group is bound to a device, torch's ``_new_process_group_helper``
makes every rank outside a new group (of any backend) call
``perform_nocolor_split`` on the default communicator, an NCCL collective over
all ranks, while the members of a gloo group make no split at all. Any group
that leaves ranks out then strands them in ``ncclCommSplit``: the hang seen at
every split of 3 or more ranks on torch 2.11 / NCCL 2.28.9. Without the bound
device, ``new_group`` does no NCCL work; each pair's communicator is created by
its two members at first contact, which :meth:`Protocol.start` makes happen at
start-up, in one global order, under the start-up timeout.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dflash.compile import staggered_warmup
from dflash.distributed.topology import Topology
from dflash.distributed.watchdog import Watchdog, describe

log = logging.getLogger(__name__)

# The backends' own timeouts (the NCCL watchdog aborts the process) stand behind the
# phase timeouts, so the first message names the phase and the peers.
BACKEND_GRACE_S = 60.0
# The libuv TCPStore server (torch's default) drops a client that sends a value over
# 8 MiB, so larger values (compiled artifacts) travel in chunks of this size.
STORE_CHUNK_BYTES = 4 * 2**20
# A failing rank's abort of its communicators is bounded by this, then the watchdog ends it.
ABORT_S = 30.0


AGREE_STEPS = "waiting for target rank 0 to load the target and the data"


class ProtocolError(RuntimeError):
    """A cross-rank phase that timed out or failed, with the rank, phase and peers named."""


@dataclass(frozen=True)
class Timeouts:
    """Bounds of the three kinds of wait (``topology.*_timeout_s``; docs/layouts.md, "No silent hang")."""

    init_s: float  # joining, creating groups, first contact on every link
    warmup_s: float  # loading the model and data, and each compile warmup turn
    step_s: float  # any wait once data flows: a bundle, a gradient reduction, the stop signal


class Protocol:
    """Owns the process groups and the control store of one rank."""

    def __init__(self, topo: Topology, device: torch.device, timeouts: Timeouts, eval_link: bool = False):
        self.topo, self.device, self.timeouts = topo, device, timeouts
        self.wants_eval_link = eval_link  # only runs with eval.every create that group
        self.watchdog = Watchdog(topo.rank)
        self.store: dist.Store | None = None
        self.pairs: dict[tuple[int, int], dist.ProcessGroup] = {}
        self.drafters: dist.ProcessGroup | None = None
        self.target_group: dist.ProcessGroup | None = None  # this rank's tensor-parallel group, if any
        self.eval_link: dist.ProcessGroup | None = None  # target 0 and the metrics rank (dflash.decode.live)

    @property
    def rank(self) -> int:
        return self.topo.rank

    def pairs_of_target(self) -> dict[int, dist.ProcessGroup]:
        """Peer drafter rank -> pair group, as this target rank sees them."""
        return {d: g for (t, d), g in self.pairs.items() if t == self.rank}

    def pairs_of_drafter(self) -> dict[int, dist.ProcessGroup]:
        """Peer target rank -> pair group, as this drafter rank sees them."""
        return {t: g for (t, d), g in self.pairs.items() if d == self.rank}

    def everyone_but_me(self) -> list[int]:
        return [r for r in range(self.topo.world_size) if r != self.rank]

    def other_drafters(self) -> list[int]:
        """The drafter ranks a drafter's collectives wait on."""
        return [r for r in self.topo.drafter_ranks if r != self.rank]

    def phase(self, what: str, timeout_s: float, peers: Iterable[int] = ()):
        """A bounded wait on ``peers`` (see :mod:`dflash.distributed.watchdog`)."""
        return self.watchdog.phase(what, timeout_s, peers)

    # -- start-up -------------------------------------------------------------------------

    def start(self) -> None:
        """Join the job, create the groups, and make first contact on every link, all
        bounded by ``init_s``."""
        topo, init = self.topo, self.timeouts.init_s
        backend_timeout = datetime.timedelta(seconds=self.timeouts.step_s + BACKEND_GRACE_S)
        with self._failing("joining the job (the rendezvous store)", init, self.everyone_but_me()):
            store = self._join_store(datetime.timedelta(seconds=init))
        self.store = dist.PrefixStore("dflash", store)
        self._gather("joining the job", None, range(topo.world_size), init)
        with self._failing("creating the process groups", init, self.everyone_but_me()):
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=store, rank=topo.rank, world_size=topo.world_size, timeout=backend_timeout)
            # every rank creates every group in one order; non-members get NON_GROUP_MEMBER
            for t in topo.senders:
                for d in topo.drafter_ranks:
                    self.pairs[(t, d)] = dist.new_group([t, d], timeout=backend_timeout, group_desc=f"bundles_t{t}_d{d}")
            self.drafters = dist.new_group(topo.drafter_ranks, timeout=backend_timeout, group_desc="drafters")
            if topo.tensor_parallel > 1:
                for ranks in topo.target_groups:
                    group = dist.new_group(ranks, timeout=backend_timeout, group_desc=f"tensor_parallel_{ranks[0]}")
                    if self.rank in ranks:
                        self.target_group = group
            if self.wants_eval_link:
                self.eval_link = dist.new_group([0, topo.metrics_rank], timeout=backend_timeout,
                                                group_desc="eval_weights")
        self._first_contact()
        self._gather("connecting every target to every drafter", None, range(topo.world_size), init)

    def _join_store(self, timeout: datetime.timedelta) -> dist.Store:
        """The rendezvous store, without waiting for the other ranks: the gather of
        "joining the job" that follows waits for them and names the missing ones.

        Under torchrun the agent hosts the store and every rank is a client. Without it
        (tests, benchmarks, ``set_rank_env``) rank 0 hosts it, and ``dist.rendezvous``
        would make rank 0 wait inside the store's constructor for every rank to connect.
        On a timeout that constructor fails and takes the store down at once, under the
        ranks that did arrive: their own waits, begun later, then fail before their bound,
        naming every rank, themselves included, and rank 0's message names none. So here
        rank 0 starts the store and goes on; the store stays up as long as rank 0 does."""
        topo = self.topo
        if topo.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
            store, _, _ = next(dist.rendezvous("env://", topo.rank, topo.world_size, timeout=timeout))
            return store
        try:
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except KeyError as e:
            raise ValueError(f"rank 0 hosts the rendezvous store without torchrun: set {e.args[0]}") from e
        return dist.TCPStore(host, port, topo.world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                             multi_tenant=True, use_libuv=os.environ.get("USE_LIBUV", "1") == "1")

    def _first_contact(self) -> None:
        """One small message on every pair and one all-reduce in the drafter group, so
        every communicator exists before warmup. Pairs go in one global order
        ((t, d) ascending), which every rank's own sequence follows, so the smallest
        unfinished pair always has both ends ready: no cycle of waits."""
        topo, init = self.topo, self.timeouts.init_s
        for (t, d), group in self.pairs.items():
            if self.rank not in (t, d):
                continue
            peer = d if self.rank == t else t
            with self._failing(f"first contact between target {t} and drafter {d}", init, [peer]):
                buf = torch.tensor([t if self.rank == t else -1], dtype=torch.int64, device=self.device)
                op = dist.isend if self.rank == t else dist.irecv
                for work in dist.batch_isend_irecv([dist.P2POp(op, buf, peer, group=group)]):
                    work.wait()
                if int(buf.item()) != t:
                    raise ProtocolError(f"rank {self.rank}: first contact from target {t} carried {int(buf.item())}")
        if self.eval_link is not None and self.rank in (0, topo.metrics_rank):
            # the same operation, direction and group as the weights later take, so whatever
            # communicator they use exists before training (its creation would block the drafter)
            peer = topo.metrics_rank if self.rank == 0 else 0
            with self._failing("first contact on the link for evaluation weights", init, [peer]):
                buf = torch.tensor([topo.metrics_rank if self.rank != 0 else -1], device=self.device)
                if self.rank == 0:
                    dist.recv(buf, src=peer, group=self.eval_link)
                else:
                    dist.isend(buf, dst=peer, group=self.eval_link).wait()
                if int(buf.item()) != topo.metrics_rank:
                    raise ProtocolError(f"rank {self.rank}: first contact on the evaluation link carried {int(buf.item())}")
        if self.target_group is not None:
            members = [r for r in topo.group_of(self.rank) if r != self.rank]
            with self._failing("first all-reduce of the tensor-parallel target group", init, members):
                one = torch.ones(1, device=self.device)
                dist.all_reduce(one, group=self.target_group)
                if int(one.item()) != topo.tensor_parallel:
                    raise ProtocolError(f"rank {self.rank}: tensor-parallel group counted {int(one.item())} ranks")
        if not topo.is_target:
            with self._failing("first all-reduce of the drafter group", init, self.other_drafters()):
                one = torch.ones(1, device=self.device)
                dist.all_reduce(one, group=self.drafters)
                if int(one.item()) != topo.num_drafters:
                    raise ProtocolError(f"rank {self.rank}: drafter group counted {int(one.item())} ranks")

    # -- set-up ---------------------------------------------------------------------------

    def agree_steps(self, steps: int | None, data: dict | None = None) -> int:
        """The total step count, from target rank 0 (it read the data); ``steps`` is
        ignored on every other rank. Rank 0's ``data`` summary (samples, skips) goes
        along for the metrics rank (:meth:`data_summary`)."""
        mine = {"steps": steps, "data": data} if self.rank == 0 else None
        return self._gather(AGREE_STEPS, mine, [0], self.timeouts.warmup_s)[0]["steps"]

    def data_summary(self) -> dict | None:
        """What target rank 0 said about its data in :meth:`agree_steps`."""
        return json.loads(self.store.get(f"{AGREE_STEPS}/0"))["data"]

    def agree_start(self, start: int | None) -> int:
        """The step training resumes from, from the metrics rank (it read the checkpoint)."""
        source = self.topo.metrics_rank
        mine = start if self.rank == source else None
        what = f"waiting for drafter rank {source} to build the drafter and read any checkpoint"
        return self._gather(what, mine, [source], self.timeouts.warmup_s)[source]

    def warmup(self, warm: Callable[[], None], turn: int, turns: int, share: bool = False) -> list[dict]:
        """Run ``warm`` in turn ``turn`` of ``turns``: the ranks of a turn compile while the
        others wait. With ``share`` (the role compiles) the first rank of each role, which
        warms up in turn 0, sends what it compiled through the store and the role's ranks
        of later turns load it first, so they need neither a shared filesystem nor a
        compile of their own. Each turn is bounded by ``warmup_s``. Returns every rank's
        warmup report, in rank order."""
        limit = self.timeouts.warmup_s

        def watched() -> None:
            with self.phase(f"compile warmup (turn {turn})", limit):
                warm()

        def barrier(current: int) -> None:
            self._gather(f"compile warmup turn {current}, ranks still compiling", None, range(self.topo.world_size), limit)

        receive, send = self._artifact_links(turn, turns) if share else (None, None)
        report = staggered_warmup(watched, turn, turns, barrier, receive, send)
        return self._all_values("warmup reports", {"rank": self.rank, "role": self._role(), **report})

    def _role(self) -> str:
        return "colocated" if self.topo.colocated else "target" if self.topo.is_target else "drafter"

    def _artifact_links(
        self, turn: int, turns: int
    ) -> tuple[Callable[[], bytes] | None, Callable[[bytes], None] | None]:
        """This rank's part in handing compiled artifacts on: the role's first rank sends
        at the end of turn 0, its ranks of later turns receive before theirs. A role of
        one rank, or one turn, hands nothing on."""
        topo, role = self.topo, self._role()
        members = list(range(topo.num_targets)) if topo.is_target else topo.drafter_ranks
        if turns == 1 or len(members) == 1:
            return None, None
        key, source = f"compile_artifacts/{role}", members[0]
        if self.rank == source:
            if turn != 0:
                raise ValueError(f"rank {self.rank}: the first {role} rank hands its compiled artifacts on, "
                                 f"so it warms up in turn 0, not {turn}")
            return None, lambda data: put_bytes(self.store, key, data)
        if turn == 0:
            return None, None

        def receive() -> bytes:
            what = f"receiving the compiled {role} from rank {source}"
            self._wait([f"{key}/chunks"], what, [source], self.timeouts.warmup_s)
            return get_bytes(self.store, key)

        return receive, None

    # -- evaluation while training (dflash.decode.live) -----------------------------------------

    def request_eval(self, step: int) -> None:
        """The metrics rank: the weights after ``step`` are on their way to target rank 0."""
        self.store.set("eval/request", json.dumps(step))

    def eval_requested(self) -> int | None:
        """Target rank 0, per micro-batch: the newest step offered, if any."""
        return self._peek("eval/request")

    def post_eval_result(self, record: dict) -> None:
        self.store.set(f"eval/result/{record['step']}", json.dumps(record))

    def eval_result(self, step: int) -> dict | None:
        return self._peek(f"eval/result/{step}")

    # -- the end of training --------------------------------------------------------------

    def stopped(self) -> bool:
        """Has the metrics rank announced the end of training? (targets, per micro-batch)"""
        return self.store.check(["stop"])

    def proceed(self, m: int) -> bool:
        """Targets, before micro-batch ``m``: go on unless training stopped. The ranks of a
        tensor-parallel group must agree, or one would enter a prefill whose reductions
        the others never join: the leader polls the stop signal and writes its answer,
        the others wait for it (bounded by ``step_s``)."""
        topo = self.topo
        if topo.tensor_parallel == 1:
            return not self.stopped()
        leader, key = topo.leader(self.rank), f"proceed/{topo.leader(self.rank)}/{m}"
        if self.rank == leader:
            go = not self.stopped()
            self.store.set(key, "1" if go else "0")
            return go
        self._wait([key], f"waiting for target rank {leader} to start micro-batch {m}", [leader],
                   self.timeouts.step_s)
        return self.store.get(key) == b"1"

    def announce_stop(self, step: int) -> None:
        """The metrics rank: training ended at ``step`` (completed, or SIGTERM)."""
        self.store.set("stop", json.dumps(step))

    def final_step(self) -> int:
        """Targets: wait for :meth:`announce_stop`, the step the drafters ended at."""
        self._wait(["stop"], "waiting for the drafters to finish training", [self.topo.metrics_rank], self.timeouts.step_s)
        return json.loads(self.store.get("stop"))

    def export_written(self) -> None:
        self._gather("writing the export", None, range(self.topo.world_size), self.timeouts.step_s)

    def summaries(self, summary: dict) -> list[dict]:
        return self._all_values("end-of-run summaries", summary)

    def abort(self) -> None:
        """On an error: end this rank's communicators without waiting for its peers.
        NCCL's orderly shutdown waits for them, and a peer still waiting on this rank
        (a send it posted, a collective) then holds this process alive and silent, so
        torchrun never learns of the error and never ends the run."""
        if not dist.is_initialized():
            return
        try:
            # bounded too: an abort that blocks in NCCL would hang the rank all the same
            with self.phase("aborting this rank's communicators after an error", ABORT_S):
                if dist.get_backend() == "nccl":
                    dist.distributed_c10d._abort_process_group()
                else:
                    dist.destroy_process_group()
        except Exception:
            log.exception("rank %d: aborting the communicators failed; exiting with the original error", self.rank)

    def close(self) -> None:
        """Rank 0 leaves last: without torchrun it hosts the store that others still read."""
        self.store.set(f"done/{self.rank}", "1")
        if self.rank == 0:
            done = [f"done/{r}" for r in range(self.topo.world_size)]
            self._wait(done, "closing", range(self.topo.world_size), self.timeouts.step_s)
        dist.destroy_process_group()

    # -- the store --------------------------------------------------------------------------

    def _all_values(self, what: str, value: Any) -> list:
        ranks = range(self.topo.world_size)
        values = self._gather(what, value, ranks, self.timeouts.step_s)
        return [values[r] for r in ranks]

    def _gather(self, what: str, value: Any, sources: Iterable[int], timeout_s: float) -> dict[int, Any]:
        """Write this rank's ``value`` under ``what``, wait for the ``sources``' values
        and return them. Every rank writes (its key also marks its arrival)."""
        sources = list(sources)
        self.store.set(f"{what}/{self.rank}", json.dumps(value))
        keys = [f"{what}/{r}" for r in sources]
        self._wait(keys, what, sources, timeout_s)
        return {r: json.loads(self.store.get(k)) for r, k in zip(sources, keys)}

    def _wait(self, keys: list[str], what: str, sources: Iterable[int], timeout_s: float) -> None:
        sources = list(sources)
        with self.phase(what, timeout_s, sources):
            try:
                self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
            except dist.DistError as e:
                try:
                    missing = [r for r, k in zip(sources, keys) if not self.store.check([k])]
                except dist.DistError:  # not a timeout: every rank would be named, this one too
                    raise ProtocolError(f"rank {self.rank}: {what} failed: the rendezvous store stopped answering "
                                        f"(its host ended: the torchrun agent, or rank 0 without torchrun): {e}") from e
                raise ProtocolError(describe(self.rank, what, timeout_s, missing)) from e

    def _peek(self, key: str) -> Any:
        """The value under ``key`` if it is there yet, without waiting; else None."""
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    @contextmanager
    def _failing(self, what: str, timeout_s: float, peers: Iterable[int]) -> Iterator[None]:
        """A watched phase whose torch errors are re-raised naming the rank, phase and peers."""
        peers = list(peers)
        with self.phase(what, timeout_s, peers):
            try:
                yield
            except dist.DistError as e:
                raise ProtocolError(describe(self.rank, what, timeout_s, peers) + f": {e}") from e


def put_bytes(store: dist.Store, key: str, data: bytes) -> None:
    """``data`` under ``key`` in chunks the store accepts; the chunk count, written
    last, says the value is complete (wait for ``<key>/chunks``)."""
    starts = range(0, len(data), STORE_CHUNK_BYTES)
    for i, start in enumerate(starts):
        store.set(f"{key}/{i}", data[start : start + STORE_CHUNK_BYTES])
    store.set(f"{key}/chunks", str(len(starts)))


def get_bytes(store: dist.Store, key: str) -> bytes:
    """What :func:`put_bytes` wrote under ``key``, once ``<key>/chunks`` exists."""
    count = int(store.get(f"{key}/chunks"))
    return b"".join(store.get(f"{key}/{i}") for i in range(count))


def free_port() -> int:
    """A free TCP port on this host, for a rendezvous without torchrun."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_rank_env(rank: int, world: int, port: int, local: bool = False) -> None:
    """The environment torchrun would give rank ``rank`` of ``world`` on this host (for
    benchmarks and tests that spawn ranks themselves); ``local`` also sets LOCAL_RANK,
    so each rank takes its own GPU."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if local:
        os.environ["LOCAL_RANK"] = str(rank)
