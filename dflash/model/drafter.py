"""The DFlash drafter: Qwen3-style layers with target context injected as extra keys/values.

Module and parameter names follow the z-lab ``DFlashDraftModel`` layout (``fc``,
``hidden_norm``, ``layers.N.self_attn.q_proj`` ..., ``norm``) so that a state dict
saves straight into the format the serving engines load. The drafter owns no
embedding and no LM head: those are the target's, frozen, and live in
:class:`TargetHead`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash.flex import kernel_options
from dflash.model.attention import grouped_attention
from dflash.model.linear import Linear
from dflash.model.selector import CandidateSelector, GroupedCausalConv


def drafted(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """``t [b, n*B, ...]`` at block slots 1..B-1 only, ``[b, n*(B-1), ...]``.

    Slot 0 holds the anchor token itself: it is given, never predicted, and carries
    no loss. Its logits would be 1/B of the frozen LM head's work (forward and input
    gradient) for nothing, so the loss sees only the drafted slots."""
    return t.unflatten(1, (-1, block_size))[:, :, 1:].flatten(1, 2)


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Target layers spread evenly from layer 1 to layer L-3 (the z-lab rule).

    Ids are decoder-layer indices: id ``i`` is the output of decoder layer ``i``,
    which is ``hidden_states[i + 1]`` in HF's ``output_hidden_states`` tuple.
    """
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end <= start:
        raise ValueError(
            f"a target with {num_target_layers} layers is too shallow for {num_features} "
            "context features; set drafter.target_layer_ids explicitly"
        )
    return [round(start + i * (end - start) / (num_features - 1)) for i in range(num_features)]


FULL, SLIDING = "full_attention", "sliding_attention"  # layer types, as HF and z-lab name them


def check_layer_types(layer_types, num_layers: int, sliding_window) -> None:
    """Fail with the config keys to change: one known type per layer, and a window of at
    least one key (the query itself) exactly when some layer slides."""
    if layer_types is None:
        layer_types = []
    elif len(layer_types) != num_layers:
        raise ValueError(
            f"drafter.layer_types has {len(layer_types)} entries but the drafter has drafter.num_layers="
            f"{num_layers}: give one per layer ({FULL!r} or {SLIDING!r}), or null for all full"
        )
    unknown = sorted({str(t) for t in layer_types} - {FULL, SLIDING})
    if unknown:
        raise ValueError(f"drafter.layer_types holds {unknown}; each entry must be {FULL!r} or {SLIDING!r}")
    if SLIDING in layer_types:
        if sliding_window is None or isinstance(sliding_window, bool) or int(sliding_window) != sliding_window \
                or sliding_window < 1:
            raise ValueError(
                f"drafter.layer_types has sliding layers, so drafter.sliding_window must be an integer >= 1 "
                f"(keys a query sees, itself included), not {sliding_window!r}"
            )
    elif sliding_window is not None:
        raise ValueError(
            f"drafter.sliding_window={sliding_window!r} but no layer slides: set drafter.layer_types, "
            "or leave the window null"
        )


