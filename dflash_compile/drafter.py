"""DFlash drafters: configuration, pairing checks, the module, and loading from either checkpoint format.

A drafter is a small dense Qwen3-style stack conditioned on target hidden states (FORMATS.md). One forward drafts
`block_size - 1` tokens after the anchor:

    context = hidden_norm(fc(concat(target hidden states at target_layer_ids)))      # once per committed token
    block   = embed([anchor, mask, ..., mask]) * input_embedding_scale
    every layer: q from the block; k, v from that layer's k_proj / v_proj over [context ; block]; QK-norm; RoPE at
                 absolute positions; full layers see the whole block, sliding layers are causal unless `is_causal`
                 says otherwise; the context never goes through the MLP
    logits  = lm_head(norm(block[1:])) * output_multiplier (optionally tanh-softcapped)

The drafter's cache holds context K/V only (`DrafterCache`); block K/V never stays.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from .cache import RowCache, additive_mask
from .checkpoint import checkpoint_directory
from .families import decoder_layers
from .sampling import processed_probs

# transformers' MuseGlimmerAssistantModel names the context projection differently from z-lab checkpoints.
TRANSFORMERS_NAMES = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}


class DrafterPairingError(ValueError):
    """The drafter was not made for this target."""


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...] | None  # None: the reference spacing over the target's layers
    num_target_layers: int | None
    layer_types: tuple[str, ...]
    sliding_window: int | None
    is_causal: bool | None  # sliding layers' causality; None = causal
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    qwen3: dict  # the Qwen3Config keys (RoPE incl. YaRN, max positions) for transformers' rotary embedding

    @classmethod
    def from_dict(cls, raw: dict) -> DrafterConfig:
        """Both z-lab layouts (DFlash keys in `dflash_config` or at the top level) and transformers' assistant."""
        dflash = raw.get("dflash_config") or {}

        def pick(key, default=None):
            return dflash.get(key, raw.get(key, default))

        layers = raw["num_hidden_layers"]
        ids = pick("target_layer_ids")
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            vocab_size=raw["vocab_size"],
            block_size=pick("block_size"),
            mask_token_id=pick("mask_token_id"),
            target_layer_ids=tuple(ids) if ids is not None else None,
            num_target_layers=pick("num_target_layers"),
            layer_types=tuple(raw.get("layer_types") or ["full_attention"] * layers),
            sliding_window=raw.get("sliding_window"),
            is_causal=raw.get("is_causal"),
            input_embedding_scale=raw.get("input_embedding_scale", 1.0),
            output_multiplier=raw.get("output_multiplier", 1.0),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            qwen3={k: v for k, v in raw.items() if k in _QWEN3_ROPE_KEYS} | {"head_dim": head_dim},
        )

    def rotary(self) -> Qwen3RotaryEmbedding:
        config = Qwen3Config(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads, **self.qwen3)
        return Qwen3RotaryEmbedding(config)


_QWEN3_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")


def _check(condition: bool, field: str, drafter_value, target_value, fix: str) -> None:
    if not condition:
        raise DrafterPairingError(
            f"drafter/target mismatch in {field}: drafter has {drafter_value}, target has {target_value}. {fix}"
        )


def default_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """The reference's spacing when a checkpoint names no target layers: round(1 + i * (N - 4) / (L - 1))."""
    return tuple(round(1 + i * (num_target_layers - 4) / max(count - 1, 1)) for i in range(count))


def context_features(hidden_states, layer_ids: tuple[int, ...], hidden_size: int) -> torch.Tensor:
    """What a drafter is conditioned on: the target's hidden states after each of `layer_ids`, concatenated on the
    feature axis. `hidden_states[i + 1]` is layer i's output (transformers' output_hidden_states; the last one is
    after the final norm), as the reference drafters were trained. A layer whose output is several residual streams
    ([batch, tokens, streams, hidden]: HY V4's hyper-connections; [batch, tokens, streams x hidden]: Qwen4-Exp's)
    gives their mean, a hidden state's scale."""
    return torch.cat([_one_stream(hidden_states[i + 1], hidden_size) for i in layer_ids], dim=-1)


def _one_stream(hidden: torch.Tensor, hidden_size: int) -> torch.Tensor:
    if hidden.dim() == 3 and hidden.shape[-1] == hidden_size:  # one stream
        return hidden
    streams = hidden if hidden.dim() == 4 else hidden.unflatten(-1, (-1, hidden_size))
    return streams.mean(dim=2)


