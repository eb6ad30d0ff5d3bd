"""The decoder families a target may be, each as a tiny random model with its real
structure (MoE routing, linear-attention layers, multi-head latent attention, sliding
windows, tied embeddings, llama3 RoPE scaling): the prefill captures the layers
``output_hidden_states`` names, a drafter trains on it, its export loads strictly into
the z-lab layout, and ``dflash.eval`` decodes losslessly in float32."""

from pathlib import Path

import pytest
import torch
from helpers import FAMILIES, family_shape, family_target, reference_drafter
from runs import compose_cfg, read_metrics, run_colocated, run_disaggregated
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

import dflash
from dflash.decode.speculative import context_features
from dflash.eval import main as evaluate
from dflash.model.target import Target, TargetSource, attention_implementation
from dflash.run.config import target_source

pytestmark = pytest.mark.usefixtures("one_thread")

LAYER_IDS = [0, 1, 2]  # both kinds of layer of every hybrid pattern (helpers.FAMILIES)
HELDOUT = Path(dflash.__file__).parent / "assets" / "demo_data" / "heldout.jsonl"
TRAIN = [
    "data.cache_dir=null", "data.max_samples=8", "train.max_steps=2", "train.batch_size=2", "train.max_len=128",
    "train.buckets=[128]", "drafter.block_size=4", f"drafter.target_layer_ids=[{','.join(map(str, LAYER_IDS))}]",
]


def saved_target(name: str, where: Path) -> Path:
    """The family's tiny target with the demo tokenizer, as a local HF directory."""
    model = family_target(name)
    model.save_pretrained(where)
    TargetSource("demo").tokenizer().save_pretrained(where)
    return where


def check_capture(name: str) -> None:
    """Training's hooks capture what decoding reads: ``hidden_states[id + 1]``."""
    model = family_target(name)
    ids = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = context_features(model(input_ids=ids, output_hidden_states=True).hidden_states, LAYER_IDS)
    torch.testing.assert_close(Target(model, LAYER_IDS).prefill(ids).features, expected, atol=1e-5, rtol=1e-5)


def check_export(export: Path) -> None:
    """The export loads strictly into the z-lab layout (every name, every shape)."""
    reference_drafter(export).load_state_dict(load_file(export / "model.safetensors"), strict=True)


def check_lossless(target: Path, export: Path) -> dict:
    report = evaluate(["--target", str(target), "--drafter", str(export), "--data", f"heldout={HELDOUT}",
                       "--max-prompts", "2", "--max-new-tokens", "16", "--dtype", "float32"])
    assert report["lossless"] is True and report["results"]["heldout"]["new_tokens"] > 0
    return report


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_trains_exports_and_decodes_losslessly(name, tmp_path):
    check_capture(name)
    target = saved_target(name, tmp_path / "target")
    run_colocated(tmp_path / "run", [f"target.path={target}"] + TRAIN)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    check_export(tmp_path / "run" / "export")
    check_lossless(target, tmp_path / "run" / "export")


@pytest.mark.parametrize("name", ["qwen3_5", "gpt_oss"])
def test_a_family_trains_over_two_gloo_ranks(name, tmp_path):
    """One target rank streams a hybrid (linear-attention) or eager-attention target's
    features to one drafter rank."""
    target = saved_target(name, tmp_path / "target")
    run_disaggregated(tmp_path / "run", 2, 1, [f"target.path={target}"] + TRAIN)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    check_export(tmp_path / "run" / "export")


def test_each_family_gets_an_attention_it_supports():
    chosen = {name: attention_implementation(AutoConfig.for_model(**family_shape(name))) for name in FAMILIES}
    assert chosen == {name: "eager" if name == "gpt_oss" else "sdpa" for name in FAMILIES}
    random = TargetSource("random", shape=family_shape("gpt_oss")).model(torch.device("cpu"), torch.float32)
    assert random.config._attn_implementation == "eager"


def test_latent_attention_with_fewer_key_heads_is_refused_at_start():
    """DeepSeek-V3's keys have a head per query head: fewer key/value heads would pass a
    prefill and fail at the first decoding step, so the target is refused before loading."""
    shape = dict(family_shape("deepseek_v3"), num_key_value_heads=2)
    with pytest.raises(ValueError, match="deepseek_v3 .* num_key_value_heads=2 must equal num_attention_heads=4"):
        TargetSource("random", shape=shape).model(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("preset,billions", [("qwen3_6_27b", 26.9), ("qwen3_30b_a3b", 30.5), ("gpt_oss_20b", 20.9),
                                             ("llama3_1_8b", 8.03)])
def test_a_preset_shape_builds_the_model_it_names(preset, billions):
    """Each preset's ``target.shape`` (what a dry run plans from) gives the published
    parameter count, within 2% (the 27B count is the text model's, without vision)."""
    config = target_source(compose_cfg([f"target={preset}", "target.path=random"])).config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_implementation(config))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=0.02)
