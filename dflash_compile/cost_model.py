"""Cost model: bytes, FLOPs and time of a target step over B tokens (decode: B = 1; verify: B = block size) from a
model config and a hardware profile, as sympy expressions in B, the context length C and the expert-cache hit rate h.

    bytes(B, C)  = dense + B * embedding row + moe_layers * U(B) * expert + kv_full * C + kv_sliding * min(C, W)
    U(B)         = E * (1 - (1 - k / E) ** B)          expected distinct experts per MoE layer, independent routing
    flops(B, C)  = 2 * B * (dense params + moe_layers * k * expert params) + 4 * B * C * attention width
    t(B, C)      = max(bytes / (HBM * efficiency), flops / FLOP/s) + step overhead + layers * layer overhead
    fetch(B, h)  = moe_layers * U(B) * (1 - h) * expert / PCIe            offloaded experts that miss the cache
    tokens/s     = tau / (t(B, C) + t_draft)                              at a mean accepted length tau

Sizes come from the model itself (built on the meta device from its config, no weights) and the family registry
(which parameters are routed experts); expert bytes follow their stored format (bf16, MXFP4 4.25 bits, FP8 8 bits
plus one fp32 scale per 128 x 128 block). `calibrate()` measures the current machine's bandwidths and FLOP/s;
`fit_step_overheads` fits the per-step and per-layer overheads and the weight-streaming efficiency to measured step
times (`MEASURED_STEPS`), which is how the default H200 profile predicts real steps rather than only their floors.
"""

from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import sympy
import torch
import transformers

from .families import (FULL_KINDS, KEYED_KINDS, RING_KINDS, auto_model_class, decoder_layers_key, experts_modules,
                       head_dim, layer_configs, ring_window, routed_top_k, spec_for_model, zero_compute_experts)

# Target step times measured on the H200 (docs/benchmarks.md, "Session 44"): random bf16 weights, uniform routing,
# 512-token context, compiled step as `generate` runs it (`bench/spec_decode.py --steps-only`, 2026-12-04).
# (model, decoder layers, tokens per step, context) -> seconds. Fitted: gpt-oss-20b (the whole model and a 4-layer
# cut, whose difference separates the per-step from the per-layer overhead), Qwen3-30B-A3B and OLMoE-1B-7B.
MEASURED_STEPS = {
    ("gpt-oss-20b", 24, 1, 512): 4.09e-3, ("gpt-oss-20b", 24, 8, 512): 10.82e-3,
    ("gpt-oss-20b", 24, 16, 512): 13.92e-3, ("gpt-oss-20b", 4, 1, 512): 0.97e-3,
    ("qwen3-30b-a3b", 48, 1, 512): 3.92e-3, ("qwen3-30b-a3b", 48, 8, 512): 9.66e-3,
    ("qwen3-30b-a3b", 16, 1, 512): 1.45e-3, ("olmoe-1b-7b", 16, 1, 512): 1.47e-3, ("olmoe-1b-7b", 16, 8, 512): 3.51e-3,
}
# Held out from the fit: DeepSeek-V3's first 5 layers (3 dense, MLA; session 43), which the fitted profile predicts
# within 25% (1.23x), as it does each fitted step (0.83-1.24x)
HELD_OUT_STEPS = {("deepseek-v3", 5, 1, 512): 2.65e-3}
# fit_step_overheads on MEASURED_STEPS: 358 us per step, 20.6 us per layer per step, 66.9% of the copy bandwidth
# while streaming
H200_STEP_S, H200_LAYER_S, H200_EFFICIENCY = 358.35e-6, 20.650e-6, 0.66884

B, C, H = sympy.symbols("B C h", positive=True)  # tokens per step, context length, expert-cache hit rate

