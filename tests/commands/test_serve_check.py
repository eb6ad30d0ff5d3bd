"""tools/serve_check.py: skipped with a clear message when the engine is not installed, and
the engines' command lines and acceptance parsing as the engines document them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import serve_check  # noqa: E402


@pytest.mark.parametrize("engine", serve_check.ENGINES)
def test_a_missing_engine_is_skipped_with_a_message(engine, tmp_path):
    if serve_check.engine_installed(engine):
        pytest.skip(f"{engine} is installed here")
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "serve_check.py"), "--engine", engine,
                          str(tmp_path / "drafter"), str(tmp_path / "target")], capture_output=True, text=True)
    assert out.returncode == 0 and f"serve check skipped: {engine} is not installed" in out.stdout


def test_the_engines_serve_the_drafter_as_their_speculative_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"block_size": 16, "dflash_config": {"block_size": 16}}))
    vllm = serve_check.server_command("vllm", str(tmp_path), "/m/Qwen3-8B", 8000, [])
    assert vllm[:3] == ["vllm", "serve", "/m/Qwen3-8B"]
    assert json.loads(vllm[vllm.index("--speculative-config") + 1]) == {
        "method": "dflash", "model": str(tmp_path), "num_speculative_tokens": 15}
    sglang = serve_check.server_command("sglang", str(tmp_path), "/m/Qwen3-8B", 8000, ["--tp-size", "1"])
    assert sglang[sglang.index("--speculative-algorithm") + 1] == "DFLASH"
    assert sglang[sglang.index("--speculative-num-draft-tokens") + 1] == "16" and sglang[-2:] == ["--tp-size", "1"]


def test_vllm_counters_are_summed_over_labels(monkeypatch):
    metrics = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 45.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0',
    ])
    monkeypatch.setattr(serve_check, "request", lambda url, body=None, timeout=600: metrics.encode())
    assert serve_check.vllm_counters("http://x") == {"drafts": 10.0, "accepted_tokens": 45.0}
