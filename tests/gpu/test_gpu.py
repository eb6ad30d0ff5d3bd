"""CUDA paths on one GPU: flex BlockMask against dense SDPA, CUDA graphs against eager, NCCL init."""

import copy
import os
import threading

import pytest
import torch
import torch.distributed as dist
from helpers import flat_grads, tiny_drafter, tiny_head
from torch.nn.attention.flex_attention import flex_attention

import dflash.model.drafter as drafter_module
from dflash import flex
from dflash.compile import CompileGuard, CompileSettings
from dflash.data.bundle import random_batch, random_prefill, to_device
from dflash.distributed.protocol import free_port
from dflash.model.drafter import FULL, SLIDING
from dflash.model.fp8 import fp8_unsupported
from dflash.objective.anchors import (
    AnchorSpec,
    sample_anchors,
    sample_generator,
)
from dflash.objective.config import ObjectiveConfig
from dflash.objective.masks import build_mask
from dflash.run.checkpoint import HostBuffers, snapshot
from dflash.run.step import (
    DrafterTrainer,
    build_optimizer,
    cosine_schedule,
)
from dflash.topk import top_k_of_rows

pytestmark = pytest.mark.gpu


SLIDING_LAYER = {"layer_types": [SLIDING, FULL], "sliding_window": 40}


