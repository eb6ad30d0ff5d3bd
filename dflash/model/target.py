"""The frozen target: loading, and a prefill that captures only the chosen layers.

Hidden states are taken with forward hooks on the chosen decoder layers, so a
prefill never keeps all ``L + 1`` hidden states the way ``output_hidden_states``
does. Layer id ``i`` is the output of decoder layer ``i`` (HF
``hidden_states[i + 1]``), the convention of the z-lab checkpoints and of the
serving engines' ``target_layer_ids``.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from dflash.compile import CompileSettings
from dflash.files import local_path
from dflash.flex import kernel_options, packed_causal_block_mask
from dflash.model.drafter import TargetHead
from dflash.topk import top_k_of_rows

log = logging.getLogger(__name__)

MASK_TOKEN_CANDIDATES = ("<|MASK|>", "<|mask|>", "<mask>", "[MASK]")


RANDOM = "random"


def resolve_path(path: str) -> Path:
    """A local model directory; the shipped demo target is addressed as ``demo``."""
    resolved = local_path("target", path)
    if not (resolved / "config.json").is_file():
        raise FileNotFoundError(
            f"target.path={path!r} is not a local HF model directory (no config.json); "
            "download the model first (e.g. `huggingface-cli download Qwen/Qwen3-8B --local-dir ...`)"
        )
    return resolved


def decoder(model: nn.Module) -> nn.Module:
    """The decoder stack of an HF causal LM (``model.model`` for Llama/Qwen)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of an HF causal LM (``model.model.layers`` for Llama/Qwen)."""
    layers = getattr(decoder(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


ROLE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def unused_special_tokens(tokenizer: PreTrainedTokenizerBase) -> list[tuple[int, str]]:
    """The special tokens of ``tokenizer`` that a chat neither writes nor reads, in id order:
    added as special, none of its named roles (bos, eos, unk, pad, ...), and not in its chat
    template. Such a row of the embedding is what a drafter's mask token may take: nothing
    the target sees in a chat trained it, and no reply ever holds it."""
    named = {getattr(tokenizer, f"{role}_id", None) for role in ROLE_TOKENS}
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else json.dumps(template or "")
    added = sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())
    return [(i, token.content) for i, token in added
            if token.special and i not in named and token.content not in template]


def resolve_mask_token_id(tokenizer: PreTrainedTokenizerBase | None, vocab_size: int,
                          configured: int | str | None) -> int:
    """The mask id must be a row of the target embedding, or the drafter sees garbage.
    ``None``: the tokenizer's mask token; ``auto``: that, else the first of its
    :func:`unused_special_tokens`."""
    if configured in (None, "auto") and tokenizer is None:
        raise ValueError(f"a target without a tokenizer needs target.mask_token_id (0 <= id < {vocab_size})")
    if configured in (None, "auto"):
        found = next((tid for tok in MASK_TOKEN_CANDIDATES
                      if isinstance(tid := tokenizer.convert_tokens_to_ids(tok), int)
                      and tid != tokenizer.unk_token_id and tid >= 0), None)
        unused = [] if found is not None else [(i, t) for i, t in unused_special_tokens(tokenizer) if i < vocab_size]
        if found is None and configured == "auto" and unused:
            found = unused[0][0]
            log.info("target.mask_token_id=auto: id %d (%s), the first special token a chat does not use", found,
                     unused[0][1])
        if found is None:
            proposal = (f"unused special tokens it has: {', '.join(f'{i} {t}' for i, t in unused[:8])}"
                        f"{' ...' if len(unused) > 8 else ''}; target.mask_token_id=auto takes the first"
                        if unused else "it has no unused special token either")
            raise ValueError(f"the tokenizer has no mask token ({proposal}); set target.mask_token_id to a reserved "
                             f"id inside the embedding (0 <= id < {vocab_size}), e.g. 151669 for Qwen3")
        configured = found
    if not isinstance(configured, int) or not 0 <= configured < vocab_size:
        raise ValueError(f"target.mask_token_id={configured} is outside the target embedding "
                         f"(vocab_size={vocab_size}); give an id, or auto")
    return configured


def attends_fully(model: nn.Module) -> bool:
    """Whether every layer of the decoder attends to all earlier positions (no sliding
    window): then one causal mask serves every layer."""
    config = model.config.get_text_config()
    types = getattr(config, "layer_types", None) or ["full_attention"]
    windowed = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    return set(types) == {"full_attention"} and not windowed


def prepared_causal_masks(model: nn.Module) -> dict[str, None] | None:
    """The masks to hand the decoder ready-made, or None where it must build its own.

    A right-padded batch without an attention mask or a cache needs no mask tensor:
    HF's mask construction ends in SDPA's ``is_causal`` path (a None mask). But on the
    way it checks the position ids for packed sequences, and that check makes the
    host wait for the device once per prefill; the device then idles while the host
    launches the prefill's first layers (0.6-1.1 ms per prefill on the H200 at
    Qwen3-8B shapes). Decoders that take a prepared mapping of layer type to mask,
    as ``generate`` hands them (Qwen2, Qwen3, ...), get the None mask directly:
    only under SDPA, where None means causal, and only when every layer attends
    fully (a sliding window needs a real mask)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not attends_fully(model):
        return None
    try:
        takes_mapping = "causal_mask_mapping := attention_mask" in inspect.getsource(type(decoder(model)).forward)
    except (OSError, TypeError):
        takes_mapping = False
    return {"full_attention": None} if takes_mapping else None