BITS_PER_WEIGHT = {"bf16": 16.0, "fp16": 16.0, "fp32": 32.0, "mxfp4": 4.25, "fp8_block": 8.0 + 32 / 128**2}


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm: float  # device memory bytes/s (a large device-to-device copy, read + write)
    pcie: float  # pinned host-to-device bytes/s
    flops: float  # dense bf16 FLOP/s
    step_overhead: float  # seconds per step that no byte or FLOP explains (launches, syncs); 0 = pure roofline
    layer_overhead: float = 0.0  # seconds per decoder layer per step: launches and small ops between weight reads
    efficiency: float = 1.0  # the share of `hbm` a step achieves while streaming its weights

    def roofline(self) -> Hardware:
        """The same machine with no overheads and full bandwidth: every step at its floor."""
        return replace(self, step_overhead=0.0, layer_overhead=0.0, efficiency=1.0)

    @classmethod
    def load(cls, path: str | Path) -> Hardware:
        return cls(**json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> Path:
        Path(path).write_text(json.dumps(asdict(self), indent=1))
        return Path(path)


HARDWARE = {
    # measured on this project's H200 (docs/benchmarks.md, 2026-11-30): copy 4243 GB/s, pinned H2D 55 GB/s; step and
    # layer overheads and efficiency = fit_step_overheads(MEASURED_STEPS) (tests/test_cost_model.py re-fits them)
    "h200": Hardware("h200", hbm=4.243e12, pcie=55e9, flops=989e12, step_overhead=H200_STEP_S,
                     layer_overhead=H200_LAYER_S, efficiency=H200_EFFICIENCY),
    # H100 SXM datasheet bandwidth scaled by the H200's measured/datasheet ratio (0.88); PCIe 5 like the H200; the
    # H200's fitted overheads (same software path, unmeasured here)
    "h100": Hardware("h100", hbm=2.95e12, pcie=55e9, flops=989e12, step_overhead=H200_STEP_S,
                     layer_overhead=H200_LAYER_S, efficiency=H200_EFFICIENCY),
}

REFERENCE_CONFIGS = {  # real model shapes by name (weights are never needed)
    "gpt-oss-20b": lambda: transformers.GptOssConfig(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072),
    "gpt-oss-120b": lambda: transformers.GptOssConfig(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4, vocab_size=201088,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 18, max_position_embeddings=131072),
    "qwen3-30b-a3b": lambda: transformers.Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, norm_topk_prob=True, max_position_embeddings=40960),
    # the config classes' defaults are these released models' shapes (transformers 5.24), OLMoE's expert width aside
    "qwen3.5-35b-a3b": transformers.Qwen3_5MoeTextConfig,  # 40 layers (3 of 4 linear attention), 256 experts, top-8
    "qwen3-next-80b-a3b": transformers.Qwen3NextConfig,  # 48 layers (3 of 4 linear attention), 512 experts, top-10
    "glm-4.5-air": transformers.Glm4MoeConfig,  # 46 layers (the first dense), 128 experts, top-8, a shared expert
    "deepseek-v3": transformers.DeepseekV3Config,  # 61 layers (3 dense), MLA, 256 experts, top-8, a shared expert
    "glm-4.7-flash": transformers.Glm4MoeLiteConfig,  # 47 layers (the first dense), MLA, 64 experts, top-4, shared 1
    "olmoe-1b-7b": lambda: transformers.OlmoeConfig(intermediate_size=1024),  # 16 layers, 64 experts, top-8
    "mixtral-8x7b": transformers.MixtralConfig,  # 32 layers, 8 experts, top-2
    "deepseek-v2-lite": lambda: transformers.DeepseekV2Config(  # 27 layers (the first dense), MLA, 64 experts, top-6
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0, vocab_size=102400),
    "ernie-4.5-21b-a3b": transformers.Ernie4_5_MoeConfig,  # 28 layers (the first dense), 64 experts, top-6, shared 2
    "phi-3.5-moe": transformers.PhimoeConfig,  # 32 layers, 16 experts, top-2
    "qwen1.5-moe-a2.7b": transformers.Qwen2MoeConfig,  # 24 layers, 60 experts, top-4, a gated shared expert
    "dots.llm1": lambda: transformers.Dots1Config(  # rednote-hilab/dots.llm1.base: 62 layers (the first dense)
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, n_routed_experts=128, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, rope_theta=10000000.0, max_position_embeddings=32768),
    "solar-open-100b": transformers.SolarOpenConfig,  # 48 layers, 128 experts, top-8, a shared expert
    "minimax-m2": transformers.MiniMaxM2Config,  # 62 layers, 256 experts of 1536, top-8
    "flexolmo-7x7b": transformers.FlexOlmoConfig,  # 32 layers, 7 experts of 11008, top-5
    "mimo-v2-flash": transformers.MiMoV2FlashConfig,  # 48 layers (the first dense; 3 in 4 sliding), 256 experts, top-8
    "hy-v3": transformers.HYV3Config,  # 80 layers (the first dense), 192 experts of 1536, top-8, a shared expert
    "laguna": transformers.LagunaConfig,  # 40 layers (the first dense), 256 experts of 512, top-8, a shared expert
    "mellum2-12b-a2.5b": transformers.MellumConfig,  # 28 layers, 64 experts of 896, top-8
    "kolibri-1": transformers.Kolibri1Config,  # 50 layers (4 in 5 sliding), 384 experts of 512, top-6, a shared expert
    # Kolibri 1.1 (transformers >= 5.25): Kolibri 1's shape with its first 2 layers dense; 10 indexed layers, 4 of
    # them indexers, 5 reading an earlier one's keys and values
    "kolibri-1.1": lambda: transformers.Kolibri1_1Config(),
    "flint": transformers.FlintConfig,  # 49 layers (47 routed), 256 experts of 512, top-6, a shared expert
    # 28 layers (the first dense), 160 experts of 512, top-16; transformers 5.25 and later
    "minicpm5-15b-a2.5b": lambda: transformers.MiniCPM5MoeConfig(),
    # Ergo (the config class's defaults; transformers >= 5.25): 64 layers (the first dense), 256 experts of 4096
    # without a gate, top-8, a shared expert, hidden 8192: ~1.1T
    "ergo": lambda: transformers.ErgoConfig(),
    "beam-1.0-501b-a23b": transformers.BeamConfig,  # 52 layers (49 routed), 256 experts of 2560, top-8
    "lara-4-mini": transformers.LaraMiniConfig,  # 34 layers (14 linear, 13 sliding), 128 experts of 512, top-4
    "mistral-small-4-119b": transformers.Mistral4Config,  # 36 layers, MLA, 128 experts of 2048, top-4, a shared expert
    "kimi-linear-48b-a3b": transformers.KimiLinearConfig,  # 27 layers (21 KDA, 6 MLA; the first dense), 256 experts
    "llama-4-scout-17b-16e": transformers.Llama4TextConfig,  # 48 layers (3 in 4 chunked), 16 experts, top-1, shared
    "llama-4-maverick-17b-128e": lambda: transformers.Llama4TextConfig(  # every other layer routed, 128 experts
        num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False),
    # Jamba 1.5 Mini (52B, 12B active; Jamba-v0.1's shape): 32 layers, attention at 4, 12, 20, 28 and Mamba elsewhere,
    # 16 experts of 14336 in every other layer, top-2; dflash-compile runs it on transformers 5.25 and later
    "jamba-1.5-mini": transformers.JambaConfig,
    # LongCat-Flash-Chat (560B, 18.6-31.3B active): 28 decoder layers of two latent-attention sublayers and two MLPs of
    # 12288, 512 experts of 2048 and 256 zero-compute ones, top-12; transformers 5.25 and later
    "longcat-flash-chat": transformers.LongcatFlashConfig,
    # Granite 4.0-H-Small (32B, 9B active): 40 layers, attention at 5, 15, 25, 35 and Mamba2 elsewhere, 72 experts of
    # 768, top-10, a shared MLP of 8192, no rotary positions
    "granite-4.0-h-small": lambda: transformers.GraniteMoeHybridConfig(
        hidden_size=4096, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, intermediate_size=768,
        shared_intermediate_size=8192, num_local_experts=72, num_experts_per_tok=10, mamba_n_heads=128,
        mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_chunk_size=256, vocab_size=100352,
        max_position_embeddings=131072, position_embedding_type="nope",
        layer_types=["full_attention" if i % 10 == 5 else "linear_attention" for i in range(40)]),
    # Nemotron 3 Nano (30B, 3.5B active): 52 layers of one mixer each, 23 Mamba2, 23 MoE (128 experts of 1856 without
    # a gate, top-6, a shared MLP of 3712), 6 attention (widths as recalled, not read from its config.json here)
    "nemotron-3-nano-30b-a3b": lambda: transformers.NemotronHConfig(
        hidden_size=2688, num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_num_heads=64,
        mamba_head_dim=64, ssm_state_size=128, n_groups=8, chunk_size=128, n_routed_experts=128, num_experts_per_tok=6,
        moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5,
        vocab_size=131072, max_position_embeddings=262144,
        layers_block_type=[{"M": "linear_attention", "E": "moe", "*": "full_attention"}[block]
                           for block in "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"]),
    "a.x-k1": transformers.AXK1Config,  # 61 layers (the first dense), MLA, 192 experts of 2048, top-8, a shared expert
    "qwen3-vl-30b-a3b": lambda: transformers.Qwen3VLMoeConfig(text_config=dict(  # image-text-to-text: the text decoder
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, max_position_embeddings=262144, rope_parameters=dict(
            rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20], mrope_interleaved=True))),
    # Qwen3-Omni-30B-A3B's thinker (text prompts): Qwen3-VL-MoE's decoder shape beside audio and vision towers
    "qwen3-omni-30b-a3b": lambda: transformers.Qwen3OmniMoeThinkerConfig(text_config=dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        vocab_size=152064, max_position_embeddings=65536, rope_parameters=dict(
            rope_type="default", rope_theta=1000000.0, mrope_section=[24, 20, 20], mrope_interleaved=True)),
        vision_start_token_id=151652),
    "deepseek-v3.2": transformers.DeepseekV32Config,  # DeepSeek-V3's shape (671B, 37B active), DSA: 2048 keys a query
    "glm-5": transformers.GlmMoeDsaConfig,  # 78 layers (3 dense), MLA with DSA, 256 experts of 2048, top-8: 744B
    # Unlimited OCR (the config class's defaults): 12 layers (the first dense), 64 experts of 896, top-6, 2 shared,
    # hidden 1280, a 128-token window past the prompt (~3B)
    "unlimited-ocr": lambda: transformers.UnlimitedOcrConfig(),
    # Inkling 2's text model (the config class's defaults): 48 layers, 384 experts of 2304, top-8, hidden 4608 (~0.6T)
    "inkling2": lambda: transformers.Inkling2TextConfig(),
    # Inkling's text model (the config class's defaults): 66 layers (5 in 6 sliding), 256 experts of 3072, top-6, 2
    # shared experts, hidden 6144 (~0.96T)
    "inkling": lambda: transformers.InklingTextConfig(),
    # MiniMax-M3's text model (the config class's defaults): 60 layers, 128 experts of 3072, top-4, a shared expert,
    # hidden 6144 (~435B); its sparse layers come from a checkpoint's `sparse_attention_config`, full ones here
    "minimax-m3": lambda: transformers.MiniMaxM3VLTextConfig(),
    # DeepSeek-V4-Flash (the config class's defaults): 43 layers (2 HCA, then CSA and HCA in turn, all with a 128-token
    # window), 256 experts of 2048, top-6, a shared expert, the first 3 routed by token id, hidden 4096 (~284B)
    "deepseek-v4-flash": lambda: transformers.DeepseekV4Config(),
    # MiniMax-Text-01 (MiniMax-M1 the same shape; from memory, not read from a released file): 80 layers, each
    # eighth full attention, the others lightning attention; 32 experts of 9216, top-2: ~456B
    "minimax-text-01": lambda: transformers.MiniMaxConfig(
        hidden_size=6144, intermediate_size=9216, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, num_local_experts=32, num_experts_per_tok=2, vocab_size=200064, block_size=256,
        layer_types=(["linear_attention"] * 7 + ["full_attention"]) * 10, max_position_embeddings=1048576),
    # HY V4 (the config class's defaults): 34 layers (the first dense), MLA with DSA (2048 keys a query; a layer in
    # four runs its own indexer, the others reuse its choice), attention sinks, 4 hyper-connection streams, 256
    # experts of 768, top-8, a shared expert: ~58B, 4.8B active
    "hy-v4": transformers.HYV4Config,
    # Hy4, HY V4's image-text-to-text release (the config class's defaults): 78 layers, hidden 6144, 256 experts of
    # 2048, top-8: ~769B, 48B active
    "hy4": transformers.HYV4VLConfig,
    # ZAYA1-8B (the config class's defaults; transformers >= 5.25): 40 CCA layers, 16 experts of 2048 and a skip
    # expert, top-1
    "zaya1-8b": lambda: transformers.ZayaConfig(),
    # Muse Spark (the config class's defaults): 62 layers, hidden 8192, 256 experts of 4096 in a 4096-wide expert
    # space, top-8: ~818B, 44B active
    "muse-spark": transformers.MuseSparkConfig,
    # GLM-5-Next (image-text-to-text; the config class's defaults): 45 layers (the first 3 dense), KDA in three of
    # four, the fourth latent attention without rotary positions over the pools of 16 keys its indexer picks (2048
    # keys a query), 4 hyper-connection streams, 288 experts of 2048, top-8, a shared expert
    "glm-5-next": transformers.Glm5NextConfig,
    "a.x-k2-light": transformers.AXK2Config,  # 48 layers, MLA with DSA, 128 experts of 512, top-8, a shared expert
    # dots.llm3 (Dots 3 Note preview, its causal LM; the config class's defaults): 46 layers (the first dense), DSA
    # layers and sliding latent-attention ones of their own widths (3 in 4), 256 experts of 1536, top-8, shared
    "dots3-note": transformers.Dots3NoteTextConfig,
    # Mistral Large 4 (image-text-to-text; the config class's defaults): 72 layers (the first dense), MLA with DSA
    # without a query LoRA, every fourth layer without rotary positions, 128 experts of 6144, top-4, a shared expert
    "mistral-large-4": transformers.MistralLarge4Config,
    "dbrx-instruct": lambda: transformers.DbrxConfig(  # 16 experts, top-4, q/k/v clipped at 8
        d_model=6144, n_heads=48, n_layers=40, max_seq_len=32768, vocab_size=100352,
        attn_config=dict(kv_n_heads=8, clip_qkv=8.0, rope_theta=500000.0),
        ffn_config=dict(ffn_hidden_size=10752, moe_num_experts=16, moe_top_k=4, moe_normalize_expert_weights=1.0)),
    "jetmoe-8b": lambda: transformers.JetMoeConfig(  # 24 layers, 8 MLP and 8 attention experts of 2048 queries, top-2
        num_hidden_layers=24, intermediate_size=5632, rms_norm_eps=1e-5),
    "qwen2-57b-a14b": lambda: transformers.Qwen2MoeConfig(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, num_experts=64,
        num_experts_per_tok=8, moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
        intermediate_size=18944, max_position_embeddings=32768),
}