def drafter_grads(drafter, anchors, seq_len, bs, flex, attention, starts=None, dtype=torch.bfloat16):
    """The drafter's output and every parameter's gradient under the flex or the dense mask,
    with the inputs of a micro-batch of two rows (seeded). The loss is a fixed random
    projection of the output: the output leaves an RMSNorm, so its mean square is constant
    and would give gradients of rounding noise alone. ``dtype`` float64 runs in float64."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden = anchors.shape[1], drafter.config.hidden_size
    wide = torch.float64
    feats = torch.randn(2, seq_len, 3 * hidden, device="cuda", generator=g, dtype=wide)
    embeds = torch.randn(2, n * bs, hidden, device="cuda", generator=g, dtype=wide)
    projection = torch.randn(2, n * bs, hidden, device="cuda", generator=g, dtype=wide)
    ctx_pos = torch.arange(seq_len, device="cuda").expand(2, -1)
    positions = (anchors[..., None] + torch.arange(bs, device="cuda")).flatten(1)
    if dtype == wide:
        drafter = copy.deepcopy(drafter).double()
    else:
        feats, embeds = feats.float(), embeds.float()
    drafter.zero_grad()
    mask = build_mask(anchors, seq_len, bs, use_flex=flex, starts=starts)
    if attention:
        mask = {FULL: mask, SLIDING: build_mask(anchors, seq_len, bs, use_flex=flex, window=40, starts=starts)}
    with torch.autocast("cuda", dtype=dtype, enabled=dtype in (torch.bfloat16, torch.float16)):
        out = drafter(feats, embeds, ctx_pos, positions, mask)
    (out.double() * projection).sum().backward()
    return out.double(), {name: p.grad.double() for name, p in drafter.named_parameters()}


def training_anchors(seq_len: int, n: int) -> torch.Tensor:
    loss_mask = torch.zeros(2, seq_len, dtype=torch.long)
    loss_mask[:, 40:] = 1
    return torch.stack([sample_anchors(loss_mask[r], n, sample_generator(0, 0, r))[0] for r in range(2)]).cuda()


@pytest.mark.parametrize("packed", [False, True], ids=["one-sample", "packed"])
@pytest.mark.parametrize("attention", [{}, SLIDING_LAYER], ids=["full", "sliding"])
def test_drafter_flex_equals_dense_forward_and_backward(attention, packed):
    """The compiled flex kernels against SDPA with the dense mask, gradients included, in
    bf16: a mask that captures more tensors (a packed row's sample starts) must not change
    the backward (torch's compiled flex backward has gone wrong on custom masks before:
    pytorch/pytorch#158212)."""
    torch.manual_seed(0)
    bs, seq_len = 16, 256
    drafter = tiny_drafter(hidden=128, layer_ids=(1, 2, 3), block_size=bs, **attention).cuda()
    anchors = training_anchors(seq_len, 8)
    starts = (anchors // 100) * 100 if packed else None  # samples of 100 tokens side by side
    (flex_out, flex), (dense_out, dense) = (drafter_grads(drafter, anchors, seq_len, bs, f, attention, starts)
                                            for f in (True, False))
    torch.testing.assert_close(flex_out, dense_out, atol=3e-2, rtol=3e-2)
    flat = [torch.cat([g[k].flatten() for k in sorted(g)]) for g in (flex, dense)]
    assert torch.nn.functional.cosine_similarity(*flat, dim=0) > 0.999


@pytest.mark.parametrize("hidden", [128, 512], ids=["head-dim-32", "head-dim-128"])
@pytest.mark.parametrize("anchors", [8, 12], ids=["queries-128", "queries-192"])
def test_flex_backward_equals_dense_per_parameter_in_float32(anchors, hidden, monkeypatch):
    """Each parameter's float32 gradient through the flex kernels equals dense attention's
    in float64 (to 1e-4 of its size; dense attention in float32 is within 1e-6): a
    cosine over all gradients hid a context-side error that only the gradients of ``fc``
    and the key/value projections showed. 192 queries are not a whole number of 128-query
    tiles; a head size of 128 is Qwen3's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    bs, seq_len = 16, 256
    drafter = tiny_drafter(hidden=hidden, layer_ids=(1, 2, 3), block_size=bs).cuda()
    n = training_anchors(seq_len, anchors)
    (exact_out, exact), (flex_out, flex), (_, dense) = (
        drafter_grads(drafter, n, seq_len, bs, f, {}, dtype=d)
        for f, d in ((False, torch.float64), (True, torch.float32), (False, torch.float32)))

    def off(grads: dict) -> dict:
        return {k: float((grads[k] - exact[k]).norm() / exact[k].norm().clamp(min=1e-30)) for k in exact}

    torch.testing.assert_close(flex_out, exact_out, atol=1e-5, rtol=1e-5)
    if max(off(flex).values()) >= 1e-4:  # say whether dense float32 and flex's eager (math) path agree
        monkeypatch.setattr(drafter_module, "compiled_flex_attention", lambda: flex_attention)
        _, math = drafter_grads(drafter, n, seq_len, bs, True, {}, dtype=torch.float32)
        worst = sorted(off(flex).items(), key=lambda kv: -kv[1])[:4]
        pytest.fail(f"compiled flex against dense float64: {worst}; dense float32: {max(off(dense).values()):.2e}; "
                    f"flex's eager path: {max(off(math).values()):.2e}")


def _trainer(drafter, settings, packed: bool = False, autocast: torch.dtype | None = torch.bfloat16,
             fp8: bool = False):
    hidden = drafter.config.hidden_size
    opt = build_optimizer(drafter, 1e-3, 0.0, (0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_schedule(10, 0.0, 0.0))
    obj = ObjectiveConfig(block_size=16, mask_token_id=95, gamma=7.0, kl_weight=0.3, chunk_size=256, packed=packed)
    head = tiny_head(hidden=hidden).cuda()
    return DrafterTrainer(drafter, head, obj, opt, sched, 1.0, autocast, settings, fp8=fp8)


def assert_same_gradients(reference, trainer, tolerance: float = 5e-2) -> None:
    """The accumulated gradients of a step, before it is taken: within bf16 noise of the
    reference's as a whole, and in every parameter to 4x that."""
    off = [float((a - b).norm() / a.norm().clamp(min=1e-12)) for a, b in zip(reference.grads, trainer.grads)]
    assert float((flat_grads(trainer) - flat_grads(reference)).norm() / flat_grads(reference).norm()) < tolerance
    assert max(off) < 4 * tolerance, off


@pytest.mark.parametrize("attention", [{}, SLIDING_LAYER], ids=["full", "sliding"])
def test_reduce_overhead_equals_eager_with_accumulation(attention):
    """Five steps of two micro-batches each, alternating buckets, against eager steps
    over the dense mask: same gradients and losses within bf16 tolerance, and nothing
    compiles or skips CUDA graphs after warmup."""
    torch._dynamo.reset()
    base = tiny_drafter(hidden=256, layer_ids=(1, 2, 3), block_size=16, **attention).cuda()
    settings = CompileSettings(drafter=True, target=False, backend="inductor", mode="reduce-overhead", strict=True, warmup_turns=1)
    eager, graphed = _trainer(copy.deepcopy(base), None), _trainer(copy.deepcopy(base), settings)
    # the reference: eager over the dense mask (an eager step this small attends densely, DENSE_SCORES_LIMIT)
    spec = AnchorSpec(8, 0)
    data = {
        s: [(random_batch(2, s, 96, spec, seed=i), random_prefill(2, s, 768, torch.bfloat16, 4, 96, "cuda")) for i in range(10)]
        for s in (128, 256)
    }
    for trainer in (eager, graphed):
        trainer.warmup([data[128][0], data[256][0]])
    guard = CompileGuard(strict=True)
    guard.arm()
    for step in range(5):
        results = []
        for trainer in (eager, graphed):
            for micro in range(2):
                trainer.micro_step(*data[(128, 256)[(step + micro) % 2]][2 * step + micro])
        assert_same_gradients(eager, graphed)
        results = [eager.finish(), graphed.finish()]
        assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=2e-2)
        assert results[0]["grad_norm"] == pytest.approx(results[1]["grad_norm"], rel=5e-2)
        assert guard.check(f"step {step}") == {"recompiles": 0, "cudagraph_skips": 0, "cudagraph_rerecords": 0}


def test_a_dflash2_step_replays_its_cuda_graphs_step_after_step():
    """Six optimizer steps of a DFlash2 drafter under reduce-overhead after warmup: no
    recompile, no CUDA-graph skip and no graph recorded again. On the H200 the
    Qwen3-8B-shaped DFlash2 step recorded a graph again at the first micro-step of every
    other optimizer step (about 0.1 s each), which no counter reported then."""
    import dataclasses

    from dflash.model.drafter import DFlash2Config, DFlashDrafter

    torch._dynamo.reset()
    config = dataclasses.replace(tiny_drafter(hidden=256, layer_ids=(1, 2, 3), block_size=16).config,
                                 dflash2=DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                                       selector_top_k=4))
    torch.manual_seed(0)
    settings = CompileSettings(drafter=True, target=False, backend="inductor", mode="reduce-overhead", strict=True,
                               warmup_turns=1)
    trainer = _trainer(DFlashDrafter(config).cuda(), settings)
    data = [(random_batch(2, 256, 96, AnchorSpec(8, 0), seed=i), random_prefill(2, 256, 768, torch.bfloat16, 4, 96,
                                                                                  "cuda")) for i in range(13)]
    trainer.warmup([data[0]])
    guard = CompileGuard(strict=True)
    guard.arm()
    for step in range(6):
        for micro in range(2):
            trainer.micro_step(*data[1 + 2 * step + micro])
        assert trainer.finish() is not None
        assert guard.check(f"step {step}") == {"recompiles": 0, "cudagraph_skips": 0, "cudagraph_rerecords": 0}


def test_the_compiled_step_equals_the_eager_one_in_float32_with_the_kl_term(monkeypatch):
    """In float32 the compiled micro-step (Inductor's kernels, the loss's custom ops, flex)
    is the eager one to rounding, the KL term included: a gap of 1e-3 or more here was the
    symptom of transposed block indices and of repeated teacher ids (DESIGN section 5)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = tiny_drafter(hidden=256, layer_ids=(1, 2, 3), block_size=16).cuda()
    settings = CompileSettings(drafter=True, target=False, backend="inductor", mode="default", strict=False, warmup_turns=1)
    eager, compiled = (_trainer(copy.deepcopy(base), s, autocast=None) for s in (None, settings))
    batch = random_batch(2, 256, 96, AnchorSpec(8, 0), seed=3)
    prefill = random_prefill(2, 256, 768, torch.float32, 4, 96, "cuda")
    for trainer in (eager, compiled):
        trainer.micro_step(batch, prefill)
    assert float(compiled.stats.loss_sum) == pytest.approx(float(eager.stats.loss_sum), rel=1e-5)
    assert_same_gradients(eager, compiled, tolerance=1e-5)


def test_nccl_initialises_and_reduces_the_drafter_gradients():
    """The NCCL path on one GPU: lazy init as dflash.distributed.protocol does it, a drafter group,
    the gradient all-reduce of a step (two NCCL ranks cannot share one GPU)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        trainer = _trainer(tiny_drafter(hidden=256, layer_ids=(1, 2, 3), block_size=16).cuda(), None)
        batch = random_batch(2, 128, 96, AnchorSpec(8, 0))
        trainer.micro_step(batch, random_prefill(2, 128, 768, torch.bfloat16, 4, 96, "cuda"))
        before = flat_grads(trainer).clone()
        result = trainer.finish(group)
        assert result is not None and torch.isfinite(torch.tensor(result["loss"]))
        assert before.abs().sum() > 0
    finally:
        dist.destroy_process_group()


def test_host_batches_reach_the_gpu_without_waiting_for_its_queue():
    """``to_device`` queues the copy behind the GPU's work and returns; a plain copy from
    pageable memory would wait for the queue to drain (checked too, so the test can fail)."""
    batch = random_batch(2, 128, 96, AnchorSpec(8, 0))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued
    moved = batch.to(torch.device("cuda"))
    ids = to_device(batch.input_ids, torch.device("cuda"))
    assert not torch.cuda.current_stream().query(), "the host waited for the GPU"
    torch.cuda.synchronize()
    assert torch.equal(ids.cpu(), batch.input_ids) and torch.equal(moved.anchors.cpu(), batch.anchors)
    torch.cuda._sleep(2_000_000_000)
    batch.input_ids.to("cuda")
    assert torch.cuda.current_stream().query(), "a pageable copy should have waited"


HOST_MEMORY_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def page_locked(t: torch.Tensor) -> bool:
    """Whether the driver holds ``t``'s pages locked: registering them again says so
    (``Tensor.is_pinned`` knows only the caching host allocator's blocks). Asked from a
    thread of its own: a refused registration stays that thread's last CUDA error, which
    the next kernel launch on it would raise."""
    cudart, answer = torch.cuda.cudart(), []

    def probe() -> None:
        error = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if error == cudart.cudaError.success:
            cudart.cudaHostUnregister(t.data_ptr())
        answer.append(error)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    if answer[0] == cudart.cudaError.success:
        return False
    assert int(answer[0]) == HOST_MEMORY_ALREADY_REGISTERED, cudart.cudaGetErrorString(answer[0])
    return True


def test_checkpoint_buffers_of_gpu_tensors_are_page_locked_then_released():
    """The snapshot a step waits for is one queued copy into page-locked memory; the pages
    are unlocked again when the writer is done (those of host tensors are never locked)."""
    state = {"w": torch.randn(1000, 333, device="cuda"), "step": torch.tensor(3, device="cuda"), "host": torch.ones(7)}
    host = HostBuffers(state).pin()
    assert page_locked(host.state["w"]) and page_locked(host.state["step"]) and not page_locked(host.state["host"])
    torch.cuda._sleep(2_000_000_000)
    host.state["w"].copy_(state["w"], non_blocking=True)
    assert not torch.cuda.current_stream().query(), "the copy into locked pages should not wait for the GPU"
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    copied = snapshot(state, host.state)
    for name, tensor in state.items():
        assert torch.equal(copied[name], tensor.cpu())
    host.release()
    assert not page_locked(host.state["w"]) and host.pinned == []


def packed_micro_batches(count: int, seq_len: int = 256, seed: int = 0, hidden: int = 256):
    """Packed rows of several samples each, the boundaries moving from one micro-batch to
    the next as real packing moves them (same shapes, other values)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        batch = random_batch(2, seq_len, 96, AnchorSpec(24, 0), seed=i)
        for r in range(2):
            cuts = sorted(torch.randint(16, seq_len - 16, (3,), generator=g).tolist())
            batch.position_ids[r] = torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, seq_len])])
        out.append((batch, random_prefill(2, seq_len, 3 * hidden, torch.bfloat16, 4, 96, "cuda")))
    return out


def test_a_packed_sliding_step_replays_one_cuda_graph():
    """Packed rows with a sliding layer under reduce-overhead: the gradients and losses of
    eager steps over the dense mask, and after warmup no recompile and no CUDA-graph skip
    however the boundaries move."""
    check_packed_sliding_steps(hidden=256)


@pytest.fixture
def flash_kernels(monkeypatch):
    """Flex attention on FlashAttention-4's kernels for one test, as ``compile.attention=flash``
    sets them (skipped where they cannot run); Inductor's settings are put back after."""
    why = flex.flash_unsupported(torch.device("cuda"))
    if why:
        pytest.skip(f"FlashAttention-4's kernels cannot run here: {why}")
    monkeypatch.setattr(torch._inductor.config, "graph_partition", torch._inductor.config.graph_partition)
    monkeypatch.setattr(flex, "_kernel_options", flex.kernel_options())
    flex.use_flash_kernels()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_packed_sliding_step_on_flash_kernels_replays_one_cuda_graph(flash_kernels):
    """The same on FlashAttention-4's kernels (128-wide heads, which they support): the
    dense eager reference's gradients and losses, one CUDA graph, no recompile."""
    check_packed_sliding_steps(hidden=512)


def test_a_packed_prefill_on_flash_kernels_keeps_samples_apart(flash_kernels):
    from helpers import tiny_target

    from dflash.model.target import Target

    target = Target(tiny_target(num_layers=4, hidden=512).to("cuda", torch.bfloat16), [0, 2])
    assert target.attend_packed_with_flex()
    assert target.packing_error() < 0.05


def check_packed_sliding_steps(hidden: int) -> None:
    torch._dynamo.reset()
    base = tiny_drafter(hidden=hidden, layer_ids=(1, 2, 3), block_size=16, **SLIDING_LAYER).cuda()
    settings = CompileSettings(drafter=True, target=False, backend="inductor", mode="reduce-overhead", strict=True, warmup_turns=1)
    eager, graphed = _trainer(copy.deepcopy(base), None, True), _trainer(copy.deepcopy(base), settings, True)
    # the reference: eager over the dense mask (an eager step this small attends densely, DENSE_SCORES_LIMIT)
    data = packed_micro_batches(9, hidden=hidden)
    for trainer in (eager, graphed):
        trainer.warmup([data[0]])
    guard = CompileGuard(strict=True)
    guard.arm()
    for step in range(4):
        for trainer in (eager, graphed):
            for micro in range(2):
                trainer.micro_step(*data[1 + 2 * step + micro])
        assert_same_gradients(eager, graphed)
        results = [eager.finish(), graphed.finish()]
        assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=2e-2)
        assert results[0]["grad_norm"] == pytest.approx(results[1]["grad_norm"], rel=5e-2)
        assert guard.check(f"step {step}") == {"recompiles": 0, "cudagraph_skips": 0, "cudagraph_rerecords": 0}