def validate_pairing(config: DrafterConfig, fc_shape: tuple[int, ...], target_config) -> tuple[int, ...]:
    """Check everything a drafter must share with its target; return the target layer ids to capture.

    Runs before any state is built, so a wrong pair fails with nothing changed.
    """
    target = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    hidden, layers = target.hidden_size, decoder_layers(target)
    _check(config.hidden_size == hidden, "hidden_size", config.hidden_size, hidden,
           "Use a drafter trained for this target model.")
    count = fc_shape[1] // config.hidden_size if fc_shape[1] % config.hidden_size == 0 else None
    ids = config.target_layer_ids or (default_layer_ids(layers, count) if count else ())
    expected_fc = (config.hidden_size, len(ids) * config.hidden_size)
    if not ids or tuple(fc_shape) != expected_fc:
        raise DrafterPairingError(
            f"drafter fc.weight has shape {list(fc_shape)}, expected {list(expected_fc)} "
            f"(hidden_size x len(target_layer_ids)={len(ids)} * hidden_size); the checkpoint is inconsistent."
        )
    _check(config.vocab_size == target.vocab_size, "vocab_size", config.vocab_size, target.vocab_size,
           "The drafter shares the target's embedding and lm_head, so the vocabularies must be equal.")
    if not 0 <= config.mask_token_id < target.vocab_size:
        raise DrafterPairingError(
            f"drafter mask_token_id {config.mask_token_id} is outside the target's vocabulary "
            f"(vocab_size {target.vocab_size}); set dflash_config.mask_token_id to a token the target has."
        )
    if config.num_target_layers is not None:
        _check(config.num_target_layers == layers, "num_target_layers", config.num_target_layers, layers,
               "The drafter was trained on a target with a different depth.")
    bad = [i for i in ids if not 0 <= i < layers]
    if bad:
        raise DrafterPairingError(
            f"drafter target_layer_ids {list(ids)} include {bad}, outside the target's {layers} layers "
            f"(0..{layers - 1})."
        )
    if len(config.layer_types) != config.num_hidden_layers:
        raise DrafterPairingError(
            f"drafter layer_types has {len(config.layer_types)} entries but num_hidden_layers is "
            f"{config.num_hidden_layers}; give one layer type per drafter layer."
        )
    if "sliding_attention" in config.layer_types and not config.sliding_window:
        raise DrafterPairingError("drafter has sliding_attention layers but no sliding_window; set sliding_window.")
    if config.block_size is None or config.block_size < 2:
        raise DrafterPairingError(f"drafter block_size is {config.block_size}; it must be at least 2.")
    return tuple(ids)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int):
        super().__init__()
        heads, kv_heads, head_dim, hidden = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size)
        self.layer_idx, self.heads, self.kv_heads, self.head_dim = layer_idx, heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = Qwen3RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, heads: int) -> torch.Tensor:
        return proj(x).view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)

    def context_kv(self, context: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        key = _rope(self.k_norm(self._heads(context, self.k_proj, self.kv_heads)), cos, sin)
        return key, self._heads(context, self.v_proj, self.kv_heads)

    def forward(self, hidden, cos, sin, cached_kv, mask) -> torch.Tensor:
        query = _rope(self.q_norm(self._heads(hidden, self.q_proj, self.heads)), cos, sin)
        block_key, block_value = self.context_kv(hidden, cos, sin)
        key = torch.cat([cached_kv[0], block_key], dim=2)
        value = torch.cat([cached_kv[1], block_value], dim=2)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden.shape[:2], -1))


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DrafterAttention(config, layer_idx)
        mlp_config = Qwen3Config(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size)
        self.mlp = Qwen3MLP(mlp_config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DFlashDrafter(nn.Module):
    """The drafter's own weights (z-lab names); embedding and lm_head are the target's, passed in at call time."""

    def __init__(self, config: DrafterConfig, num_context_layers: int):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(num_context_layers * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = config.rotary()

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> RowCache:
        return RowCache(batch, max_len, dtype, device)

    @property
    def cache_elements_per_slot(self) -> int:
        """Key and value elements `new_cache` holds per slot of a row: every layer's, sliding ones too."""
        return self.config.num_hidden_layers * self.config.num_key_value_heads * self.config.head_dim * 2

    def add_context(self, cache: RowCache, features: torch.Tensor, counts: torch.Tensor) -> None:
        """Append `counts[b]` new context tokens per row (their target features, left-aligned) to the cache. The
        features come in the drafter's dtype: a target may keep its residual stream wider (ZAYA1's is fp32)."""
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        positions = cache.lengths[:, None] + torch.arange(features.shape[1], device=features.device)
        cos, sin = self.rotary_emb(context, positions)
        for i, layer in enumerate(self.layers):
            cache.write(i, *layer.self_attn.context_kv(context, cos, sin))
        cache.commit(counts)

    def _masks(self, cache: RowCache, block: int) -> dict[str, torch.Tensor]:
        """[b, 1, block, max_len + block] additive masks: committed context, then the block."""
        device = cache.lengths.device
        query = cache.lengths[:, None] + torch.arange(block, device=device)  # absolute positions of the block
        slots = torch.arange(cache.max_len, device=device).expand(cache.batch, -1)
        context_ok = (slots[:, None, :] < cache.lengths[:, None, None]).expand(-1, block, -1)
        block_ok = torch.ones(cache.batch, block, block, dtype=torch.bool, device=device)
        visible = torch.cat([context_ok, block_ok], dim=-1)
        return self._kind_masks(query, torch.cat([slots, query], dim=-1), visible, cache.dtype)

    def _kind_masks(self, query: torch.Tensor, key: torch.Tensor, visible: torch.Tensor, dtype: torch.dtype):
        """Additive masks per layer kind from query / key positions [b, q] / [b, k] and what each query may see
        [b, q, k]: full layers see all of it, sliding layers only their window (and causally unless is_causal)."""
        config = self.config
        masks = {"full_attention": visible}
        if "sliding_attention" in config.layer_types:
            distance = query[:, :, None] - key[:, None, :]
            causal = distance >= 0 if config.is_causal in (None, True) else True
            masks["sliding_attention"] = visible & (distance < config.sliding_window) & causal
        return {kind: additive_mask(ok, dtype) for kind, ok in masks.items()}

    def _layers(self, hidden: torch.Tensor, positions: torch.Tensor, context_kv, masks) -> torch.Tensor:
        """The block through every layer; `context_kv(i)` gives layer i's context keys/values."""
        cos, sin = self.rotary_emb(hidden, positions)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn(layer.input_layernorm(hidden), cos, sin, context_kv(i),
                                   masks[self.config.layer_types[i]])
            hidden = hidden + attn
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.norm(hidden)

    def forward(self, block_embeds: torch.Tensor, cache: RowCache) -> torch.Tensor:
        """Block hidden states after the final norm, [b, block, H]; the block starts at the cache's length."""
        block = block_embeds.shape[1]
        positions = cache.lengths[:, None] + torch.arange(block, device=block_embeds.device)
        return self._layers(block_embeds, positions, cache.kv, self._masks(cache, block))

    def packed_logits(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                      embed: nn.Module, lm_head: nn.Module) -> torch.Tensor:
        """Training forward: logits [b, n, B - 1, V] of n blocks per sequence at once. Block i starts with the
        token at position anchors[:, i] of `tokens` [b, T] and sees the context features [b, T, F] before that
        position only: the same computation as `add_context(features[:, :anchor])` then `draft_logits` (tested),
        with the blocks packed into one forward and kept apart by the mask."""
        config, device = self.config, tokens.device
        batch, length = tokens.shape
        count, size = anchors.shape[1], config.block_size
        starts = anchors.repeat_interleave(size, dim=1)  # [b, n * B]: each query's anchor position
        query = starts + torch.arange(size, device=device).repeat(count)
        block = torch.full((batch, count, size), config.mask_token_id, device=device)
        block[:, :, 0] = tokens.gather(1, anchors)

        context = self.hidden_norm(self.fc(features))
        context_positions = torch.arange(length, device=device).expand(batch, -1)
        cos, sin = self.rotary_emb(context, context_positions)
        context_kv = [layer.self_attn.context_kv(context, cos, sin) for layer in self.layers]

        context_ok = context_positions[:, None, :] < starts[:, :, None]
        block_of = torch.arange(count, device=device).repeat_interleave(size)
        block_ok = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
        masks = self._kind_masks(query, torch.cat([context_positions, query], dim=-1),
                                 torch.cat([context_ok, block_ok], dim=-1), context.dtype)
        embeds = embed(block.view(batch, -1)) * config.input_embedding_scale
        hidden = self._layers(embeds, query, context_kv.__getitem__, masks)
        return self._logits(hidden.view(batch, count, size, -1)[:, :, 1:], lm_head)

    def propose(self, anchor: torch.Tensor, cache: RowCache, embed: nn.Module, lm_head: nn.Module, sampler=None,
                draft_logits=None):
        """Drafts [b, block_size - 1] for the tokens after each row's anchor, and the processed distribution q they
        were drawn from (None for argmax drafts). `draft_logits` replaces `self.draft_logits` (a compiled one)."""
        config = self.config
        block = torch.full((anchor.shape[0], config.block_size), config.mask_token_id, device=anchor.device)
        block[:, 0] = anchor
        logits = (draft_logits or self.draft_logits)(embed(block) * config.input_embedding_scale, cache, lm_head)
        if sampler is None or sampler.argmax_drafts:
            return logits.argmax(dim=-1), None
        q = processed_probs(logits, sampler.chain)
        return sampler.draw(q), q

    def draft_logits(self, block_embeds: torch.Tensor, cache: RowCache, lm_head: nn.Module) -> torch.Tensor:
        """Logits for block positions 1..B-1: position j predicts the token at start + j."""
        return self._logits(self(block_embeds, cache)[:, 1:], lm_head)

    def _logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        config = self.config
        # in the head's dtype, as the target reads it (HY V4 keeps an fp32 lm_head in a bf16 model)
        logits = lm_head(hidden.to(lm_head.weight.dtype)) * config.output_multiplier
        if config.final_logit_softcapping:
            cap = config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


def drafter_config(target_config, *, block_size: int, mask_token_id: int, target_layer_ids, layer_types,
                   num_attention_heads: int, num_key_value_heads: int, head_dim: int, intermediate_size=None,
                   nested: bool = True, **extra) -> dict:
    """A z-lab-format drafter config.json for `target_config`, with the DFlash keys nested in `dflash_config`
    (or at the top level, the other layout z-lab checkpoints use)."""
    target = target_config.get_text_config()
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or 2 * target.hidden_size, "num_hidden_layers": len(layer_types),
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": target.vocab_size,
        "max_position_embeddings": getattr(target, "max_position_embeddings", 2048),
        "layer_types": list(layer_types), "num_target_layers": decoder_layers(target), **extra,
    }
    dflash = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)}
    if nested:
        config["dflash_config"] = dflash | {"block_size": block_size}
    else:
        config.update(block_size=block_size, dflash_config=dflash)
    return config


