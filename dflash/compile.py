"""torch.compile for both roles: settings, guards against silent recompiles, staggered warmup.

The drafter's forward and loss are compiled with ``mode="reduce-overhead"``, so
forward and backward replay as CUDA graphs (CUDAGraph Trees); the optimizer
stays outside. CUDAGraph Trees keeps its state per thread and torch <= 2.12
asserts when a graph is recorded off the main thread, so every compile and
replay happens on the rank's main thread. Shapes are static (length buckets,
a fixed micro-batch and anchor count), so after warmup nothing should compile
or record again: :class:`CompileGuard` counts it if it does.

Warmup is staggered: ranks compile in turns, one turn at a time, between
barriers. The first turn compiles cold and fills the inductor cache; later
turns load from it in seconds instead of all ranks compiling everything at
once. This only pays when ranks share the device index (every rank sees its GPU
as ``cuda:0``, see ``launch.sh``) and the cache directory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._functorch.config
import torch._inductor.config
from omegaconf import DictConfig
from torch._dynamo.utils import counters

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileSettings:
    drafter: bool
    target: bool
    backend: str
    mode: str | None  # only for the inductor backend
    strict: bool
    warmup_turns: int

    @property
    def cuda_graphs(self) -> bool:
        return self.drafter and self.mode == "reduce-overhead"

    def compile(self, fn: Callable, mode: str | None = None, fullgraph: bool = True) -> Callable:
        """``fn`` compiled with static shapes; ``mode`` overrides the drafter's mode."""
        mode = mode if mode is not None else self.mode
        options = {"mode": mode} if self.backend == "inductor" and mode else {}
        return torch.compile(fn, backend=self.backend, dynamic=False, fullgraph=fullgraph, **options)


def _flag(value, device: torch.device) -> bool:
    """``auto`` means on for CUDA, off on the CPU (Inductor's C++ path costs more
    to compile than it saves on a small CPU run)."""
    return device.type == "cuda" if value == "auto" else bool(value)


def resolve_settings(cfg: DictConfig, device: torch.device, num_buckets: int) -> CompileSettings:
    c = cfg.compile
    drafter = _flag(c.enabled, device)
    mode = c.mode if device.type == "cuda" else None  # no CUDA graphs on the CPU
    turns = c.warmup_turns
    if turns == "auto":
        turns = 2 if device.type == "cuda" else 1
    if int(turns) < 1:
        raise ValueError(f"compile.warmup_turns={turns} must be >= 1 or auto")
    if c.cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(c.cache_dir)
    # The loss is a custom autograd.Function whose forward and backward are pure
    # tensor code traced into the graph that keys the cache, so caching it is
    # sound; without this, ranks that warm up later re-trace instead of loading.
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
    # One graph per length bucket and role must fit Dynamo's cache, or it would
    # quietly fall back to eager after the limit.
    limit = max(torch._dynamo.config.recompile_limit, 4 * num_buckets)
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 8 * limit)
    return CompileSettings(
        drafter=drafter,
        target=drafter and _flag(c.target, device),
        backend=c.backend,
        mode=mode,
        strict=bool(c.strict),
        warmup_turns=int(turns),
    )


def assert_main_thread() -> None:
    """Compiled steps run where CUDAGraph Trees keeps its state: the main thread."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "dflash runs model work on the main thread only (CUDAGraph Trees state is "
            f"thread-local); called from thread {threading.current_thread().name!r}"
        )


def compile_counts() -> dict[str, int]:
    """Process-wide compile events since start-up."""
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "fx_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
        "fx_cache_misses": counters["inductor"]["fxgraph_cache_miss"],
        "aot_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_cache_misses": counters["aot_autograd"]["autograd_cache_miss"],
        "aot_cache_bypasses": counters["aot_autograd"]["autograd_cache_bypass"],
    }


class RecompileError(RuntimeError):
    """A graph compiled or a CUDA graph was skipped after warmup, with compile.strict=true."""


class CompileGuard:
    """After warmup every shape has its graph: any further compile or CUDA-graph skip
    means a shape escaped the buckets or a guard failed, and the step silently
    runs slower. Counted per step and logged; an error with ``strict``."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.baseline: dict[str, int] | None = None
        self.reported: dict[str, int] = {}

    def arm(self) -> None:
        self.baseline = compile_counts()

    def check(self, where: str) -> dict[str, int]:
        if self.baseline is None:
            return {}
        now = compile_counts()
        late = {k: now[k] - self.baseline[k] for k in ("graphs", "cudagraph_skips")}
        found = {"recompiles": late["graphs"], "cudagraph_skips": late["cudagraph_skips"]}
        if any(found.values()):
            message = (
                f"{where}: {found['recompiles']} graph(s) compiled and {found['cudagraph_skips']} CUDA-graph "
                "skip(s) after warmup; a shape escaped the buckets (TORCH_LOGS=recompiles,cudagraphs says which)"
            )
            if self.strict:
                raise RecompileError(message + " [compile.strict=true]")
            if found != self.reported:
                log.warning(message)
                self.reported = found
        return found


def warmup_turn(first_of_role: bool, index_in_role: int, turns: int) -> int:
    """Turn 0 holds the first rank of each role (they compile different graphs, so
    both compile cold at once); the others are dealt round-robin over the rest."""
    if turns == 1 or first_of_role:
        return 0
    return 1 + (index_in_role - 1) % (turns - 1)


def share_compile_threads(ranks_compiling: int) -> None:
    """Each rank would start one compile worker per core of the node: split the cores
    between the ranks of this node that compile in the same turn, so a rank that
    compiles alone gets them all. ``TORCHINDUCTOR_COMPILE_THREADS`` overrides."""
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        torch._inductor.config.compile_threads = max(1, (os.cpu_count() or 1) // max(1, ranks_compiling))


def staggered_warmup(
    warm: Callable[[], None], turn: int, turns: int, barrier: Callable[[int], None] | None = None
) -> dict:
    """Run ``warm`` in ``turn`` of ``turns``; every rank calls ``barrier(t)`` after each turn
    ``t`` (``None``: one process, no barrier). Returns this rank's wall time and its
    compile-cache hits and misses."""
    before = compile_counts()
    began = ended = time.time()
    for current in range(turns):
        if current == turn:
            began = time.time()
            warm()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ended = time.time()
        if barrier is not None:
            barrier(current)
    after = compile_counts()
    report = {k: after[k] - before[k] for k in after}
    report.update(turn=turn, wall_s=round(ended - began, 2), began=began, ended=ended)
    return report