def test_a_packed_prefill_under_flex_attention_keeps_samples_apart():
    """On CUDA a packed target attends with flex attention: each sample's features in the
    row equal its prefill alone, to bf16 rounding."""
    from helpers import tiny_target

    from dflash.model.target import Target

    model = tiny_target(num_layers=4, hidden=256).to("cuda", torch.bfloat16)
    target = Target(model, [0, 2])
    assert target.attend_packed_with_flex()
    assert target.packing_error() < 0.05


def decoding_models(seed: int, count: int):
    """A float32 target, a random drafter (mostly rejected) and its head on the GPU, and
    ``count`` prompts of 5, 8, 11, ... tokens."""
    from helpers import varied_target

    from dflash.model.drafter import TargetHead

    target = varied_target(vocab=96).cuda()
    drafter = tiny_drafter(vocab=96, block_size=4).cuda().eval()
    drafter.reset_parameters(0.2)
    g = torch.Generator().manual_seed(seed)
    return target, drafter, TargetHead.of(target), [torch.randint(0, 95, (1, 5 + 3 * i), generator=g).cuda()
                                                    for i in range(count)]


def test_decoding_forwards_replay_as_cuda_graphs_and_match_the_batch_one_loop():
    """The slot cache records its forwards as CUDA graphs (a Qwen3 target has no host
    wait in its forward), and batched decoding through them gives every row the eager
    batch-1 loop's tokens and acceptance lengths (float32)."""
    from transformers import DynamicCache

    from dflash.decode.batch import speculative_batch_steps
    from dflash.decode.slots import SlotCache
    from dflash.decode.speculative import run_to_end, speculative_generate, with_cache

    target, drafter, head, prompts = decoding_models(seed=0, count=5)
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        cache = SlotCache(target, slots=2, columns=64)
        cache.record(4)
        assert cache.recorded[4].graph is not None
        row = DynamicCache(config=target.config)
        with_cache(target, row, input_ids=prompts[0])
        cache.join(1, [(layer.keys, layer.values) for layer in row.layers])
        block = torch.randint(0, 95, (1, 4), generator=g).cuda()
        positions = prompts[0].shape[1] + torch.arange(4, device="cuda")[None]
        logits = cache.forward(torch.tensor([1], device="cuda"), block, positions)
        alone = target(input_ids=torch.cat([prompts[0], block], dim=1)).logits[:, -4:]
        torch.testing.assert_close(logits, alone, rtol=1e-4, atol=1e-4)
    expected = [speculative_generate(target, drafter, head, p, max_new_tokens=24) for p in prompts]
    got = run_to_end(speculative_batch_steps(target, drafter, head, prompts, max_new_tokens=24, batch_size=3))
    assert got == expected