@dataclass
class DFlash2Config:
    """The DFlash2 additions (``drafter.variant=dflash2``); the defaults are the released
    drafters' (z-lab/incoai ``Qwen3.8-27B-DFlash2``): convolutions of 2 taps with one
    kernel per 16 channels, a rank-256 selector over the top 16 candidates."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ValueError(f"drafter.{name} must be an integer >= 1, not {value!r}")


VARIANTS = ("dflash", "dflash2")


def variant_config(variant: str, fields: Mapping) -> DFlash2Config | None:
    """``DrafterConfig.dflash2`` for ``drafter.variant``: ``None`` for DFlash, else the
    DFlash2 fields (``conv_kernel_size`` ...) found in ``fields``, defaults for the rest."""
    if variant not in VARIANTS:
        raise ValueError(f"drafter.variant={variant!r}; choose one of {', '.join(VARIANTS)}")
    if variant == "dflash":
        return None
    return DFlash2Config(**{f.name: fields[f.name] for f in dataclasses.fields(DFlash2Config)
                            if fields.get(f.name) is not None})


@dataclass
class DrafterConfig:
    """Shape of a drafter; everything but ``num_layers`` (and the attention of each
    layer, ``layer_types`` and ``sliding_window``) comes from the target.

    ``layer_types`` is ``None`` when every layer has full attention (an all-full list
    is stored as ``None``); a ``"sliding_attention"`` layer's query at position ``p``
    sees the keys at positions ``(p - sliding_window, p]``, context and block alike
    (docs/DESIGN.md section 1). With ``sliding_causal`` false (z-lab's ``is_causal:
    false``, as released DFlash2 drafters are configured) it also sees the block's
    slots after it, up to ``p + sliding_window``.

    ``dflash2`` is ``None`` for a DFlash drafter; a :class:`DFlash2Config` adds the
    convolutions and the candidate selector (docs/DESIGN.md, DFlash2). Kept as one
    optional field so that a DFlash drafter's config reads as before.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    dflash2: DFlash2Config | None = None
    sliding_causal: bool = True
    # z-lab's dflash_config transforms, which released drafters of some families carry: the
    # block embeddings scaled, the draft logits multiplied, then soft-capped (c * tanh(x / c))
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        check_layer_types(self.layer_types, self.num_layers, self.sliding_window)
        if not isinstance(self.sliding_causal, bool):
            raise ValueError(f"drafter.sliding_causal must be true or false, not {self.sliding_causal!r}")
        if isinstance(self.dflash2, dict):
            self.dflash2 = DFlash2Config(**self.dflash2)
        if self.dflash2 is not None and self.dflash2.conv_kernel_size > self.block_size:
            raise ValueError(f"drafter.conv_kernel_size={self.dflash2.conv_kernel_size} exceeds the block "
                             f"size {self.block_size}: its taps would reach past the block")
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types) if SLIDING in self.layer_types else None
        if self.layer_types is None:
            self.sliding_causal = True  # it shapes sliding layers alone
        if self.sliding_window is not None:
            self.sliding_window = int(self.sliding_window)

    @property
    def transforms(self) -> dict[str, float | None]:
        """The embedding and logit transforms that differ from none (empty for drafters
        trained here)."""
        identity = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
        return {k: getattr(self, k) for k, v in identity.items() if getattr(self, k) != v}

    @property
    def variant(self) -> str:
        return "dflash" if self.dflash2 is None else "dflash2"

    @property
    def attention_types(self) -> list[str]:
        """The type of every layer."""
        return list(self.layer_types or [FULL] * self.num_layers)

    @property
    def context_window(self) -> int | None:
        """How many context positions before a block any layer can see: all (``None``)
        unless every layer slides, then ``sliding_window - 1`` (the block's first slot
        takes one place of its window)."""
        if self.layer_types is None or FULL in self.layer_types:
            return None
        return self.sliding_window - 1

    def to_dict(self) -> dict:
        return asdict(self)


@torch.library.custom_op("dflash::rope_cos_sin", mutates_args=())
def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of ``positions x inv_freq``, ``[*positions.shape, 2 * len(inv_freq)]``.

    A custom op so that, compiled, the tables are computed once per call and read by
    every layer: as plain operations Inductor fused them into their consumer kernels,
    which evaluated cos and sin per element of the heads rather than once per position
    (1.0-1.1 ms more per micro-step at the paper shapes)."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@rope_cos_sin.register_fake
def _(positions, inv_freq, dtype):
    shape = (*positions.shape, 2 * inv_freq.shape[0])
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


