"""torch.compile for both roles: settings, guards against silent recompiles, staggered warmup.

The drafter's forward and loss are compiled with ``mode="reduce-overhead"``, so
forward and backward replay as CUDA graphs (CUDAGraph Trees); the optimizer
stays outside. CUDAGraph Trees keeps its state per thread and torch <= 2.12
asserts when a graph is recorded off the main thread, so every compile and
replay happens on the rank's main thread. Shapes are static (length buckets,
a fixed micro-batch and anchor count), so after warmup nothing should compile
or record again: :class:`CompileGuard` counts it if it does.

Warmup is staggered: ranks compile in turns, one turn at a time, between
barriers. The first rank of each role compiles in the first turn; what it
compiled (FX graphs, AOTAutograd entries and, on CUDA, the Triton kernels they
bundle) is serialised with ``torch.compiler.save_cache_artifacts`` and handed to
the ranks of later turns, which load it into their own cache and warm up in
seconds instead of all ranks compiling everything at once. The bytes travel over
the job's control plane (:mod:`dflash.distributed.protocol`), so nodes need no shared
filesystem; ranks must still share the device index (every rank sees its GPU as
``cuda:0``, see ``launch.sh``), which is part of the cache key.

The cache itself lives in ``compile.cache_dir`` (by default a chosen
``TORCHINDUCTOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/dflash/compile`` or
``~/.cache/dflash/compile``), so a second launch with the same settings loads
instead of compiling; inductor's own default under ``/tmp`` does not survive a
reboot.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config
from torch._dynamo.callback import CallbackArgs, CallbackTrigger, callback_handler
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from dflash import flex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileSettings:
    drafter: bool
    target: bool
    backend: str
    mode: str | None  # only for the inductor backend
    strict: bool
    warmup_turns: int
    attention: str = "triton"  # flex attention's kernels: "flash" (FlashAttention-4) or "triton" (Inductor's)
    auto: bool = False  # compile.enabled=auto
    # auto on CUDA: on until the run's length is known, then weighed (dflash.run.warmup.choose_warmup)
    pending: bool = False

    @property
    def cuda_graphs(self) -> bool:
        return self.drafter and self.mode == "reduce-overhead"

    def compile(self, fn: Callable, mode: str | None = None, fullgraph: bool = True) -> Callable:
        """``fn`` compiled with static shapes; ``mode`` overrides the drafter's mode."""
        mode = mode if mode is not None else self.mode
        options = {"mode": mode} if self.backend == "inductor" and mode else {}
        return torch.compile(fn, backend=self.backend, dynamic=False, fullgraph=fullgraph, **options)


def _flag(value, device: torch.device) -> bool:
    """``auto`` means on for CUDA (until :func:`dflash.run.warmup.choose_warmup` weighs the
    compile against the run), off on the CPU (Inductor's C++ path costs more to compile
    than it saves on a small CPU run)."""
    return device.type == "cuda" if value == "auto" else bool(value)


def resolve_settings(c: Mapping, device: torch.device, num_buckets: int) -> CompileSettings:
    """The ``compile`` config group for this device; sets the process's compile caches and limits."""
    drafter = _flag(c["enabled"], device)
    mode = c["mode"] if device.type == "cuda" else None  # no CUDA graphs on the CPU
    turns = c["warmup_turns"]
    if turns == "auto":
        turns = 2 if device.type == "cuda" else 1
    if int(turns) < 1:
        raise ValueError(f"compile.warmup_turns={turns} must be >= 1 or auto")
    use_cache_dir(c["cache_dir"])
    use_cache_key_tag(cache_key_tag())
    attention = resolve_attention(c.get("attention", "auto"), device)
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
        target=drafter and _flag(c["target"], device),
        backend=c["backend"],
        mode=mode,
        strict=bool(c["strict"]),
        warmup_turns=int(turns),
        attention=attention,
        auto=c["enabled"] == "auto",
        pending=c["enabled"] == "auto" and drafter,
    )


ATTENTION_KERNELS = ("auto", "flash", "triton")


def resolve_attention(setting: str, device: torch.device) -> str:
    """``compile.attention`` for ``device``: ``flash`` runs every flex attention call on
    FlashAttention-4's kernels (:func:`dflash.flex.use_flash_kernels`), ``triton`` on
    Inductor's; ``auto`` is flash where they can run. Off CUDA nothing runs flex attention
    (the CPU trains under a dense mask), so the setting only names the kernels a plan's
    rates are for there: auto is triton. ``flash`` on a GPU where they cannot run is an
    error naming the reason."""
    if setting not in ATTENTION_KERNELS:
        raise ValueError(f"compile.attention={setting!r} must be one of {', '.join(ATTENTION_KERNELS)}")
    if device.type != "cuda":
        return "triton" if setting == "auto" else setting
    why = None if setting == "triton" else flex.flash_unsupported(device)
    if setting == "flash" and why:
        raise ValueError(f"compile.attention=flash: FlashAttention-4's kernels cannot run here: {why}. "
                         "Use compile.attention=auto or triton")
    if setting == "auto":
        setting = "triton" if why else "flash"
    if setting == "flash":
        flex.use_flash_kernels()
    log.info("flex attention kernels: %s%s", setting, f" ({why})" if why else "")
    return setting