def test_the_drafters_forward_replays_as_a_cuda_graph_at_batch_one_and_sixteen(monkeypatch):
    """Greedy drafting records the drafter's forward over the slot cache's columns as a CUDA
    graph (again after the cache grows); one prompt at a time and 16 at once give the eager
    batch-1 loop's tokens and acceptance lengths (float32)."""
    from dflash.decode.batch import speculative_batch_steps
    from dflash.decode.slots import SlotCache
    from dflash.decode.speculative import run_to_end, speculative_generate

    caches = []
    record_drafts = SlotCache.record_drafts
    monkeypatch.setattr(SlotCache, "record_drafts", lambda cache, fn: (caches.append(cache), record_drafts(cache, fn))[1])
    target, drafter, head, prompts = decoding_models(seed=1, count=4)
    expected = [speculative_generate(target, drafter, head, p, max_new_tokens=100) for p in prompts]
    for batch in (1, 16):
        caches.clear()
        got = run_to_end(speculative_batch_steps(target, drafter, head, prompts, max_new_tokens=100, batch_size=batch))
        assert got == expected
        assert caches and all(c.drafting.graph is not None for c in caches)
    assert len(caches) >= 2  # the cache grew and the drafter's forward was recorded again


def test_decodings_back_to_back_record_again_as_their_caches_grow():
    """Seen on an H100 with SmolLM2: the second of two greedy decodings at batch 1 ended in
    ``cudaErrorStreamCaptureInvalidated`` when its cache grew, the first decoding's graphs
    being collected inside the new capture. Captures hold Python's collector off now."""
    import gc

    from helpers import varied_target

    from dflash.decode.batch import greedy_batch_steps
    from dflash.decode.speculative import greedy_generate, run_to_end

    target = varied_target(vocab=96).cuda()
    prompt = torch.randint(0, 95, (1, 7), generator=torch.Generator().manual_seed(2)).cuda()
    expected = greedy_generate(target, prompt, 200)
    for _ in range(3):
        assert run_to_end(greedy_batch_steps(target, [prompt], 200, batch_size=1)) == [expected]
        assert gc.isenabled()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("additive", [False, True], ids=["boolean", "additive"])
