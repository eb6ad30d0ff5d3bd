"""The exported target_layer_ids are the ids training captured, and the context
features eval computes for the exported ids (HF ``output_hidden_states``) are the
features training's prefill (forward hooks) produced.

Deliberately unsorted, non-default ids: a side that sorted, defaulted or shifted
them would disagree with the other.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_drafter, varied_target
from torch import nn

import dflash
from dflash.decode.speculative import speculative_generate
from dflash.model.drafter import TargetHead
from dflash.model.export import load_export, save_export
from dflash.model.target import Target

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 96
IDS = [4, 0, 2]  # of the 6-layer tiny target


def capture_contexts(drafter: nn.Module) -> list[torch.Tensor]:
    """Every context the drafter is given during decoding (projected: DFlashDrafter.context)."""
    seen = []
    drafter.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    return seen


def test_eval_features_for_exported_ids_equal_the_training_prefill(tmp_path):
    model = varied_target(vocab=VOCAB)
    out = save_export(tiny_drafter(vocab=VOCAB, layer_ids=IDS), tmp_path / "export", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == IDS

    drafter = load_export(out)
    assert list(drafter.config.target_layer_ids) == IDS
    contexts = capture_contexts(drafter)
    prompt = torch.randint(0, VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(0))
    head = TargetHead.of(model)
    tokens, lengths = speculative_generate(model, drafter, head, prompt, max_new_tokens=14)
    assert len(contexts) == len(lengths) >= 2

    # training's prefill of the whole decoded sequence, with the ids from the export
    sequence = torch.cat([prompt, torch.tensor([tokens])], dim=1)
    trained = Target(model, config["dflash_config"]["target_layer_ids"]).prefill(sequence).features
    assert trained.shape[-1] == len(IDS) * 64
    with torch.no_grad():
        for ctx in contexts:
            p = ctx.shape[1]
            torch.testing.assert_close(ctx, drafter.context(trained[:, :p], trained.dtype), atol=1e-4, rtol=1e-4,
                                       msg=f"context of length {p}")


@pytest.fixture
def prefills(monkeypatch):
    """Every Target.prefill of a training run: the ids it captured, its input, its features."""
    seen = []
    original = Target.prefill

    def spy(self, input_ids, *args, **kwargs):
        out = original(self, input_ids, *args, **kwargs)
        seen.append((list(self.layer_ids), input_ids.detach().clone(), out.features.detach().clone()))
        return out

    monkeypatch.setattr(Target, "prefill", spy)
    return seen


def test_a_training_run_exports_the_ids_it_captured(tmp_path, prefills):
    """A one-step colocated run on the demo target (8 layers) with explicit ids: the
    export names the captured ids, and eval's features for a training sample equal
    the features the drafter was trained on."""
    from runs import run_colocated

    ids = [5, 0, 3]
    run_colocated(tmp_path, ["train.max_steps=1", "train.batch_size=1", "data.max_samples=4",
                             f"drafter.target_layer_ids=[{','.join(map(str, ids))}]"])
    assert prefills, "the run made no prefill"
    assert all(captured == ids for captured, _, _ in prefills)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == ids

    from transformers import AutoModelForCausalLM

    demo = Path(dflash.__file__).parent / "assets" / "demo_target"
    model = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32, attn_implementation="sdpa").eval()
    drafter = load_export(tmp_path / "export")
    contexts = capture_contexts(drafter)
    _, input_ids, features = prefills[-1]
    length = 24
    head = TargetHead.of(model)
    speculative_generate(model, drafter, head, input_ids[:1, :length], max_new_tokens=2)
    with torch.no_grad():
        trained = drafter.context(features[:1, :length].float(), torch.float32)
    torch.testing.assert_close(contexts[0], trained, atol=1e-4, rtol=1e-4)
