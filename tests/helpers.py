"""Tiny models, heads and tokenizers the tests build in memory (no files, no network)."""

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.model.drafter import ContextKV, DFlash2Config, DFlashDrafter, DrafterConfig, TargetHead


def tiny_target(num_layers: int = 6, hidden: int = 64, vocab: int = 96, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(cfg).eval()


def varied_target(vocab: int = 96, std: float = 0.2, seed: int = 1) -> Qwen3ForCausalLM:
    """A tiny random target whose greedy output varies: at init std 0.02 it repeats one
    token, which any constant drafter would "predict" perfectly, so its matrices are
    drawn again with the larger ``std``."""
    model = tiny_target(vocab=vocab)
    torch.manual_seed(seed)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=std)
    return model


def greedy_reference(model: nn.Module, prompt: list[int], total: int) -> list[int]:
    """``prompt`` and its greedy continuation up to ``total`` tokens in all, by plain argmax
    decoding over the whole sequence each time (no cache): the reference, independent of
    dflash's decoding."""
    seq = list(prompt)
    with torch.no_grad():
        while len(seq) < total:
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq


def acceptance_by_hand(greedy: list[int], proposals: list[int], block: int, max_new: int,
                       eos_ids=()) -> tuple[list[int], str | None]:
    """Acceptance lengths of greedy speculative decoding, by hand, and how the response
    stopped (``"draft"``, ``"bonus"`` or ``None`` for the budget). ``greedy[k]`` is the
    target's k-th new token (0 from the prefill), ``proposals[k]`` the draft proposed for
    it. A cycle keeps the drafts that match and adds one bonus; the cycles end at the
    budget or with the cycle that added the first stop token, draft or bonus, and that
    last cycle counts its tokens up to and with the stop (z-lab's harness)."""
    if greedy[0] in eos_ids:
        return [], "bonus"
    k, lengths = 1, []
    while k < max_new:
        n = 0
        while n < block - 1 and proposals[k + n] == greedy[k + n]:
            n += 1
        stops = [i for i in range(n + 1) if greedy[k + i] in eos_ids]
        lengths.append(stops[0] + 1 if stops else n + 1)
        if stops:
            return lengths, "draft" if stops[0] < n else "bonus"
        k += n + 1
    return lengths, None


def tiny_drafter(hidden: int = 64, vocab: int = 96, layer_ids=(1, 2, 3), block_size: int = 4, seed: int = 0,
                 layer_types=None, sliding_window=None, sliding_causal: bool = True) -> DFlashDrafter:
    """Two layers; ``layer_types``, ``sliding_window`` and ``sliding_causal`` as in
    ``DrafterConfig`` (the weights do not depend on them: one seed gives the same weights
    either way)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        vocab_size=vocab,
        num_target_layers=6,
        target_layer_ids=list(layer_ids),
        mask_token_id=vocab - 1,
        block_size=block_size,
        layer_types=layer_types,
        sliding_window=sliding_window,
        sliding_causal=sliding_causal,
    )
    return DFlashDrafter(cfg)


def tiny_dflash2(seed: int = 0, **dflash2) -> DFlashDrafter:
    """:func:`tiny_drafter` as DFlash2 (kernel 2, groups of 16, selector rank 8, top 4;
    ``dflash2`` overrides), every parameter random, so that no convolution is the
    identity and no name mix-up hides behind an initial value."""
    selector = DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    cfg = dataclasses.replace(tiny_drafter().config, dflash2=dataclasses.replace(selector, **dflash2))
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(std=0.1)
    return drafter.eval()


def flat_grads(trainer) -> torch.Tensor:
    """A trainer's accumulated gradients, all parameters in order, as one vector."""
    return torch.cat([g.flatten() for g in trainer.grads])


def tiny_head(hidden: int = 64, vocab: int = 96, seed: int = 0) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    return TargetHead(torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g) * 0.1)


def word_tokenizer(vocab_size: int = 96):
    """A word-level tokenizer with a Qwen-style chat template, built in memory (no files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>", "<|unk|>"]
    vocab = specials + ["\n", "user", "assistant"] + [f"w{i}" for i in range(vocab_size - 8)]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<|unk|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(specials)
    backend.add_tokens(["\n"])
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", unk_token="<|unk|>", chat_template=template
    )


# ---------------------------------------------------------------------------
# Decoder families: tiny random targets with each family's real structure
# ---------------------------------------------------------------------------

FAMILY_BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=512)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)

# model_type and the fields that give each family its structure; "pattern" repeats over the layers as
# layer_types. Every pattern puts both kinds of layer among the first three, which the drafters capture.
FAMILIES: dict[str, dict] = {
    "qwen3": dict(model_type="qwen3"),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, decoder_sparse_step=1, **_MOE),
    "qwen3_next": dict(model_type="qwen3_next", num_experts=4, shared_expert_intermediate_size=32,
                       pattern=["linear_attention", "full_attention"], **_MOE, **_LINEAR),
    "qwen3_5": dict(model_type="qwen3_5_text", pattern=["linear_attention", "full_attention"], **_LINEAR),
    "llama3": dict(model_type="llama", tie_word_embeddings=True,
                   rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=64)),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "gemma3": dict(model_type="gemma3_text", sliding_window=4, pattern=["sliding_attention", "full_attention"]),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    pattern=["sliding_attention", "full_attention"]),
    "glm4_moe": dict(model_type="glm4_moe", n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=1, topk_group=1, **_MOE),
    "deepseek_v3": dict(model_type="deepseek_v3", n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4, **_MOE),
}


def family_shape(name: str, num_layers: int = 4, vocab: int = 408) -> dict:
    """A ``target.shape`` (``model_type`` and config fields) of a tiny target of family ``name``;
    408 is the demo tokenizer's vocabulary."""
    spec = dict(FAMILIES[name])
    pattern = spec.pop("pattern", None)
    shape = {**FAMILY_BASE, "num_hidden_layers": num_layers, "vocab_size": vocab, **spec}
    if pattern:
        shape["layer_types"] = (pattern * num_layers)[:num_layers]
    return shape


