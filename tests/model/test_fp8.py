"""train.fp8 and target.fp8: refused where FP8 cannot run, planned, and on the drafter's side
the same training as bf16 to FP8's precision, with the masters, checkpoints and export of a
bf16 run. The CPU runs torchao's float8 training on torch's own ``_scaled_mm``; the speed and
the compiled step are the GPU tests'."""

import copy

import pytest
import torch
from helpers import tiny_drafter, tiny_head

from dflash.compile import CompileGuard, CompileSettings
from dflash.data.bundle import random_batch, random_prefill
from dflash.model.export import load_export, save_export
from dflash.model.fp8 import check_fp8, fp8_shaped, train_in_fp8
from dflash.objective.anchors import AnchorSpec
from dflash.objective.config import ObjectiveConfig
from dflash.run.build import build_job
from dflash.run.checkpoint import save_checkpoint
from dflash.run.config import compose_config
from dflash.run.step import DrafterTrainer, build_optimizer, cosine_schedule

pytest.importorskip("torchao")

BS = 4


def trainer(drafter, fp8: bool, settings: CompileSettings | None = None) -> DrafterTrainer:
    """bf16 compute weights over fp32 masters, as on a GPU (autocast on the CPU)."""
    opt = build_optimizer(drafter, 1e-2, 0.0, (0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_schedule(10, 0.0, 0.0))
    obj = ObjectiveConfig(block_size=BS, mask_token_id=95, gamma=7.0)
    return DrafterTrainer(drafter, tiny_head(), obj, opt, sched, grad_clip=1e9, autocast_dtype=torch.bfloat16,
                          compile_settings=settings, fp8=fp8)


def micro_batches(step: int) -> list:
    return [(random_batch(2, 32, 96, AnchorSpec(6, 0), seed=10 * step + i),
             random_prefill(2, 32, 3 * 64, torch.float32, 0, 96, torch.device("cpu"))) for i in range(2)]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("key", ["train.fp8", "target.fp8"])
def test_fp8_is_refused_where_it_cannot_run_and_planned_anywhere(key, capsys):
    with pytest.raises(ValueError, match=rf"{key}=true: FP8 matmuls run on CUDA GPUs of compute capability 8\.9"):
        check_fp8(key, torch.device("cpu"))
    with pytest.raises(ValueError, match=rf"Set {key}=false"):
        build_job(compose_config([f"{key}=true"]), 1)
    job = build_job(compose_config(["target=qwen3_8b", "train=paper", "dry_run=true", "estimate.device=cuda",
                                    f"{key}=true"]), 1)
    plain = build_job(compose_config(["target=qwen3_8b", "train=paper", "dry_run=true", "estimate.device=cuda"]), 1)
    cost, base = job.layout.taken.cost, plain.layout.taken.cost
    assert f"FP8's rates are not measured yet: {key} counted at bf16's" in cost.rates_from
    if key == "train.fp8":  # two one-byte casts of every drafter weight
        assert cost.drafter_gib["FP8 casts of the weights"] == pytest.approx(2 * cost.drafter_params / 2**30, rel=0.01)
    else:  # the decoder layers' linear weights in one byte instead of two
        assert 0.5 < cost.target_gib["weights"] / base.target_gib["weights"] < 0.6


def test_a_sharded_target_is_not_quantized():
    with pytest.raises(ValueError, match="target.fp8=true quantizes a whole target's layers"):
        build_job(compose_config(["target=qwen3_8b", "dry_run=true", "target.fp8=true", "target.tensor_parallel=2",
                                  "estimate.nproc=4"]), 4)


def test_fp8_off_leaves_every_linear_layer_on_the_fused_gradient_sums():
    plain = trainer(tiny_drafter(block_size=BS), fp8=False)
    assert plain.fp8_layers == [] and not plain.autograd_params[0].ndim > 1  # only norm weights go through .grad
    linear = [m for m in plain.compute.modules() if isinstance(m, torch.nn.Linear)]
    assert {id(m) for m, _ in plain.sinks} == {id(m) for m in linear}


def test_only_the_compute_copys_linear_layers_become_fp8_sharing_their_weights():
    fp8 = trainer(tiny_drafter(block_size=BS), fp8=True)
    swapped = {name for name, m in fp8.compute.named_modules() if type(m).__name__ == "Float8Linear"}
    linear = {name for name, m in fp8.drafter.named_modules() if isinstance(m, torch.nn.Linear) and fp8_shaped(m)}
    assert swapped == linear == set(fp8.fp8_layers) and "fc" in swapped
    assert not any(type(m).__name__ == "Float8Linear" for m in fp8.drafter.modules())  # the masters stay as they were
    names = [n for n, _ in fp8.compute.named_parameters()]
    assert names == [n for n, _ in fp8.drafter.named_parameters()]
    assert fp8.drafter.state_dict().keys() == trainer(tiny_drafter(block_size=BS), fp8=False).drafter.state_dict().keys()


def test_an_fp8_step_trains_as_the_bf16_step_to_fp8_precision():
    """From the same weights every step (the bf16 trainer's, copied over after each update):
    rowwise e4m3 keeps about two significant digits per element, so the loss agrees to 0.1%
    and the accumulated gradient to 10%, every parameter's to 20%."""
    base = tiny_drafter(block_size=BS)
    bf16, fp8 = trainer(copy.deepcopy(base), fp8=False), trainer(copy.deepcopy(base), fp8=True)
    for step in range(3):
        for micro in micro_batches(step):
            bf16.micro_step(*micro)
            fp8.micro_step(*micro)
        off = relative(torch.cat([g.flatten() for g in fp8.grads]), torch.cat([g.flatten() for g in bf16.grads]))
        assert 1e-3 < off < 0.1  # and not 0: the matmuls did run in FP8
        assert max(relative(a, b) for a, b in zip(fp8.grads, bf16.grads)) < 0.2
        ours, theirs = fp8.finish(), bf16.finish()
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-3)
        fp8.drafter.load_state_dict(bf16.drafter.state_dict())
        fp8.refresh()