def reference_config(name_or_path: str, layers: int | None = None):
    """A config by reference name (REFERENCE_CONFIGS) or from a checkpoint directory; with `layers`, its first
    `layers` decoder layers only."""
    if name_or_path in REFERENCE_CONFIGS:
        try:
            config = REFERENCE_CONFIGS[name_or_path]()
        except AttributeError as missing:  # a config class newer than the installed transformers
            raise ValueError(f"{name_or_path!r} needs a newer transformers than {transformers.__version__} "
                             f"({missing}): pip install -U transformers") from None
    else:
        config = transformers.AutoConfig.from_pretrained(name_or_path)
    if layers:
        text = config.get_text_config()  # the decoder's, under an image-text-to-text config
        setattr(text, decoder_layers_key(text), layers)
        # attention kinds; GLM-4.7-Flash's dense / sparse MLPs; DSA indexers' kinds, Mistral Large 4's rotary layers
        # and latents' sources (a property, as Jamba's layer kinds, follows the layer count by itself)
        for per_layer in ("layer_types", "mlp_layer_types", "indexer_types", "no_rope_layers", "kv_source_layers"):
            if getattr(text, per_layer, None) and not isinstance(getattr(type(text), per_layer, None), property):
                setattr(text, per_layer, getattr(text, per_layer)[:layers])
    return config


