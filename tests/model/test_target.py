"""Target capture: layer ids follow the serving engines' convention."""

import pytest
import torch
from helpers import tiny_target

import dflash.model.target as target_module
from dflash.model.drafter import default_target_layer_ids
from dflash.model.target import Target, TargetSource, resolve_mask_token_id
from dflash.topk import top_k_of_rows


def test_default_layer_ids_match_z_lab():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.5-27B
    assert default_target_layer_ids(8, 5) == [1, 2, 3, 4, 5]


def test_hooks_capture_hidden_states_at_id_plus_one():
    """Layer id i is HF hidden_states[i + 1] (the output of decoder layer i), not hidden_states[i]."""
    model = tiny_target()
    ids = torch.randint(0, 90, (2, 11))
    attn = torch.ones_like(ids)
    target = Target(model, [1, 3, 4])
    feats = target.prefill(ids).features
    hs = model(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states
    expected = torch.cat([hs[i + 1] for i in (1, 3, 4)], dim=-1)
    torch.testing.assert_close(feats, expected)
    off_by_one = torch.cat([hs[i] for i in (1, 3, 4)], dim=-1)
    assert not torch.allclose(feats, off_by_one)


@pytest.mark.parametrize("segment", [None, 4], ids=["vocabulary-under-k-segments", "segments-of-4"])
def test_prefill_topk_logits(segment, monkeypatch):
    """The teacher's top-k: the logits' own values in float32, at ids that hold them; with
    segments of 4 the tiny vocabulary takes the segmented search a real one takes."""
    if segment:
        monkeypatch.setattr(target_module, "top_k_of_rows", lambda x, k: top_k_of_rows(x, k, segment))
    model = tiny_target()
    ids = torch.randint(0, 90, (2, 7))
    out = Target(model, [1]).prefill(ids, topk=5)
    logits = model(input_ids=ids).logits.float()
    assert out.topk_values.dtype == torch.float32 and out.topk_indices.shape == (2, 7, 5)
    torch.testing.assert_close(out.topk_values, logits.topk(5, dim=-1).values)
    torch.testing.assert_close(logits.gather(-1, out.topk_indices), out.topk_values)


def test_right_padding_needs_no_mask():
    """Each row prefilled alone equals the padded batch on its real tokens."""
    model = tiny_target()
    target = Target(model, [1, 3])
    ids = torch.randint(0, 90, (3, 16))
    lengths = [16, 9, 4]
    batch = target.prefill(ids).features
    for r, n in enumerate(lengths):
        alone = target.prefill(ids[r : r + 1, :n]).features[0]
        torch.testing.assert_close(batch[r, :n], alone, rtol=1e-5, atol=1e-5)


def test_compiled_layers_equal_eager_with_one_graph_per_length():
    from dflash.compile import CompileSettings, compile_counts

    torch._dynamo.reset()
    target = Target(tiny_target(), [1, 2, 3])
    ids = torch.randint(0, 90, (2, 32))
    eager = target.prefill(ids, topk=4)
    target.compile(CompileSettings(drafter=True, target=True, backend="aot_eager", mode=None, strict=True, warmup_turns=1))
    before = compile_counts()["graphs"]
    compiled = target.prefill(ids, topk=4)
    target.prefill(ids[:, :16])
    assert compile_counts()["graphs"] - before == 2  # six layers, two lengths
    torch.testing.assert_close(compiled.features, eager.features)
    torch.testing.assert_close(compiled.topk_values, eager.topk_values)
    target.uncompile()
    target.prefill(ids[:, :8])
    assert compile_counts()["graphs"] - before == 2  # decoding lengths run eager


def test_layer_ids_out_of_range_are_rejected():
    with pytest.raises(ValueError, match="outside"):
        Target(tiny_target(num_layers=4), [1, 4])
    with pytest.raises(ValueError, match="outside"):
        Target(tiny_target(num_layers=4), [1, 3])  # the last layer has no capture point


class _Tok:
    unk_token_id = 0

    def __init__(self, vocab):
        self.vocab = vocab

    def convert_tokens_to_ids(self, tok):
        return self.vocab.get(tok, 0)


def test_mask_token_must_be_inside_the_embedding():
    assert resolve_mask_token_id(_Tok({"<|MASK|>": 7}), 10, None) == 7
    assert resolve_mask_token_id(_Tok({}), 152000, 151669) == 151669
    with pytest.raises(ValueError, match="outside the target embedding"):
        resolve_mask_token_id(_Tok({}), 151669, 151669)
    with pytest.raises(ValueError, match="no mask token"):
        resolve_mask_token_id(_Tok({}), 10, None)


def test_load_head_reads_only_embedding_and_lm_head(tmp_path):
    from dflash.model.target import TargetSource

    model = tiny_target()
    model.save_pretrained(tmp_path, safe_serialization=True)
    head = TargetSource(str(tmp_path)).head(torch.device("cpu"), torch.float32)
    assert torch.equal(head.embed_weight, model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head_weight, model.get_output_embeddings().weight)


def test_prefill_stops_after_the_last_captured_layer():
    """Without top-k logits the layers after the last captured one never run, and the
    features still equal the full model's hidden states."""
    model = tiny_target(num_layers=6)
    ids = torch.randint(0, 90, (2, 12))
    ran = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda _m, _i, _o, i=i: ran.append(i))
    target = Target(model, [3, 1])
    feats = target.prefill(ids).features
    assert ran == [0, 1, 2, 3]
    hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats, torch.cat([hs[4], hs[2]], dim=-1))
    ran.clear()
    target.prefill(ids, topk=3)  # the logits need every layer
    assert ran == list(range(6))