@dataclass
class PrefillOutput:
    """What a prefill hands the drafter: the context features and, for the KL loss, the
    target's top-k logits."""

    features: torch.Tensor  # [b, S, n*H], the chosen layers' hidden states side by side
    topk_values: torch.Tensor | None = None  # [b, S, k] target logits (for the KL loss)
    topk_indices: torch.Tensor | None = None  # [b, S, k]


class _AllCaptured(Exception):
    """Raised by the last capture hook to end a prefill whose layers beyond are not needed."""


class Target:
    """A frozen HF causal LM that yields context features for the drafter."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.model = model.eval().requires_grad_(False)
        layers = decoder_layers(model)
        # The last layer has no capture point in the serving engines (they capture
        # before layer id+1) and HF applies the final norm to hidden_states[L].
        bad = [i for i in layer_ids if not 0 <= i < len(layers) - 1]
        if bad:
            raise ValueError(f"target layer ids {bad} outside 0..{len(layers) - 2}")
        self.layer_ids = list(layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        self._capturing = False
        self._stop_after: int | None = None
        self._masks = prepared_causal_masks(model)
        self._packed_block_masks = False
        for i in set(layer_ids):
            layers[i].register_forward_hook(self._hook(i))

    def _hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            if self._capturing:
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
                if layer_id == self._stop_after:
                    raise _AllCaptured

        return hook

    @property
    def num_layers(self) -> int:
        return len(decoder_layers(self.model))

    def head(self) -> TargetHead:
        """The frozen embedding and LM head, sharing storage with the target."""
        return TargetHead.of(self.model)

    def compile(self, settings: CompileSettings) -> None:
        """Compile each decoder layer's forward (static shapes, no CUDA graphs: a
        prefill's kernels are large enough that launches do not matter). The
        layers share one code object, so one graph per length serves all of
        them, and the capture hooks stay outside the compiled code."""
        for layer in decoder_layers(self.model):
            layer.forward = settings.compile(layer.forward, mode="default", fullgraph=False)

    def uncompile(self) -> None:
        """Back to the eager layers, for decoding: its shapes change every step."""
        for layer in decoder_layers(self.model):
            layer.__dict__.pop("forward", None)

    @contextmanager
    def eager(self) -> Iterator[None]:
        """The eager layers for a while (a slice of decoding between training prefills),
        then the compiled ones again, whose graphs are kept."""
        layers = decoder_layers(self.model)
        compiled = [layer.__dict__.pop("forward", None) for layer in layers]
        try:
            yield
        finally:
            for layer, forward in zip(layers, compiled):
                if forward is not None:
                    layer.forward = forward

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, topk: int = 0, position_ids: torch.Tensor | None = None) -> PrefillOutput:
        """Features of a right-padded batch. No attention mask is passed: under the
        causal mask a real token never sees the padding after it, so its hidden
        state is exact, and the plain causal path is the fast one (flash
        attention). What lands on padded positions is never read by the drafter.

        ``position_ids`` (restarting at 0 where each sample starts) mark a packed
        batch: HF then builds a mask in which each sample attends only to itself
        (from the position ids, for every attention implementation it has), and
        RoPE counts from each sample's start. :meth:`packing_error` checks that the
        model honours them. Under flex attention (:meth:`attend_packed_with_flex`) the
        block mask is handed over ready-made."""
        self._capturing = True
        extra = {}
        if position_ids is None:
            masks = self._masks
        elif self._packed_block_masks:
            masks = packed_causal_block_mask(position_ids)
            options = kernel_options()
            if options:  # only this mask: HF's own capture a symbolic length, which FLASH refuses
                extra["kernel_options"] = options
        else:
            masks = None
        try:
            if topk:
                out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=masks, use_cache=False,
                                 logits_to_keep=0, **extra)
                # the bf16 logits' own top-k, widened after: the same values as a float32
                # copy's (the cast is exact), without the [b, S, V] float32 copy
                rows = out.logits.shape[:2]
                values, indices = top_k_of_rows(out.logits.flatten(0, 1), topk)
                values, indices = values.float().unflatten(0, rows), indices.unflatten(0, rows)
            else:
                # Without the logits, nothing after the last captured layer is needed: for
                # Qwen3-8B (ids up to 33 of 36) two layers and the final norm are skipped.
                self._stop_after = max(self.layer_ids)
                try:
                    decoder(self.model)(input_ids=input_ids, position_ids=position_ids, attention_mask=masks,
                                        use_cache=False, **extra)
                except _AllCaptured:
                    pass
                values = indices = None
            features = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        finally:
            self._capturing = False
            self._stop_after = None
            self._captured.clear()
        return PrefillOutput(features, values, indices)

    def attend_packed_with_flex(self) -> bool:
        """Switch a target on CUDA to flex attention for packed rows, where its family has it.

        Under SDPA a packed row carries a dense ``[S, S]`` mask, which takes the masked
        kernel: the Qwen3-8B prefill of a 32k-token row ran at 21% MFU on the H200, against
        76% at 8k. Flex attention skips the tiles of other samples. Where every layer
        attends fully, the block mask is built from the samples' starts per tile
        (:func:`dflash.flex.packed_causal_block_mask`); HF builds its own from
        the position ids by evaluating the mask at every (query, key) pair, after a check
        that makes the host wait for the device, and that one serves sliding-window
        layers. Returns whether the switch was made."""
        if not getattr(self.model, "_supports_flex_attn", False):
            return False
        self.model.set_attn_implementation("flex_attention")
        self._masks = None
        self._packed_block_masks = attends_fully(self.model)
        return True

    def packing_error(self, lengths: tuple[int, ...] = (200, 330, 150)) -> float:
        """How far the features of random samples packed into one row are from those of
        each sample alone: the largest relative norm of the difference. Near 0 (rounding)
        when the model keeps packed samples apart; of order 1 when they see each other
        (recurrent or linear-attention layers, a model that ignores position ids). The
        samples span several of flex attention's 128-token tiles, with boundaries inside
        tiles, as real rows do (torch 2.11's flex kernel had no valid configuration for a
        row of 80 tokens at Qwen3-8B's head size)."""
        device = next(self.model.parameters()).device
        vocab = self.model.get_input_embeddings().weight.shape[0]
        g = torch.Generator().manual_seed(0)
        samples = [torch.randint(0, vocab, (1, n), generator=g).to(device) for n in lengths]
        positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
        packed = self.prefill(torch.cat(samples, dim=1), position_ids=positions).features[0].float()
        error, at = 0.0, 0
        for ids in samples:
            alone = self.prefill(ids).features[0].float()
            here = packed[at : at + ids.shape[1]]
            error = max(error, float((here - alone).norm() / alone.norm().clamp(min=1e-12)))
            at += ids.shape[1]
        return error


def attention_implementation(config: PretrainedConfig) -> str:
    """The attention a target runs: SDPA where its family supports it, else eager.

    gpt-oss has no SDPA path in transformers (its attention sinks need eager, flex or
    its own kernels), so it runs eager, which is exact and slower. A multi-head latent
    attention config (DeepSeek-V3) whose ``num_key_value_heads`` differs from
    ``num_attention_heads`` is refused: its keys have one head per query head, so HF
    repeats them into a shape that fails at the first masked call (decoding), after a
    prefill that happened to run."""
    text = config.get_text_config()
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if getattr(text, "kv_lora_rank", None) and kv_heads not in (None, heads):
        raise ValueError(
            f"{text.model_type} targets use multi-head latent attention, whose keys have one head per query head: "
            f"num_key_value_heads={kv_heads} must equal num_attention_heads={heads} (as in the released configs)"
        )
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return "sdpa" if model_class is None or getattr(model_class, "_supports_sdpa", False) else "eager"


def _param_name(model: nn.Module, param: torch.Tensor) -> str:
    return next(n for n, p in model.named_parameters(remove_duplicate=False) if p is param)


def random_head_weights(config: PretrainedConfig, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding and LM head of a random target, drawn on ``device`` from ``seed`` so
    that target ranks and drafter ranks (all of one device type) hold the very same
    matrices. On the device: on the host, two 152k x 4096 draws took 21 s on 2 cores."""
    text = config.get_text_config()
    g = torch.Generator(device).manual_seed(seed)
    std = getattr(text, "initializer_range", 0.02)
    shape = (text.vocab_size, text.hidden_size)
    embed = torch.randn(shape, generator=g, device=device) * std
    head = embed if text.tie_word_embeddings else torch.randn(shape, generator=g, device=device) * std
    return embed, head


def random_target(config: PretrainedConfig, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """A target with random weights at real shapes, for throughput runs (no download).
    The layers are drawn on ``device`` from ``seed``, identical on every rank of one
    device type; the embedding and LM head come from :func:`random_head_weights`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation=attention_implementation(config))
    embed, head = random_head_weights(config, seed, device)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(embed)
        model.get_output_embeddings().weight.copy_(head)
    return model.eval().requires_grad_(False)


@dataclass(frozen=True)
class TargetSource:
    """Where the target comes from (``target.*``): a local HF directory, ``demo`` (the
    shipped one), or ``random`` weights drawn from ``seed`` at the preset's ``shape``.
    ``tokenizer_path`` names a tokenizer kept apart from the weights; it is what gives a
    random target real prompts (evaluation while training at real shapes)."""

    path: str
    trust_remote_code: bool = False
    shape: Mapping | None = None
    seed: int = 0
    tokenizer_path: str | None = None

    @property
    def is_random(self) -> bool:
        return self.path == RANDOM

    def config(self) -> PretrainedConfig:
        """The HF config: config.json, or for ``random`` the preset's ``target.shape``."""
        if not self.is_random:
            return AutoConfig.from_pretrained(resolve_path(self.path), trust_remote_code=self.trust_remote_code,
                                              local_files_only=True)
        if not self.shape:
            raise ValueError(
                "target.path=random builds the target from target.shape; use a preset that has one "
                "(the conf/target presets other than demo, e.g. target=qwen3_8b)"
            )
        shape = dict(self.shape)
        return AutoConfig.for_model(shape.pop("model_type"), **shape)

    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The target's tokenizer: ``tokenizer_path``'s, else the weights' directory's; a
        random target without ``tokenizer_path`` has none."""
        if self.tokenizer_path:
            local = local_path("target", self.tokenizer_path)
            if not (local / "tokenizer_config.json").is_file():
                raise FileNotFoundError(f"target.tokenizer={self.tokenizer_path!r} is not a local tokenizer directory "
                                        "(no tokenizer_config.json)")
        elif self.is_random:
            return None
        else:
            local = resolve_path(self.path)
        tokenizer = AutoTokenizer.from_pretrained(local, trust_remote_code=self.trust_remote_code, local_files_only=True)
        vocab_size = self.config().get_text_config().vocab_size
        if self.tokenizer_path and len(tokenizer) > vocab_size:
            raise ValueError(f"target.tokenizer={self.tokenizer_path!r} has {len(tokenizer)} tokens, more than the "
                             f"target's vocab_size {vocab_size}")
        return tokenizer

    def load(self, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, PreTrainedTokenizerBase | None]:
        """The frozen model and its tokenizer; nothing is downloaded."""
        return self.model(device, dtype), self.tokenizer()

    def model(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The frozen model alone (a run reads the tokenizer once, when it plans)."""
        config = self.config()
        if self.is_random:
            return random_target(config, device, dtype, self.seed)
        model = AutoModelForCausalLM.from_pretrained(resolve_path(self.path), **self.loading(config, dtype)).to(device)
        return model.eval().requires_grad_(False)

    def loading(self, config: PretrainedConfig, dtype: torch.dtype) -> dict:
        """What ``from_pretrained`` takes besides the path, for every way of loading the target
        (whole here, sharded in :mod:`dflash.distributed.tensor_parallel`)."""
        return dict(config=config, dtype=dtype, trust_remote_code=self.trust_remote_code, local_files_only=True,
                    attn_implementation=attention_implementation(config))

    def head(self, device: torch.device, dtype: torch.dtype) -> TargetHead:
        """Only the embedding and LM head, read straight from the safetensors.

        Drafter ranks need these two matrices, not the whole target; the parameter
        names come from the model class built on the meta device, so any HF causal
        LM layout works, tied embeddings included.
        """
        if self.is_random:
            embed, head = random_head_weights(self.config(), self.seed, device)
            on_device = embed.to(device=device, dtype=dtype)
            return TargetHead(on_device, on_device if head is embed else head.to(device=device, dtype=dtype))
        local, config = resolve_path(self.path), self.config()
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=self.trust_remote_code)
        embed_name = _param_name(skeleton, skeleton.get_input_embeddings().weight)
        head_name = _param_name(skeleton, skeleton.get_output_embeddings().weight)
        index = local / "model.safetensors.index.json"
        files = json.loads(index.read_text())["weight_map"] if index.is_file() else None

        def read(name: str) -> torch.Tensor | None:
            file = local / (files.get(name, "") if files is not None else "model.safetensors")
            if not file.is_file():
                return None
            with safe_open(file, "pt", device="cpu") as f:
                return f.get_tensor(name).to(device=device, dtype=dtype) if name in f.keys() else None

        embed = read(embed_name)
        if embed is None:
            raise FileNotFoundError(f"{local} has no tensor {embed_name!r} in its safetensors files")
        head = read(head_name)
        if head is None:
            if not getattr(config.get_text_config(), "tie_word_embeddings", False):
                raise FileNotFoundError(f"{local} has no tensor {head_name!r} and its embeddings are not tied")
            head = embed
        return TargetHead(embed, head)