@dataclass(frozen=True)
class ModelSizes:
    """What a step reads, from the model's own parameters (meta device: no memory)."""

    dense_params: int  # read every step: attention, norms, routers, shared experts, dense MLPs, lm_head
    embedding_row_params: int  # hidden size: one embedding row per token
    expert_params: int  # one routed expert
    experts: int
    top_k: int  # picks a token's router makes, among `experts` + `zero_compute_experts`
    zero_compute_experts: int  # experts that read no weights (LongCat-Flash's): picks of them cost nothing
    moe_layers: int
    kv_elements_per_token: int  # K and V elements cached per context token, full-attention layers
    sliding_kv_elements_per_token: int  # the same for ring layers (sliding, chunked), reading at most `window` tokens
    window: int
    attention_width: int  # query heads x head dim, summed over attention layers (for attention FLOPs)
    layers: int  # decoder layers (each costs the hardware's layer overhead)

    @classmethod
    def of(cls, config) -> ModelSizes:
        with torch.device("meta"):
            model = auto_model_class(config).from_config(config)
        spec = spec_for_model(model)
        if spec is None:
            raise ValueError(f"{config.model_type} is not a MoE model of a supported family")
        text = config.get_text_config()
        modules = list(experts_modules(model).values())
        if not modules:
            raise ValueError(f"{config.model_type} with {text.num_hidden_layers} layers has no "
                             "routed experts in them (dense first layers): take more layers")
        expert_ids = {id(p) for m in modules for p in m.parameters()}
        # weights of routed attention experts (JetMoE's): read per expert picked, as the MLP experts' are
        path = spec.routed_attention_experts
        attention_experts = [p for name, module in model.named_modules() if path and name.endswith(path)
                             for p in module.parameters() if p.dim() == 3]
        expert_ids |= {id(p) for p in attention_experts}
        embedding = model.get_input_embeddings().weight
        tied = model.get_output_embeddings().weight is embedding
        # the decoder's and the output head's weights (not an image-text-to-text model's vision tower)
        stepped = {id(p): p for p in (*model.get_decoder().parameters(), *model.get_output_embeddings().parameters())}
        dense = sum(p.numel() for key, p in stepped.items() if key not in expert_ids and p is not embedding)
        experts = modules[0].down_proj.shape[0]
        per_expert = (sum(p.numel() for p in modules[0].parameters())
                      + sum(p.numel() for p in attention_experts) // len(modules)) // experts
        kinds = spec.attention_kinds(text)
        # query heads x head dim of each attention layer (Gemma 4's full and Step 3.7's sliding layers differ)
        widths = [layer.num_attention_heads * head_dim(text, i) for i, layer in enumerate(layer_configs(text))]

        def per_layer(layer: int) -> int:  # K and V elements the layer reads per context token
            if not spec.latent_attention:
                return spec.cached_per_token(text, kinds[layer], layer)
            # every head's expanded keys and values, as transformers' latent attention reads them (dots.llm3's
            # sliding layers have heads and widths of their own)
            own = layer_configs(text)[layer]
            return own.num_attention_heads * (own.qk_nope_head_dim + own.qk_rope_head_dim + own.v_head_dim)
        return cls(
            dense_params=dense + (embedding.numel() if tied else 0),
            embedding_row_params=embedding.shape[1],
            expert_params=per_expert,
            experts=experts,
            top_k=routed_top_k(text),
            zero_compute_experts=zero_compute_experts(text),
            moe_layers=len(modules),
            # with compressed entries (DeepSeek-V4's), which every step reads whole as full layers' keys
            kv_elements_per_token=sum(per_layer(layer) for layer, kind in enumerate(kinds) if kind in FULL_KINDS)
            + math.ceil(sum(width / rate for layer in range(len(kinds))
                            for rate, width in spec.compressed_entries(text, layer))),
            sliding_kv_elements_per_token=sum(per_layer(layer) for layer, kind in enumerate(kinds)
                                              if kind in RING_KINDS),
            window=max(ring_window(text, kind) or 0 for kind in kinds),
            attention_width=sum(width for kind, width in zip(kinds, widths) if kind in KEYED_KINDS),
            layers=text.num_hidden_layers,
        )


@dataclass(frozen=True)
class StepCost:
    """Symbolic costs of one target step; `evaluate` gives numbers."""

    sizes: ModelSizes
    hardware: Hardware
    weight_bits: float = 16.0
    expert_bits: float = 16.0
    kv_bits: float = 16.0
    draft_seconds: float = 0.0  # one drafter forward (measured, or from its own StepCost)

    @property
    def distinct_experts(self) -> sympy.Expr:
        """Routed experts a step over B tokens reads per MoE layer, each token's k picks uniform over every expert
        (zero-compute ones too: those read nothing)."""
        e, k = self.sizes.experts, self.sizes.top_k
        return e * (1 - (1 - sympy.Rational(k, e + self.sizes.zero_compute_experts)) ** B)

    @property
    def expert_bytes(self) -> float:
        return self.sizes.expert_params * self.expert_bits / 8

    @property
    def bytes(self) -> sympy.Expr:
        s = self.sizes
        return (s.dense_params * self.weight_bits / 8 + B * s.embedding_row_params * self.weight_bits / 8
                + s.moe_layers * self.distinct_experts * self.expert_bytes + self.kv_bits / 8 * (
                    s.kv_elements_per_token * C + s.sliding_kv_elements_per_token * sympy.Min(C, s.window)))

    @property
    def flops(self) -> sympy.Expr:
        s = self.sizes
        routed_picks = sympy.Rational(s.top_k * s.experts, s.experts + s.zero_compute_experts)  # per token, expected
        active = s.dense_params + s.moe_layers * routed_picks * s.expert_params
        return 2 * B * active + 4 * B * C * s.attention_width

    @property
    def seconds(self) -> sympy.Expr:
        hw = self.hardware
        return (sympy.Max(self.bytes / (hw.hbm * hw.efficiency), self.flops / hw.flops) + hw.step_overhead
                + self.sizes.layers * hw.layer_overhead)

    @property
    def fetch_bytes(self) -> sympy.Expr:
        return self.sizes.moe_layers * self.distinct_experts * (1 - H) * self.expert_bytes

    def tokens_per_second(self, tau: float) -> sympy.Expr:
        return tau / (self.seconds + self.draft_seconds)

    def evaluate(self, block: int, context: int, hit_rate: float = 1.0, tau: float = 1.0) -> dict:
        values = {B: block, C: context, H: hit_rate}
        number = lambda expr: float(sympy.sympify(expr).subs(values))  # noqa: E731
        hw = self.hardware
        return {
            "block": block, "context": context, "distinct_experts_per_layer": number(self.distinct_experts),
            "bytes": number(self.bytes), "flops": number(self.flops),
            "t_memory_us": number(self.bytes) / hw.hbm * 1e6, "t_compute_us": number(self.flops) / hw.flops * 1e6,
            "t_step_us": number(self.seconds) * 1e6, "hit_rate": hit_rate, "fetch_bytes": number(self.fetch_bytes),
            "t_fetch_us": number(self.fetch_bytes) / hw.pcie * 1e6, "tau": tau,
            "tokens_per_s": number(self.tokens_per_second(tau)),
        }


CSV_COLUMNS = ("model", "hardware", "block", "context", "distinct_experts_per_layer", "bytes", "flops", "t_memory_us",
               "t_compute_us", "t_step_us", "hit_rate", "fetch_bytes", "t_fetch_us", "tau", "tokens_per_s")


def write_csv(rows: list[dict], path: str | Path) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return Path(path)


def fit_step_overheads(hardware: Hardware, measured: dict | None = None) -> Hardware:
    """`hardware` with the step and layer overheads and the streaming efficiency that fit measured step times best
    (least squares of  t = step overhead + layers * layer overhead + floor bytes / HBM / efficiency). `measured`:
    {(reference model name, decoder layers, tokens per step, context): seconds}, by default MEASURED_STEPS; it needs
    models of at least two layer counts to tell the step overhead from the layers'."""
    measured = measured or MEASURED_STEPS
    if len({layers for _, layers, _, _ in measured}) < 2:
        raise ValueError("fit_step_overheads needs steps of models with at least two layer counts (e.g. a model and a "
                         "cut of it) to tell the per-step overhead from the per-layer one")
    floors = {(model, layers): StepCost(ModelSizes.of(reference_config(model, layers)), hardware.roofline())
              for model, layers, _, _ in measured}  # each model built (on meta) once
    rows, times = [], []
    for (model, layers, tokens, context), seconds in measured.items():
        rows.append([1.0, layers, floors[model, layers].evaluate(tokens, context)["t_memory_us"] * 1e-6])
        times.append([seconds])
    step, layer, inverse_efficiency = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                                                         torch.tensor(times, dtype=torch.float64)).solution.flatten()
    return replace(hardware, step_overhead=float(step), layer_overhead=float(layer),
                   efficiency=float(1 / inverse_efficiency))


def calibrate(device: str | None = None, size_mib: int = 256, repeats: int = 5) -> Hardware:
    """Measure this machine: device copy bandwidth, pinned host-to-device bandwidth (CUDA), matmul FLOP/s."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    source = torch.empty(size_mib << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    hbm = 2 * source.numel() / best(lambda: target.copy_(source))
    pcie = hbm  # without a GPU, "host to device" copies are host memory copies
    if cuda:
        host = torch.empty(size_mib << 20, dtype=torch.uint8, pin_memory=True)
        pcie = host.numel() / best(lambda: source.copy_(host, non_blocking=True))
    n = 4096 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n**3 / best(lambda: a @ b)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return Hardware(name, hbm=hbm, pcie=pcie, flops=flops, step_overhead=0.0)