def family_target(name: str, num_layers: int = 4, vocab: int = 408, std: float = 0.2, seed: int = 1) -> nn.Module:
    """A tiny random target of family ``name`` in float32, its matrices drawn at ``std`` so
    that its greedy output varies (see :func:`varied_target`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.model.target import attention_implementation

    shape = family_shape(name, num_layers, vocab)
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_implementation(config))
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=std)
    return model.eval()


def reference_drafter(export_dir) -> nn.Module:
    """The modules of z-lab's ``DFlashDraftModel``, built from an export's ``config.json``
    alone out of transformers' Qwen3 parts: decoder layers, ``norm``, and ``fc`` +
    ``hidden_norm`` over the captured layers. An export that loads into it strictly has
    the names and shapes the serving engines read."""
    import json
    from pathlib import Path

    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm

    raw = json.loads((Path(export_dir) / "config.json").read_text())
    config = Qwen3Config(**raw)
    features = len(raw["dflash_config"]["target_layer_ids"])
    model = nn.Module()
    model.layers = nn.ModuleList(Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
    model.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    model.fc = nn.Linear(features * config.hidden_size, config.hidden_size, bias=False)
    model.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    return model


def forward_on_noise(drafter: nn.Module, seed: int = 0) -> torch.Tensor:
    """A tiny drafter's output (hidden 64, 3 target layers) on seeded random context
    features at positions 0..8 and a block of 4 at 9..12: the same inputs for every
    drafter compared."""
    g = torch.Generator().manual_seed(seed)
    ctx, blk = torch.randn(1, 9, 3 * 64, generator=g), torch.randn(1, 4, 64, generator=g)
    with torch.no_grad():
        return drafter(ctx, blk, torch.arange(9)[None], torch.arange(9, 13)[None])


class PromptScriptDrafter(nn.Module):
    """Recognises each row's prompt by its context features (checked against the target's
    hidden states of the accepted prefix; a batched forward masks the columns a row does not hold) and
    proposes that prompt's scripted tokens at the block's positions. Its "hidden state"
    is the proposal, which :class:`OneHotHead` turns into logits. ``scripts`` holds a
    (sequence, proposals) pair per prompt: the sequence the target's features come
    from, and a token per position of it."""

    def __init__(self, config, target: nn.Module, scripts: list[tuple[list[int], list[int]]],
                 dtype: torch.dtype = torch.float32, tol: float = 1e-4):
        super().__init__()
        self.config, self.dtype, self.tol = config, dtype, tol
        self.scripts = []
        for sequence, proposals in scripts:
            with torch.no_grad():
                hs = target(input_ids=torch.tensor([sequence]), output_hidden_states=True).hidden_states
            features = torch.cat([hs[i + 1] for i in config.target_layer_ids], dim=-1)[0]
            self.scripts.append((features, torch.tensor(proposals)))

    def context(self, features: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return features  # recognised as they are: no projection

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        return ContextKV([(context[:, None], context[:, None])])  # the features, as one key/value head

    def forward(self, ctx_features, block_embeds, ctx_positions, block_positions, mask=None, projected=False):
        if isinstance(ctx_features, ContextKV):
            ctx_features = ctx_features.flat()[0]
        width = ctx_features.shape[1]
        rows = []
        for b, (features, positions) in enumerate(zip(ctx_features, block_positions)):
            if mask is not None:  # a batched forward: the row's held columns, in order (none: a free slot)
                features = features[mask[b, 0, 0, :width]]
                if not len(features):
                    rows.append(torch.zeros(len(positions), 1, dtype=self.dtype))
                    continue
            p = len(features)
            found = [proposals for script, proposals in self.scripts
                     if p <= len(script) and torch.allclose(features[:p], script[:p], rtol=self.tol, atol=self.tol)]
            assert len(found) == 1, f"context of length {p} matches {len(found)} scripted prompts"
            assert int(positions[0]) == p
            rows.append(found[0][positions].to(self.dtype)[:, None])
        return torch.stack(rows)

    def draft_logits(self, head, hidden: torch.Tensor) -> torch.Tensor:
        return head.logits(hidden).float()


class OneHotHead:
    """Embeds nothing; turns a :class:`PromptScriptDrafter`'s proposals into one-hot logits."""

    def __init__(self, vocab: int, dtype: torch.dtype = torch.float32):
        self.vocab, self.dtype = vocab, dtype
        self.embed_weight = torch.zeros(1, 1, dtype=dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, 1, dtype=self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.one_hot(hidden[..., 0].long(), self.vocab).to(self.dtype)