# Where dflash defines its custom ops (package-relative); tests/run/test_compile.py checks the list.
CUSTOM_OP_SOURCES = ("model/drafter.py", "model/linear.py", "objective/xent.py")


TAG_VARIABLE = "TORCH_COMPILE_CACHE_KEY_TAG"


def cache_key_tag(sources: tuple[str, ...] = CUSTOM_OP_SOURCES) -> str:
    """The tag every compile-cache key takes (``torch.compiler.config.cache_key_tag``):
    ``TORCH_COMPILE_CACHE_KEY_TAG`` if set (less the part :func:`use_cache_key_tag` put
    there), and a hash of the files that define dflash's custom ops. Their fake
    implementations and autograd formulas (``sink_linear``'s backward) are traced into the
    compiled graphs, but the caches key a graph on the op's name alone: after an upgrade
    that changed one, a warm cache would hand back graphs of the old code, a stale
    backward, silently. With the hash, they compile afresh."""
    root = Path(__file__).parent
    digest = hashlib.sha256(b"".join((root / s).read_bytes() for s in sources)).hexdigest()[:16]
    users = [t for t in os.environ.get(TAG_VARIABLE, "").split("+") if t and not t.startswith("dflash-ops-")]
    return "+".join([*users, f"dflash-ops-{digest}"])


def use_cache_key_tag(tag: str) -> None:
    """Key every compile cache with ``tag``, in this process and in Inductor's compile
    workers. The workers are processes of their own that read the tag from the
    environment, and the Triton autotune cache files each kernel's best config under a
    key that includes it: a worker without the tag files it where this process never
    looks, so every warm launch benchmarked those kernels again (4.1 s of a 21 s warm
    launch at the paper shapes on an H200). The pool starts at the first compile, after this."""
    torch.compiler.config.cache_key_tag = tag
    os.environ[TAG_VARIABLE] = tag


def persistent_cache_dir() -> str:
    """``$XDG_CACHE_HOME/dflash/compile``, else ``~/.cache/dflash/compile``: unlike
    inductor's default under ``/tmp``, it survives a reboot."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(root, "dflash", "compile")


def chosen_cache_dir() -> str | None:
    """``TORCHINDUCTOR_CACHE_DIR`` if someone chose it (a benchmark or sweep picking a
    fresh cache, say). Importing ``torch._dynamo`` writes inductor's default there, so
    that value counts as unset."""
    found = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not found or os.path.abspath(found) == os.path.abspath(default_cache_dir()):
        return None
    return found


def use_cache_dir(setting: str | None) -> str:
    """Point inductor's FX graph, AOTAutograd and Triton caches, which all live under
    ``TORCHINDUCTOR_CACHE_DIR``, at ``compile.cache_dir``: ``auto`` is
    :func:`chosen_cache_dir`, else :func:`persistent_cache_dir`; a path is that path
    (``~`` expanded); None leaves inductor its own choice. Returns the directory in effect."""
    if setting == "auto":
        setting = chosen_cache_dir() or persistent_cache_dir()
    if setting:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(os.path.expanduser(str(setting)))
    where = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    log.info("compile cache: %s", where)
    return where


def assert_main_thread() -> None:
    """Compiled steps run where CUDAGraph Trees keeps its state: the main thread."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "dflash runs model work on the main thread only (CUDAGraph Trees state is "
            f"thread-local); called from thread {threading.current_thread().name!r}"
        )


def _count_recording(args: CallbackArgs) -> None:
    """Counts every CUDA graph that CUDAGraph Trees records. After warmup a recording is
    a re-recording: a graph's static input moved, or the tensors alive between graphs
    changed, and the step stalls 0.1-0.2 s for the capture (on the H200, the backward
    after every optimizer step until the block indices came through
    :class:`FixedAddresses`)."""
    if args.callback_trigger == CallbackTrigger.CUDAGRAPH_RECORDING:
        counters["dflash"]["cudagraph_recordings"] += 1


def compile_counts() -> dict[str, int]:
    """Process-wide compile events since start-up; CUDA-graph recordings since the first
    call after the last ``torch._dynamo.reset()``, which drops Dynamo's callbacks."""
    if _count_recording not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_count_recording)
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "cudagraph_recordings": counters["dflash"]["cudagraph_recordings"],
        "fx_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
        "fx_cache_misses": counters["inductor"]["fxgraph_cache_miss"],
        "aot_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_cache_misses": counters["aot_autograd"]["autograd_cache_miss"],
        "aot_cache_bypasses": counters["aot_autograd"]["autograd_cache_bypass"],
    }