class RotaryEmbedding(nn.Module):
    """Standard (non-scaled) RoPE as in Qwen3, computed for arbitrary position ids."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """Moves follow the module, casts do not: the frequencies stay fp32, as training
        and the serving engines compute them. Cast to bf16 with the rest of a decoding
        copy, they would rotate position 1000 by angles off by up to a radian."""
        kept = self.inv_freq
        super()._apply(fn, recurse)
        if not kept.is_meta and self.inv_freq.dtype != kept.dtype:
            self.inv_freq = kept.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = torch.ops.dflash.rope_cos_sin(positions, self.inv_freq, dtype)
        return cos[:, None], sin[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


Mask = BlockMask | torch.Tensor | None


@dataclass
class ContextKV:
    """The context as the drafter's attention reads it: per layer its keys (normed,
    rotated at their positions) and values ``[b, kv_heads, S, d]``
    (:meth:`DFlashDrafter.context_kv`)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    def flat(self) -> list[torch.Tensor]:
        """Every tensor as ``[b, S, kv_heads * d]`` (keys then values, layer by layer): one
        row per position, to keep beside a cache's columns."""
        return [t.transpose(1, 2).flatten(2) for kv in self.layers for t in kv]

    @classmethod
    def of_flat(cls, flat: list[torch.Tensor], kv_heads: int) -> ContextKV:
        """The inverse of :meth:`flat`."""
        heads = [t.unflatten(-1, (kv_heads, -1)).transpose(1, 2) for t in flat]
        return cls(list(zip(heads[0::2], heads[1::2])))


def window_mask(ctx_positions: torch.Tensor, block_positions: torch.Tensor, window: int,
                causal: bool = True) -> torch.Tensor:
    """A sliding layer's mask at inference, ``[b, 1, B, S + B]``, from positions alone:
    the block query at ``p`` sees the keys at ``(p - window, p]`` among the context and
    the block, or not ``causal`` those at ``(p - window, p + window)`` (z-lab's rule,
    docs/DESIGN.md section 1). Training builds its own from the anchors
    (:mod:`dflash.objective.masks`); tests hold the two equal."""
    q = block_positions[:, None, :, None]
    k = torch.cat([ctx_positions, block_positions], dim=1)[:, None, None, :]
    ahead = (k <= q) if causal else (k - q < window)
    return ahead & (q - k < window)


@functools.cache
def compiled_flex_attention():
    """Eager flex_attention materialises the full score matrix; compiled, it is a fused
    kernel. Built on first use so that CPU runs never load the compiler."""
    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
    """Attention over ``[context; block]`` keys.

    A ``BlockMask`` runs flex_attention (CUDA training); a boolean tensor, the dense
    mask (CPU training, tests, batched decoding), runs :func:`grouped_attention`;
    ``None`` lets every query see every key, which is exactly inference, where the
    context stops at the anchor.
    """
    if isinstance(mask, BlockMask):
        flex = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
        return flex(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=kernel_options())
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return grouped_attention(q, k, v, mask)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = Linear(h, self.num_heads * d)
        self.k_proj = Linear(h, self.num_kv_heads * d)
        self.v_proj = Linear(h, self.num_kv_heads * d)
        self.o_proj = Linear(self.num_heads * d, h)
        self.q_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.unflatten(-1, (n, self.head_dim)).transpose(1, 2)

    def keys_values(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values ``[b, kv_heads, S, d]`` of ``x [b, S, H]``."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), *rope)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        rope_block: tuple[torch.Tensor, torch.Tensor],
        rope_ctx: tuple[torch.Tensor, torch.Tensor] | None,
        mask: Mask,
    ) -> torch.Tensor:
        """``ctx`` is the projected context ``[b, S, H]``, or its keys and values as
        :meth:`keys_values` gives them (decoding keeps those per position)."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), *rope_block)
        k_blk, v_blk = self.keys_values(x, rope_block)
        k_ctx, v_ctx = ctx if isinstance(ctx, tuple) else self.keys_values(ctx, rope_ctx)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, ctx, rope_block, rope_ctx, mask: Mask, block_size: int | None = None) -> torch.Tensor:
        """With ``block_size``, the rows after attention are cut to the drafted slots
        1..B-1 of each block (see :meth:`DFlashDrafter.forward`)."""
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_block, rope_ctx, mask)
        if block_size is not None:
            x = drafted(x, block_size)
        return x + self.mlp(self.post_attention_layernorm(x))


class ConvDecoderLayer(DecoderLayer):
    """A DFlash2 layer: each sublayer's input and output pass through a block-causal
    grouped convolution (:class:`GroupedCausalConv`), inside the residual branch."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        conv = cfg.dflash2
        self.attention_conv = GroupedCausalConv(cfg.hidden_size, conv.conv_kernel_size, conv.conv_group_size)
        self.mlp_conv = GroupedCausalConv(cfg.hidden_size, conv.conv_kernel_size, conv.conv_group_size)

    def forward(self, x, ctx, rope_block, rope_ctx, mask: Mask, block_size: int | None = None, *,
                block: int) -> torch.Tensor:
        """``block`` is the length of each block in ``x``. With ``block_size`` the drafted
        slots are cut out after the MLP, not before: slot 1's convolution reads slot 0."""
        h, delta = self.attention_conv.prepare(self.input_layernorm(x), block)
        x = x + self.attention_conv.finish(self.self_attn(h, ctx, rope_block, rope_ctx, mask), delta, block)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x), block)
        x = x + self.mlp_conv.finish(self.mlp(h), delta, block)
        return x if block_size is None else drafted(x, block_size)


