"""Regression pins of FP8's refusals (dflash.model.fp8): each reason ``train.fp8`` or
``target.fp8`` is refused for, on a device described here (capability, name, torchao
installed or not), with the sentence written out by hand, and the shapes the FP8 GEMM takes."""

from __future__ import annotations

import logging

import pytest
import torch

from dflash.model import fp8
from dflash.model.fp8 import check_fp8, fp8_shaped, fp8_unsupported

CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of the capability the test sets, torchao installed."""
    seen = {"capability": (9, 0), "name": "NVIDIA H200", "torchao": True}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: seen["capability"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: seen["name"])
    real = fp8.importlib.util.find_spec
    monkeypatch.setattr(fp8.importlib.util, "find_spec",
                        lambda name: (object() if seen["torchao"] else None) if name == "torchao" else real(name))
    return seen


def test_the_cpu_is_refused_naming_the_gpus_that_run_fp8():
    assert fp8_unsupported(torch.device("cpu")) == (
        "FP8 matmuls run on CUDA GPUs of compute capability 8.9 or newer (Ada, Hopper, Blackwell), and this run is on "
        "the CPU")


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0), (12, 1)])
def test_ada_hopper_and_blackwell_run_fp8(gpu, capability):
    gpu["capability"] = capability
    assert fp8_unsupported(CUDA) is None
    check_fp8("train.fp8", CUDA)


@pytest.mark.parametrize(("capability", "name"), [((8, 6), "NVIDIA RTX A6000"), ((8, 0), "NVIDIA A100-SXM4-80GB"),
                                                  ((7, 9), "imaginary")])
def test_an_older_gpu_is_refused_naming_it_and_its_capability(gpu, capability, name):
    gpu["capability"], gpu["name"] = capability, name
    said = f"{name} is compute capability {capability[0]}.{capability[1]}; FP8 matmuls need 8.9 or newer"
    assert fp8_unsupported(CUDA) == said
    with pytest.raises(ValueError) as refused:
        check_fp8("target.fp8", CUDA)
    assert str(refused.value) == f"target.fp8=true: {said}. Set target.fp8=false"


def test_without_torchao_fp8_is_refused_saying_how_to_install_it(gpu):
    gpu["torchao"] = False
    assert fp8_unsupported(CUDA) == "torchao is not installed (pip install 'dflash[fp8]')"
    with pytest.raises(ValueError, match=r"^train.fp8=true: torchao is not installed \(pip install 'dflash\[fp8\]'\)\. "
                                         r"Set train.fp8=false$"):
        check_fp8("train.fp8", CUDA)


@pytest.mark.parametrize(("shape", "taken"), [
    ((64, 128), True), ((16, 16), True), ((48, 32), True),
    ((40, 64), False), ((64, 40), False), ((8, 16), False), ((16, 24), False),
])
def test_the_fp8_gemm_takes_both_sides_a_multiple_of_16(shape, taken):
    assert fp8_shaped(torch.nn.Linear(*shape, bias=False)) is taken


def test_the_layers_kept_in_bf16_are_named(caplog):
    pytest.importorskip("torchao")
    model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(40, 64, bias=False),
                                torch.nn.Linear(64, 40, bias=False), torch.nn.Linear(40, 32, bias=False))
    with caplog.at_level(logging.WARNING):
        assert fp8.train_in_fp8(model) == ["0"]
    assert [type(m).__name__ for m in model] == ["Float8Linear", "Linear", "Linear", "Linear"]
    assert "train.fp8: 3 linear layer(s) stay in bf16, their sides not multiples of 16: 1, 2, 3" in caplog.text