def test_an_fp8_run_resumes_exactly_and_exports_as_a_bf16_one(tmp_path):
    continuing = trainer(tiny_drafter(block_size=BS), fp8=True)
    for micro in micro_batches(0):
        continuing.micro_step(*micro)
    continuing.finish()
    path = save_checkpoint(tmp_path / "checkpoints", 1, continuing.drafter, continuing.optimizer, continuing.scheduler,
                           keep=1)
    resumed = trainer(tiny_drafter(block_size=BS, seed=5), fp8=True)
    assert resumed.restore(path) == 1
    later = micro_batches(1)
    for t in (continuing, resumed):
        for micro in later:
            t.micro_step(*micro)
    assert continuing.finish()["loss"] == resumed.finish()["loss"]
    for a, b in zip(continuing.drafter.parameters(), resumed.drafter.parameters()):
        assert torch.equal(a, b)
    export = save_export(continuing.drafter, tmp_path / "export", "bfloat16")
    reference = save_export(trainer(tiny_drafter(block_size=BS), fp8=False).drafter, tmp_path / "bf16", "bfloat16")
    assert (export / "config.json").read_text() == (reference / "config.json").read_text()
    loaded = load_export(export, torch.device("cpu"), torch.float32)
    assert not any(type(m).__name__ == "Float8Linear" for m in loaded.modules())
    for (name, a), (_, b) in zip(loaded.state_dict().items(), continuing.drafter.state_dict().items()):
        assert torch.equal(a, b.to(torch.bfloat16).float()), name


def test_a_layer_the_fp8_gemm_cannot_take_stays_in_bf16(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(128, 40, bias=False))
    assert train_in_fp8(model) == ["0"]
    assert type(model[1]) is torch.nn.Linear and "stay in bf16" in caplog.text


def test_the_fp8_step_compiles_as_one_graph_equal_to_eager():
    """torchao's layers inside the compiled step (fullgraph, strict): no graph break, no
    recompile after warmup, and the compiled step is the eager one (aot_eager on the CPU;
    Inductor and CUDA graphs are the GPU test's)."""
    settings = CompileSettings(drafter=True, target=False, backend="aot_eager", mode=None, strict=True, warmup_turns=1)
    base = tiny_drafter(block_size=BS)
    eager, compiled = trainer(copy.deepcopy(base), fp8=True), trainer(copy.deepcopy(base), fp8=True, settings=settings)
    data = micro_batches(0)
    compiled.warmup([data[0]])
    guard = CompileGuard(strict=True)
    guard.arm()
    for t in (eager, compiled):
        for micro in data:
            t.micro_step(*micro)
    assert torch.equal(torch.cat([g.flatten() for g in compiled.grads]), torch.cat([g.flatten() for g in eager.grads]))
    assert guard.check("fp8") == {"recompiles": 0, "cudagraph_skips": 0, "cudagraph_rerecords": 0}
    assert eager.finish()["loss"] == compiled.finish()["loss"]