class DFlashDrafter(nn.Module):
    """Block drafter: block token embeddings in, final-normed hidden states out.

    ``ctx_features`` are the concatenated target hidden states ``[b, S, n*H]`` of
    the chosen target layers, fused once by ``fc`` + ``hidden_norm`` and injected
    as extra keys/values into every layer (queries come only from the block).

    A DFlash2 drafter (``cfg.dflash2``) has :class:`ConvDecoderLayer` layers and a
    ``candidate_selector``; its forward is the same, and the selector runs on the
    hidden states it returns (training: :mod:`dflash.objective.selector`, decoding:
    :mod:`dflash.decode.selector`).
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        n = len(cfg.target_layer_ids)
        self.fc = Linear(n * cfg.hidden_size, cfg.hidden_size)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        layer = DecoderLayer if cfg.dflash2 is None else ConvDecoderLayer
        self.layers = nn.ModuleList(layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        if cfg.dflash2 is not None:
            self.candidate_selector = CandidateSelector(
                cfg.hidden_size, cfg.vocab_size, cfg.dflash2.selector_rank, cfg.dflash2.selector_top_k)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Linear weights N(0, std), norms one; then the DFlash2 parts as their modules
        start them: the convolutions as the identity, the selector adding nothing."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        for module in self.modules():
            if isinstance(module, GroupedCausalConv):
                module.reset_parameters()
            elif isinstance(module, CandidateSelector):
                module.reset_parameters(std)

    def layer_masks(self, mask: Mask | dict[str, Mask], ctx_positions: torch.Tensor,
                    block_positions: torch.Tensor) -> list[Mask]:
        """The mask of every layer. Training gives one mask, or with sliding layers one per
        layer type (``{"full_attention": ..., "sliding_attention": ...}``, as HF maps
        them); ``None`` is inference, where sliding layers still need their window."""
        types = self.config.attention_types
        if isinstance(mask, dict):
            return [mask[t] for t in types]
        if SLIDING not in types:
            return [mask] * len(types)
        if mask is not None:
            raise ValueError("a drafter with sliding layers takes a mask per layer type: "
                             f"{{{FULL!r}: ..., {SLIDING!r}: ...}}")
        window = window_mask(ctx_positions, block_positions, self.config.sliding_window, self.config.sliding_causal)
        return [window if t == SLIDING else None for t in types]

    def context(self, ctx_features: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The context as every layer reads it, ``[b, S, H]``: the target's features
        through ``fc`` and ``hidden_norm``. Position by position, so decoding projects
        each position once and keeps the result instead of the 5x wider features."""
        return self.hidden_norm(self.fc(ctx_features.to(dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Every layer's keys and values of the projected ``context [b, S, H]`` at
        ``positions [b, S]``. Each depends on its own position only, so decoding computes
        them once per position and keeps them, where the forward over a projected context
        would project and rotate the whole context in every layer at every block (at
        Qwen3-8B shapes, 32 rows of 1k positions: 2.7 TFLOP per block)."""
        rope = self.rotary(positions, context.dtype)
        return ContextKV([layer.self_attn.keys_values(context, rope) for layer in self.layers])

    def forward(
        self,
        ctx_features: torch.Tensor,
        block_embeds: torch.Tensor,
        ctx_positions: torch.Tensor,
        block_positions: torch.Tensor,
        mask: Mask | dict[str, Mask] = None,
        drafted_only: bool = False,
        projected: bool = False,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[b, n*B, H]`` of every block slot, or with
        ``drafted_only`` ``[b, n*(B-1), H]`` of slots 1..B-1 only. ``projected``: the
        context comes as :meth:`context` gives it, not as target features; a
        :class:`ContextKV` is the context as :meth:`context_kv` gives it.

        Slot 0 holds the anchor token, which is given and never predicted. Its row still
        serves as a key and value in every layer's attention, but after the last
        attention nothing reads it: training drops it there and skips 1/B of the last
        layer's MLP (a DFlash2 drafter after it: its convolutions read slot 0).

        Blocks are ``config.block_size`` long when a training mask is given; without one
        (inference) ``block_embeds`` is a single block of any length."""
        if self.config.input_embedding_scale != 1.0:
            block_embeds = block_embeds * self.config.input_embedding_scale
        if isinstance(ctx_features, ContextKV):
            contexts, rope_ctx = ctx_features.layers, None
        else:
            ctx = ctx_features if projected else self.context(ctx_features, block_embeds.dtype)
            contexts, rope_ctx = [ctx] * len(self.layers), self.rotary(ctx_positions, block_embeds.dtype)
        rope_block = self.rotary(block_positions, block_embeds.dtype)
        masks = self.layer_masks(mask, ctx_positions, block_positions)
        x = block_embeds
        last = len(self.layers) - 1
        conv = {} if self.config.dflash2 is None else {
            "block": block_embeds.shape[1] if mask is None else self.config.block_size}
        for i, layer in enumerate(self.layers):
            cut = self.config.block_size if drafted_only and i == last else None
            x = layer(x, contexts[i], rope_block, rope_ctx, masks[i], cut, **conv)
        return self.norm(x)

    def draft_logits(self, head: "TargetHead", hidden: torch.Tensor) -> torch.Tensor:
        """Float32 draft logits of final-normed ``hidden`` through the target's LM head, with
        the config's logit transforms (a multiplier, then soft-capping) as the serving
        engines apply them.

        The rows go through the head as one contiguous matrix: batched decoding hands the
        drafted slots of its blocks as a strided view ``[b, B-1, H]``, which matmul ran as a
        batched GEMM of ``b`` matrices of ``B-1`` rows, at 66 TFLOP/s on the H200 (9.1 ms per
        drafting cycle at Qwen3-8B shapes, 32 rows), where one GEMM of the 480 rows takes
        0.77 ms."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        logits = head.logits(rows).view(*hidden.shape[:-1], -1).float()
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


class TargetHead(nn.Module):
    """The target's frozen input embedding and LM head, shared with the drafter.

    Kept as plain frozen tensors (never trained, never exported) so the drafter
    side holds only these two matrices of the target.
    """

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        self.embed_weight = nn.Parameter(embed_weight, requires_grad=False)
        self.lm_head_weight = nn.Parameter(lm_head_weight, requires_grad=False)

    @classmethod
    def of(cls, model: nn.Module) -> TargetHead:
        """The head of a loaded HF causal LM, sharing its storage."""
        return cls(model.get_input_embeddings().weight, model.get_output_embeddings().weight)

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head_weight.t()