def test_grouped_attention_on_cuda_equals_the_float64_math(additive, dtype):
    """The fused CUDA path of grouped attention (SDPA over the stacked query rows, as
    decoding runs it) against its float64 arithmetic on the CPU, at a verification's shape:
    ragged masks, four query heads per key/value head, a query that sees nothing."""
    from dflash.decode.speculative import decoding_attention
    from dflash.model.attention import grouped_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 16, 128, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 320, 128, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(3, 1, 16, 320, generator=g) < 0.3
    mask[1, 0, 5] = False
    if additive:
        mask[1, 0, 5, 0] = True
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    expected = grouped_attention(q, k, v, mask.double() if additive else mask)
    with decoding_attention():
        got = grouped_attention(*(t.to("cuda", dtype) for t in (q, k, v)), mask.cuda()).double().cpu()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    if not additive:
        assert torch.equal(got[1, :, 5], torch.zeros_like(got[1, :, 5]))


def test_top_k_of_rows_equals_topk_at_the_lm_heads_width():
    """The DFlash2 candidates' search over segments, on bf16 logits of a 152k vocabulary
    (where ties are common), eager and compiled: ``topk``'s values, at ids holding them."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(512, 151936, device="cuda", generator=g) * 4).to(torch.bfloat16)
    expected = x.topk(16, dim=-1).values
    for fn in (top_k_of_rows, torch.compile(top_k_of_rows, fullgraph=True)):
        values, ids = fn(x, 16)
        assert torch.equal(values, expected)
        assert torch.equal(x.gather(1, ids), expected)
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all()


needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or fp8_unsupported(torch.device("cuda")) is not None,
                               reason="FP8 matmuls need compute capability 8.9+ and torchao")


@needs_fp8
def test_an_fp8_step_replays_its_cuda_graphs_and_trains_as_the_bf16_step():
    """train.fp8 under reduce-overhead against the bf16 step, both from the same weights
    each step (the bf16 masters copied over after every update): the loss within 1%, the
    accumulated gradient within 10% (rowwise e4m3, the CPU test's tolerance), and no
    recompile, CUDA-graph skip or graph recorded again after warmup."""
    torch._dynamo.reset()
    base = tiny_drafter(hidden=256, layer_ids=(1, 2, 3), block_size=16).cuda()
    settings = CompileSettings(drafter=True, target=False, backend="inductor", mode="reduce-overhead", strict=True,
                               warmup_turns=1)
    bf16, fp8 = _trainer(copy.deepcopy(base), settings), _trainer(copy.deepcopy(base), settings, fp8=True)
    assert fp8.fp8_layers
    data = [(random_batch(2, 256, 96, AnchorSpec(8, 0), seed=i), random_prefill(2, 256, 768, torch.bfloat16, 4, 96,
                                                                                  "cuda")) for i in range(9)]
    for trainer in (bf16, fp8):
        trainer.warmup([data[0]])
    guard = CompileGuard(strict=True)
    guard.arm()
    for step in range(4):
        for trainer in (bf16, fp8):
            for micro in range(2):
                trainer.micro_step(*data[1 + 2 * step + micro])
        off = float((flat_grads(fp8) - flat_grads(bf16)).norm() / flat_grads(bf16).norm())
        assert 1e-3 < off < 0.1
        ours, theirs = fp8.finish(), bf16.finish()
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-2)
        fp8.drafter.load_state_dict(bf16.drafter.state_dict())
        fp8.refresh()
        assert guard.check(f"step {step}") == {"recompiles": 0, "cudagraph_skips": 0, "cudagraph_rerecords": 0}


@needs_fp8
def test_an_fp8_run_resumes_exactly_on_the_gpu(tmp_path):
    from dflash.run.checkpoint import save_checkpoint

    torch._dynamo.reset()
    settings = CompileSettings(drafter=True, target=False, backend="inductor", mode="reduce-overhead", strict=True,
                               warmup_turns=1)
    data = [(random_batch(2, 256, 96, AnchorSpec(8, 0), seed=i), random_prefill(2, 256, 768, torch.bfloat16, 4, 96,
                                                                                  "cuda")) for i in range(4)]
    continuing = _trainer(tiny_drafter(hidden=256, layer_ids=(1, 2, 3), block_size=16).cuda(), settings, fp8=True)
    continuing.warmup([data[0]])
    continuing.micro_step(*data[1])
    continuing.finish()
    path = save_checkpoint(tmp_path, 1, continuing.drafter, continuing.optimizer, continuing.scheduler, keep=1)
    resumed = _trainer(tiny_drafter(hidden=256, layer_ids=(1, 2, 3), block_size=16, seed=5).cuda(), settings,
                       fp8=True)
    resumed.warmup([data[0]])
    assert resumed.restore(path) == 1
    for trainer in (continuing, resumed):
        trainer.micro_step(*data[2])
    assert continuing.finish()["loss"] == resumed.finish()["loss"]


@needs_fp8
def test_an_fp8_prefill_captures_the_bf16_features_to_fp8_precision():
    """target.fp8: the decoder layers' weights per output channel, activations per token;
    the captured features and the logits within a few percent of the bf16 prefill's."""
    from helpers import tiny_target

    from dflash.model.fp8 import quantize_prefill
    from dflash.model.target import Target, decoder_layers

    model = tiny_target(num_layers=4, hidden=512).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 96, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    bf16 = Target(model, [0, 2]).prefill(ids, 4)
    assert quantize_prefill(decoder_layers(model)) == 4 * 7
    fp8 = Target(model, [0, 2]).prefill(ids, 4)
    off = float((fp8.features.float() - bf16.features.float()).norm() / bf16.features.float().norm())
    assert 1e-4 < off < 0.05