def save_drafter(directory: str | Path, config: dict, weights: dict[str, torch.Tensor],
                 transformers_format: bool = False) -> Path:
    """Write a drafter checkpoint (config.json + model.safetensors): z-lab names, or transformers' assistant names
    (`encoder.fc`, ...)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if transformers_format:
        renames = {z_lab: hf for hf, z_lab in TRANSFORMERS_NAMES.items()}
        weights = {next((new + k[len(old):] for old, new in renames.items() if k.startswith(old)), k): v
                   for k, v in weights.items()}
        dflash = config.get("dflash_config", {})
        config = {k: v for k, v in config.items() if k != "dflash_config"} | {
            "model_type": "muse_glimmer_assistant", "architectures": ["MuseGlimmerAssistantModel"],
            "block_size": dflash.get("block_size", config.get("block_size")),
            "mask_token_id": dflash["mask_token_id"], "target_layer_ids": dflash["target_layer_ids"]}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    return directory


def _read_checkpoint(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a drafter checkpoint: it has no config.json")
    raw = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return raw, weights


def _z_lab_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renamed = {}
    for name, tensor in weights.items():
        name = name.removeprefix("model.")
        for old, new in TRANSFORMERS_NAMES.items():
            if name.startswith(old):
                name = new + name[len(old):]
        renamed[name] = tensor
    return renamed


def load_drafter(drafter, target: nn.Module, dtype: torch.dtype | None = None) -> tuple[DFlashDrafter, tuple]:
    """A drafter from a checkpoint directory (z-lab or transformers format), a state-dict-bearing module
    (transformers' MuseGlimmerAssistantModel), a DFlashDrafter, or any object with `propose` / `add_context` /
    `new_cache` / `config.block_size` (e.g. the test oracle); validated against `target` before it is built.

    Returns the drafter (on the target's device and dtype) and the target layer ids to capture.
    """
    if isinstance(drafter, DFlashDrafter):
        ids = validate_pairing(drafter.config, tuple(drafter.fc.weight.shape), target.config)
        return drafter, ids
    if hasattr(drafter, "propose") and hasattr(drafter, "add_context"):  # a drafter needing no target features
        return drafter, ()
    if isinstance(drafter, (str, Path)):
        raw, weights = _read_checkpoint(checkpoint_directory(drafter))
    elif isinstance(drafter, nn.Module) and hasattr(drafter, "config"):
        raw, weights = drafter.config.to_dict(), drafter.state_dict()
    else:
        raise TypeError(f"drafter must be a checkpoint directory or a drafter module, not {type(drafter).__name__}")
    config = DrafterConfig.from_dict(raw)
    weights = _z_lab_names(weights)
    if "fc.weight" not in weights:
        raise DrafterPairingError(f"drafter weights have no fc.weight (found {sorted(weights)[:6]} ...)")
    ids = validate_pairing(config, tuple(weights["fc.weight"].shape), target.config)
    module = DFlashDrafter(config, len(ids))
    module.load_state_dict(weights, strict=True)
    reference = target.get_input_embeddings().weight
    return module.to(device=reference.device, dtype=dtype or reference.dtype).eval(), ids