class FixedAddresses:
    """Copies of a compiled step's inputs at addresses that stay the same call after call.

    CUDAGraph Trees takes every tensor a compiled backward reads from outside the graph
    pool as a static input and records the backward again when one's address changes.
    A tensor the forward saves for its backward as it came in (flex attention saves a
    ``BlockMask``'s block indices) is such a tensor: built fresh for each micro-batch,
    it lands where the caching allocator puts it, the same address while each
    micro-step allocates alike, another after the optimizer step. Measured on the H200,
    every optimizer step then recorded a new backward graph (100-200 ms each, and one
    more graph kept in the pool each time). Copied here first, the graph reads one set
    of buffers per shape: a few kilobytes of block indices, copied in one kernel launch."""

    def __init__(self) -> None:
        self._held: dict[tuple, list[torch.Tensor]] = {}

    def __call__(self, name: str, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        key = (name, *((t.shape, t.dtype, t.device) for t in tensors))
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = [torch.empty_like(t) for t in tensors]
        torch._foreach_copy_(held, list(tensors))
        return tuple(held)


class RecompileError(RuntimeError):
    """A graph compiled, a CUDA graph was skipped or recorded again after warmup, with
    compile.strict=true."""


class CompileGuard:
    """After warmup every shape has its graph: any further compile or CUDA-graph skip
    means a shape escaped the buckets or a guard failed, and any further CUDA-graph
    recording that a graph's inputs moved; either way the step silently runs slower.
    Counted per step and logged; an error with ``strict``."""

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
        late = {k: now[k] - self.baseline[k] for k in ("graphs", "cudagraph_skips", "cudagraph_recordings")}
        found = {"recompiles": late["graphs"], "cudagraph_skips": late["cudagraph_skips"],
                 "cudagraph_rerecords": late["cudagraph_recordings"]}
        if any(found.values()):
            message = (
                f"{where}: {found['recompiles']} graph(s) compiled, {found['cudagraph_skips']} CUDA-graph "
                f"skip(s) and {found['cudagraph_rerecords']} CUDA graph(s) recorded again after warmup; a shape "
                "escaped the buckets or a graph's input moved (TORCH_LOGS=recompiles,cudagraphs says which)"
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


def save_artifacts() -> bytes:
    """Everything this process compiled or loaded from its cache, serialised (empty
    when nothing was: the ``aot_eager`` backend writes no cache)."""
    saved = torch.compiler.save_cache_artifacts()
    return saved[0] if saved is not None else b""


def load_artifacts(data: bytes) -> int:
    """Write another process's :func:`save_artifacts` into this process's cache, so
    compiling the same graphs hits it. Returns the bytes loaded (0 when the bytes
    were empty or did not deserialise: then this rank simply compiles)."""
    if not data or torch.compiler.load_cache_artifacts(data) is None:
        return 0
    return len(data)


def warm_source(counts: dict[str, int], received: int) -> str:
    """How a rank came by its compiled code: ``compiled`` (any cache miss, or a backend
    without a cache), ``received`` (artifacts from its role's first rank, then only
    hits), ``loaded from disk`` (only hits), or ``nothing compiled``."""
    if not counts["graphs"]:
        return "nothing compiled"
    hits = counts["fx_cache_hits"] + counts["aot_cache_hits"]
    if counts["fx_cache_misses"] or counts["aot_cache_misses"] or not hits:
        return "compiled"
    return "received" if received else "loaded from disk"


def staggered_warmup(
    warm: Callable[[], None],
    turn: int,
    turns: int,
    barrier: Callable[[int], None] | None = None,
    receive: Callable[[], bytes] | None = None,
    send: Callable[[bytes], None] | None = None,
) -> dict:
    """Run ``warm`` in ``turn`` of ``turns``; every rank calls ``barrier(t)`` after each turn
    ``t`` (``None``: one process, no barrier). In its turn a rank first loads the
    artifacts ``receive`` returns, and after warming up hands its own to ``send``.
    Returns this rank's wall time, compile-cache hits and misses, how it came by
    its compiled code (:func:`warm_source`) and the artifact bytes it received or sent."""
    before = compile_counts()
    began = ended = time.time()
    received = sent = 0
    for current in range(turns):
        if current == turn:
            began = time.time()
            if receive is not None:
                received = load_artifacts(receive())
            warm()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if send is not None:
                artifacts = save_artifacts()
                send(artifacts)
                sent = len(artifacts)
            ended = time.time()
        if barrier is not None:
            barrier(current)
    after = compile_counts()
    report = {k: after[k] - before[k] for k in after}
    report.update(turn=turn, wall_s=round(ended - began, 2), began=began, ended=ended,
                  cache=warm_source(report, received), artifacts_received=received, artifacts_sent=sent)
    if received and report["cache"] == "compiled":
        log.warning("this rank loaded its role's compiled code and still compiled (cache misses)%s",
                    _device_index_hint())
    return report


def _device_index_hint() -> str:
    """Why received code misses on a rank that does not see its GPU as ``cuda:0``: the
    compiled graphs are keyed by the device index, which plain torchrun makes LOCAL_RANK."""
    if not torch.cuda.is_available() or torch.cuda.current_device() == 0:
        return ""
    return (f": it runs on cuda:{torch.cuda.current_device()}, and compiled code is keyed by the device index. "
            "Launch with ./launch.sh (torchrun --virtual-local-rank), where every rank sees its GPU as cuda:0, "
            "so that later warmup turns load what the first compiled")