SMALL_SHAPE = {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}


def test_random_target_takes_a_separate_tokenizer(tmp_path):
    """target.tokenizer gives a random target real prompts; a tokenizer with more tokens
    than the random embedding, or a directory without one, is refused up front."""
    model, tokenizer = TargetSource("random", shape={**SMALL_SHAPE, "vocab_size": 512}, tokenizer_path="demo").load(
        torch.device("cpu"), torch.float32)
    assert tokenizer is not None and tokenizer.encode("hello") == TargetSource("demo").tokenizer().encode("hello")
    assert TargetSource("random", shape={**SMALL_SHAPE, "vocab_size": 512}).load(torch.device("cpu"),
                                                                                 torch.float32)[1] is None
    with pytest.raises(ValueError, match="more than the target's vocab_size 300"):
        TargetSource("random", shape={**SMALL_SHAPE, "vocab_size": 300}, tokenizer_path="demo").load(
            torch.device("cpu"), torch.float32)
    with pytest.raises(FileNotFoundError, match="not a local tokenizer directory"):
        TargetSource("random", shape={**SMALL_SHAPE, "vocab_size": 512}, tokenizer_path=str(tmp_path)).tokenizer()


def test_prepared_masks_give_the_features_of_the_masks_the_decoder_builds():
    """A Qwen3 decoder under SDPA gets its masks prepared (no host sync per prefill) and
    yields the same features and logits; a decoder that builds its own (Llama) or
    eager attention, where a None mask would mean no mask at all, is left to build them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.model.target import prepared_causal_masks

    model = tiny_target()
    target = Target(model, [1, 3])
    assert target._masks == {"full_attention": None}
    ids = torch.randint(0, 90, (2, 13))
    prepared = target.prefill(ids), target.prefill(ids, topk=4)
    target._masks = None
    built = target.prefill(ids), target.prefill(ids, topk=4)
    for a, b in zip(prepared, built):
        assert torch.equal(a.features, b.features)
    assert torch.equal(prepared[1].topk_values, built[1].topk_values)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    assert prepared_causal_masks(llama) is None
    model.config._attn_implementation = "eager"
    assert prepared_causal_masks(model) is None


def test_a_tokenizer_without_a_mask_token_is_offered_its_unused_special_tokens(monkeypatch):
    """The demo tokenizer without its mask token (as SmolLM2's has none): the refusal names
    the special tokens no chat uses (not its end-of-turn, unknown or template tokens), and
    ``auto`` takes the first of them."""
    from transformers import AutoTokenizer

    import dflash.model.target as target_module
    from dflash.files import local_path
    from dflash.model.target import unused_special_tokens

    tokenizer = AutoTokenizer.from_pretrained(local_path("target", "demo"))
    unused = unused_special_tokens(tokenizer)
    assert [i for i, _ in unused] == [401, 402, 403, 404, 405, 406, 407]  # <|reserved_N|>; <|MASK|> has a role
    assert tokenizer.eos_token_id not in dict(unused) and tokenizer.unk_token_id not in dict(unused)
    assert all(t not in tokenizer.chat_template for _, t in unused)
    monkeypatch.setattr(target_module, "MASK_TOKEN_CANDIDATES", ())
    with pytest.raises(ValueError, match=r"no mask token \(unused special tokens it has: 401 <\|reserved_0\|>, "
                                         r"402 <\|reserved_1\|>.*target.mask_token_id=auto takes the first\)"):
        resolve_mask_token_id(tokenizer, len(tokenizer), None)
    assert resolve_mask_token_id(tokenizer, len(tokenizer), "auto") == 401
    with pytest.raises(ValueError, match="no unused special token either"):
        resolve_mask_token_id(tokenizer, 300, "auto")  # only rows inside the embedding count
    with pytest.raises(ValueError, match="no unused special token either"):
        resolve_mask_token_id(_Tok({}), 10, "auto")
