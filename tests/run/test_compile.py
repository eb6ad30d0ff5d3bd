"""The compiled drafter step (``aot_eager`` on the CPU: Dynamo and AOTAutograd, no codegen)
equals the eager step, keeps one graph per length bucket, and accumulates correctly."""

import copy
import importlib.util
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import flat_grads, tiny_drafter, tiny_head
from test_step import BS, batch, split
from torch._library.custom_ops import OPDEFS

from dflash.compile import (
    CompileGuard,
    CompileSettings,
    FixedAddresses,
    RecompileError,
    assert_main_thread,
    compile_counts,
    share_compile_threads,
    warmup_turn,
)
from dflash.model.drafter import FULL
from dflash.objective.config import ObjectiveConfig
from dflash.run.step import (
    DrafterTrainer,
    build_optimizer,
    cosine_schedule,
)

AOT = CompileSettings(drafter=True, target=False, backend="aot_eager", mode=None, strict=True, warmup_turns=1)


def make_trainer(drafter, settings: CompileSettings | None, kl: bool = False, autocast: torch.dtype | None = None):
    opt = build_optimizer(drafter, 1e-2, 0.0, (0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_schedule(10, 0.0, 0.0))
    obj = ObjectiveConfig(block_size=BS, mask_token_id=95, gamma=7.0, kl_weight=0.5 if kl else 0.0, chunk_size=16)
    return DrafterTrainer(drafter, tiny_head(), obj, opt, sched, grad_clip=1.0, autocast_dtype=autocast, compile_settings=settings)


def with_topk(mb, pf, k=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (*mb.input_ids.shape, k)
    pf.topk_values = torch.randn(shape, generator=g)
    pf.topk_indices = torch.randint(0, 96, shape, generator=g)
    return mb, pf


@pytest.mark.parametrize("kl", [False, True])
def test_compiled_steps_equal_eager(kl):
    torch._dynamo.reset()
    base = tiny_drafter(block_size=BS)
    eager, compiled = make_trainer(copy.deepcopy(base), None, kl), make_trainer(copy.deepcopy(base), AOT, kl)
    for step in range(3):
        mb, pf = with_topk(*batch(rows=[0, 1], lengths=[32, 20], seed=step))
        results = []
        for trainer in (eager, compiled):
            trainer.micro_step(mb, pf)
            results.append(trainer.finish())
        assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-5)
        assert results[0]["grad_norm"] == pytest.approx(results[1]["grad_norm"], rel=1e-4)
    for a, b in zip(eager.drafter.parameters(), compiled.drafter.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_autocast_around_the_compiled_step_applies_inside():
    """Autocast is entered outside the compiled call (so the graph stays cacheable):
    the compiled step must still run its matmuls in bf16, exactly as eager does."""
    torch._dynamo.reset()
    base = tiny_drafter(block_size=BS)
    trainers = [make_trainer(copy.deepcopy(base), s, autocast=torch.bfloat16) for s in (None, AOT)]
    fp32 = make_trainer(copy.deepcopy(base), None)
    mb, pf = batch(rows=[0, 1], lengths=[32, 20])
    losses = []
    for trainer in (*trainers, fp32):
        trainer.micro_step(mb, pf)
        losses.append(trainer.finish()["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert abs(losses[0] - losses[2]) > 1e-5 * losses[0]  # fp32 differs: bf16 really was used


def test_compiled_bf16_micro_steps_sum_the_gradients_eager_sums():
    """Under autocast the compiled backward adds each linear weight's gradient into its
    fp32 buffer in place (dflash.model.linear): two micro-batches in, the buffers equal eager's,
    no weight holds a ``.grad``, and the step is one graph (its masks another)."""
    torch._dynamo.reset()
    base = tiny_drafter(block_size=BS)
    eager, compiled = (make_trainer(copy.deepcopy(base), s, autocast=torch.bfloat16) for s in (None, AOT))
    before = compile_counts()["graphs"]
    mb, pf = batch(rows=[0, 1, 2, 3], lengths=[32, 20, 30, 9])
    for sl in (slice(0, 2), slice(2, 4)):
        for trainer in (eager, compiled):
            trainer.micro_step(*split(mb, pf, sl))
    assert compile_counts()["graphs"] - before == 2
    assert all(p.grad is None for p in compiled.compute.parameters())
    assert all(g.abs().sum() > 0 for g in compiled.grads)
    torch.testing.assert_close(flat_grads(eager), flat_grads(compiled), rtol=1e-5, atol=1e-7)


def test_accumulation_under_compile_equals_one_micro_batch():
    torch._dynamo.reset()
    base = tiny_drafter(block_size=BS)
    mb, pf = batch(rows=[0, 1, 2, 3], lengths=[32, 12, 30, 9])
    one = make_trainer(copy.deepcopy(base), None)
    one.micro_step(mb, pf)
    m_one = one.finish()
    two = make_trainer(copy.deepcopy(base), AOT)
    for sl in (slice(0, 2), slice(2, 4)):
        two.micro_step(*split(mb, pf, sl))
    m_two = two.finish()
    assert m_one["loss"] == pytest.approx(m_two["loss"], rel=1e-5)
    for a, b in zip(one.drafter.parameters(), two.drafter.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_one_step_graph_per_bucket_and_strict_guard():
    torch._dynamo.reset()
    trainer = make_trainer(tiny_drafter(block_size=BS), AOT)
    before = compile_counts()["graphs"]
    trainer.warmup([batch(rows=[0, 1], lengths=[32, 30]), batch(rows=[0, 1], lengths=[16, 10], seq_len=16)])
    assert compile_counts()["graphs"] - before == 4  # per bucket: the step and its masks
    assert not flat_grads(trainer).any(), "warmup must leave no gradient behind"
    guard = CompileGuard(strict=True)
    guard.arm()
    # Other real lengths, same buckets: no new graph.
    for lengths, seq_len in (([20, 9], 32), ([12, 14], 16)):
        trainer.micro_step(*batch(rows=[2, 3], lengths=lengths, seq_len=seq_len))
        trainer.finish()
        assert guard.check("step") == {"recompiles": 0, "cudagraph_skips": 0, "cudagraph_rerecords": 0}
    # A length outside the warmed buckets compiles again: strict turns that into an error.
    trainer.micro_step(*batch(rows=[0, 1], lengths=[20, 20], seq_len=24))
    with pytest.raises(RecompileError, match="2 graph"):  # the step and its masks
        guard.check("step 3")


def test_a_cuda_graph_recorded_after_warmup_is_reported():
    """CUDAGraph Trees announces each recording through Dynamo's callbacks; after warmup
    one is a re-recording (a graph's input moved), reported and, strict, an error."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    guard = CompileGuard(strict=False)
    guard.arm()
    with callback_handler.install_callbacks(CallbackTrigger.DYNAMO, "0/0"):
        pass
    assert guard.check("step 1") == {"recompiles": 0, "cudagraph_skips": 0, "cudagraph_rerecords": 0}
    with callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "0/0"):
        pass
    assert guard.check("step 2")["cudagraph_rerecords"] == 1
    strict = CompileGuard(strict=True)
    strict.arm()
    with callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "0/0"):
        pass
    with pytest.raises(RecompileError, match="1 CUDA graph"):
        strict.check("step 3")


def test_the_masks_reach_a_cuda_graph_step_at_the_same_addresses_every_step():
    """The backward of a CUDA-graph step reads the block indices its forward saved at
    their recorded addresses: however the allocator moves the freshly built masks
    between optimizer steps, the step sees one buffer per shape, holding this
    micro-batch's values."""
    torch._dynamo.reset()
    graphs = CompileSettings(drafter=True, target=False, backend="aot_eager", mode="reduce-overhead", strict=True,
                             warmup_turns=1)
    trainer = make_trainer(tiny_drafter(block_size=BS), graphs)
    assert trainer.cuda_graphs
    seen, forward_loss = [], trainer.forward_loss

    def spy(*args):
        mask = args[-1][FULL][0]
        seen.append((mask.data_ptr(), mask.clone()))
        return forward_loss(*args)

    trainer.forward_loss = spy
    long, short = batch(rows=[0, 1], lengths=[32, 30]), batch(rows=[2, 3], lengths=[12, 7])
    ballast = []
    for mb, pf in (long, short, long):
        trainer.micro_step(mb, pf)
        trainer.finish()
        ballast.append(torch.ones(4096, dtype=torch.bool))  # the allocator's state differs at each step
    assert len({ptr for ptr, _ in seen}) == 1
    expected = trainer._mask_parts(long[0].anchors, long[0].position_ids)[FULL][0]
    torch.testing.assert_close(seen[0][1], expected)
    assert not torch.equal(seen[1][1], expected)
    torch.testing.assert_close(seen[2][1], expected)


def test_fixed_addresses_hold_one_buffer_per_name_and_shape():
    fixed = FixedAddresses()
    a = fixed("full", (torch.arange(6), torch.ones(2, 3)))
    b = fixed("full", (torch.arange(6) * 2, torch.zeros(2, 3)))
    assert [t.data_ptr() for t in a] == [t.data_ptr() for t in b]
    torch.testing.assert_close(b[0], torch.arange(6) * 2)
    other = fixed("sliding", (torch.arange(6), torch.ones(2, 3)))
    wider = fixed("full", (torch.arange(8), torch.ones(2, 3)))
    assert other[0].data_ptr() != a[0].data_ptr() and wider[0].data_ptr() != a[0].data_ptr()


def test_model_work_only_on_the_main_thread():
    assert_main_thread()
    errors = []
    worker = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, assert_main_thread)))
    worker.start()
    worker.join()
    assert errors and "main thread" in str(errors[0].value)


def test_warmup_turns():
    # first rank of each role compiles cold in group 0, the rest share the remaining groups
    assert [warmup_turn(r == 0, r, 3) for r in range(5)] == [0, 1, 2, 1, 2]
    assert {warmup_turn(r == 0, r, 1) for r in range(4)} == {0}


def test_compile_threads_are_shared_by_the_ranks_of_a_turn(monkeypatch):
    import os

    import torch._inductor.config as inductor

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(inductor, "compile_threads", inductor.compile_threads)
    share_compile_threads(4)
    assert inductor.compile_threads == 4
    share_compile_threads(1)  # compiling alone: every core
    assert inductor.compile_threads == 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_tables_equal_the_formula_eager_and_compiled(dtype):
    """``dflash::rope_cos_sin`` hides the tables from Inductor's fusion, not from the
    math: both ways they are cos and sin of positions x inv_freq, bit for bit."""
    from dflash.model.drafter import RotaryEmbedding

    rope = RotaryEmbedding(64, 1e6)
    positions = torch.randint(0, 40000, (2, 37))
    freqs = positions.float()[..., None] * rope.inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    expected = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    compiled = torch.compile(lambda p: rope(p, dtype), backend="aot_eager", fullgraph=True)
    for got in (rope(positions, dtype), compiled(positions)):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_the_attention_kernels_resolve_for_the_device(monkeypatch):
    """``compile.attention``: off CUDA auto is triton and an explicit choice is kept (it names
    the rates a dry run plans with); on a GPU auto is flash exactly where FlashAttention-4's
    kernels can run, and flash where they cannot is refused with the reason."""
    import dflash.compile as compile_module
    from dflash import flex

    switched = []
    monkeypatch.setattr(flex, "use_flash_kernels", lambda: switched.append(True))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_module.resolve_attention("auto", cpu) == "triton"
    assert compile_module.resolve_attention("flash", cpu) == "flash" and not switched
    with pytest.raises(ValueError, match="compile.attention='cute'"):
        compile_module.resolve_attention("cute", cpu)

    monkeypatch.setattr(flex, "flash_unsupported", lambda device: "the flash-attn-4 package is not installed")
    assert compile_module.resolve_attention("auto", cuda) == "triton"
    with pytest.raises(ValueError, match="flash-attn-4 package is not installed.*compile.attention=auto or triton"):
        compile_module.resolve_attention("flash", cuda)
    assert not switched

    monkeypatch.setattr(flex, "flash_unsupported", lambda device: None)
    assert compile_module.resolve_attention("triton", cuda) == "triton" and not switched
    assert compile_module.resolve_attention("auto", cuda) == "flash" and switched == [True]


def test_flash_kernels_cannot_run_off_cuda_or_without_the_package(monkeypatch):
    from dflash import flex

    assert "CUDA" in flex.flash_unsupported(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert "compute capability 8.0" in flex.flash_unsupported(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash-attn-4" in flex.flash_unsupported(torch.device("cuda"))

    # flash-attn-4 found without the CuteDSL it imports (a partial install): refused here, where
    # the compiler would fail only once it generated the kernels, well into the warmup
    found = {"flash_attn.cute"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in found else None)
    assert "nvidia-cutlass-dsl" in flex.flash_unsupported(torch.device("cuda"))
    found.add("cutlass")
    assert flex.flash_unsupported(torch.device("cuda")) is None


def test_the_cutedsl_index_expression_is_added_only_where_torch_lacks_it(monkeypatch):
    """torch 2.11's CuteDSL code generator has no ``index_expr``: one is added (an integer
    becomes a literal of the kernel); a torch that has its own keeps it."""
    import sympy
    from torch._inductor.codegen.cutedsl.cutedsl_op_overrides import CuteDSLOpOverrides

    from dflash import flex

    own = vars(CuteDSLOpOverrides).get("index_expr")
    flex._add_cutedsl_index_expr()
    assert vars(CuteDSLOpOverrides).get("index_expr") is own
    if own is not None:
        monkeypatch.delattr(CuteDSLOpOverrides, "index_expr")
    flex._add_cutedsl_index_expr()
    assert CuteDSLOpOverrides.index_expr(sympy.Integer(3), torch.int32) == "3"


def test_every_custom_op_of_dflash_is_hashed_into_the_cache_key():
    """The compile caches key a graph on a custom op's name alone, while its fake and its
    autograd formula are traced into the graph: each op's source file must be among the
    files :func:`cache_key_tag` hashes, or an upgrade that changed it would be served the
    old graphs."""
    import dflash
    import dflash.run.build  # imports every module a training run compiles
    from dflash.compile import CUSTOM_OP_SOURCES

    root = Path(dflash.__file__).parent
    defined = {Path(op._init_fn.__code__.co_filename).relative_to(root).as_posix()
               for name, op in OPDEFS.items() if name.startswith("dflash::")}
    assert len(defined) >= 3 and defined <= set(CUSTOM_OP_SOURCES)


def test_the_cache_key_tag_follows_the_ops_source_and_keeps_the_users(tmp_path, monkeypatch):
    import dflash.compile as compile_module

    (tmp_path / "ops.py").write_text("def backward(): return 1\n")
    monkeypatch.setattr(compile_module, "__file__", str(tmp_path / "compile.py"))
    monkeypatch.delenv("TORCH_COMPILE_CACHE_KEY_TAG", raising=False)
    before = compile_module.cache_key_tag(("ops.py",))
    (tmp_path / "ops.py").write_text("def backward(): return 2\n")
    after = compile_module.cache_key_tag(("ops.py",))
    assert before.startswith("dflash-ops-") and before != after
    monkeypatch.setenv("TORCH_COMPILE_CACHE_KEY_TAG", "mine")
    assert compile_module.cache_key_tag(("ops.py",)) == f"mine+{after}"


def test_resolving_the_settings_sets_the_tag_for_the_compile_workers_too(monkeypatch):
    """Inductor's compile workers are fresh processes: the Triton autotune cache keys a
    kernel's best config with the tag, so a worker must compute the key this process
    reads, or every warm launch benchmarks the kernels again. Resolving twice (a second
    run in one process) keeps one tag, not the tag appended to itself."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    from dflash.compile import TAG_VARIABLE, cache_key_tag, resolve_settings

    monkeypatch.setenv(TAG_VARIABLE, "mine")
    settings = {"enabled": True, "mode": None, "backend": "aot_eager", "target": False, "strict": False,
                "warmup_turns": 1, "cache_dir": None, "attention": "auto"}
    resolve_settings(settings, torch.device("cpu"), 1)
    tag = torch.compiler.config.cache_key_tag
    assert tag == cache_key_tag() and tag.startswith("mine+dflash-ops-")
    resolve_settings(settings, torch.device("cpu"), 1)
    assert torch.compiler.config.cache_key_tag == tag
    code = "from torch._inductor.runtime.autotune_cache import AutotuneCache as A; print(A._prepare_key('triton_kernel.py'))"
    worker = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert worker.stdout.strip() == AutotuneCache._prepare_key("triton_kernel.py")
