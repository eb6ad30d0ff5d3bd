"""The eval refuses an exported drafter whose mask token id is not a row of the
target's embedding, with an error that names the id and the vocabulary, before
decoding anything (an out-of-range id would otherwise index past the embedding
or, negative, silently embed the last row)."""

import json

import pytest
import torch
from helpers import tiny_drafter, tiny_target, word_tokenizer

from dflash.decode.evaluate import evaluate_datasets
from dflash.decode.speculative import DecodeSettings
from dflash.files import write_digests
from dflash.model.drafter import TargetHead
from dflash.model.export import load_export, save_export

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 96
BUDGET = DecodeSettings(max_new_tokens=4, max_prompts=1)


def export_with_mask_id(tmp_path, mask_id: int):
    out = save_export(tiny_drafter(vocab=VOCAB, block_size=4), tmp_path / "export", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = mask_id
    (out / "config.json").write_text(json.dumps(config))
    write_digests(out)  # an export written so, not one changed after it was written
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"conversations": [{"role": "user", "content": "w1 w2"}]}) + "\n")
    return out, prompts


class NoTokenizer:
    """Any use of the tokenizer means decoding started before the mask id was checked."""

    def __getattr__(self, name):
        raise AssertionError(f"the eval used the tokenizer ({name}) before refusing the mask id")

    def __call__(self, *args, **kwargs):
        raise AssertionError("the eval tokenised a prompt before refusing the mask id")


@pytest.mark.parametrize("mask_id", [VOCAB, VOCAB + 1000, -1])
def test_eval_refuses_a_mask_id_outside_the_target_vocab(tmp_path, mask_id):
    model = tiny_target(vocab=VOCAB)
    head = TargetHead.of(model)
    export, prompts = export_with_mask_id(tmp_path, mask_id)
    out = tmp_path / "eval.json"
    with pytest.raises(ValueError) as err:
        drafter = load_export(export, head.embed_weight.device, head.embed_weight.dtype)
        evaluate_datasets(model, NoTokenizer(), drafter, head, drafter_dir=export, datasets={"p": str(prompts)},
                          out_path=out, settings=BUDGET)
    message = str(err.value)
    assert "mask" in message.lower() and str(mask_id) in message, message
    assert "vocab" in message.lower() and str(VOCAB) in message, message
    assert not out.exists()


def test_the_last_row_of_the_vocab_is_accepted(tmp_path):
    """Guard: the boundary id VOCAB - 1 is a real row and decodes (so the refusal above is about the range)."""
    model = tiny_target(vocab=VOCAB)
    head = TargetHead.of(model)
    export, prompts = export_with_mask_id(tmp_path, VOCAB - 1)
    drafter = load_export(export, head.embed_weight.device, head.embed_weight.dtype)
    report = evaluate_datasets(model, word_tokenizer(VOCAB), drafter, head, drafter_dir=export,
                               datasets={"p": str(prompts)}, out_path=tmp_path / "eval.json", settings=BUDGET)
    assert report["results"]["p"]["prompts"] == 1
    assert torch.isfinite(torch.tensor(report["tau"]))
