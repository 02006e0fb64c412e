"""Tiny random models of every supported family, saved and loaded back through `from_pretrained`.

No checkpoint can be downloaded here, so tests, the CLI's built-in default and CPU benchmarks build models from the
transformers config classes. Each keeps the structure that matters: a dense first layer for glm4_moe and
deepseek_v3, an `mlp_only_layers` dense layer for qwen3_moe, GatedDeltaNet linear-attention layers for qwen3_5_moe,
alternating sliding/full layers with attention sinks for gpt_oss, shared experts where the family has them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers

_COMMON = dict(
    vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    tie_word_embeddings=False,
)
_ROUTED = dict(num_experts_per_tok=2)  # top-k
_DEEPSEEK_ROUTING = dict(n_routed_experts=8, n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                         routed_scaling_factor=2.5, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1)

TINY_CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        num_hidden_layers=2, intermediate_size=48, num_local_experts=4, **_ROUTED, **_COMMON),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=8, head_dim=16,
        mlp_only_layers=[0], norm_topk_prob=True, **_ROUTED, **_COMMON),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(
        num_hidden_layers=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
        head_dim=16, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, **_ROUTED, **_COMMON),
    "gpt_oss": lambda: transformers.GptOssConfig(
        num_hidden_layers=2, intermediate_size=48, num_local_experts=4, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], **_ROUTED, **_COMMON),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        num_hidden_layers=3, head_dim=16, **_DEEPSEEK_ROUTING, **_ROUTED, **_COMMON),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        num_hidden_layers=3, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, **_DEEPSEEK_ROUTING, **_ROUTED, **_COMMON),
    "olmoe": lambda: transformers.OlmoeConfig(
        num_hidden_layers=2, intermediate_size=32, num_experts=8, **_ROUTED, **_COMMON),
}


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    if family not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for {family!r}; choose one of {sorted(TINY_CONFIGS)}")
    config = TINY_CONFIGS[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _randomize_zero_inits(model: torch.nn.Module, generator: torch.Generator) -> None:
    """transformers initialises biases, sinks and router corrections to zero; random ones exercise more math."""
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.is_floating_point() and tensor.numel() and not tensor.any():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)


def save_tiny_model(family: str, directory: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a random tiny model of `family` to `directory` with `save_pretrained` (fp32 weights)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    _randomize_zero_inits(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(directory)
    return Path(directory)


def load_tiny_model(
    family: str, dtype: torch.dtype = torch.float32, directory: str | Path | None = None, **load_kwargs
) -> transformers.PreTrainedModel:
    """A tiny model of `family` loaded with `from_pretrained` (from `directory`, or written to a temp dir first)."""
    if directory is None:
        with tempfile.TemporaryDirectory() as tmp:
            return load_tiny_model(family, dtype, save_tiny_model(family, tmp), **load_kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **load_kwargs)
    return model.eval()
