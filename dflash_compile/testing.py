"""Tiny random models of every supported family, saved and loaded back through `from_pretrained`.

No checkpoint can be downloaded here, so tests, the CLI's built-in default and CPU benchmarks build models from the
transformers config classes. Each keeps the structure that matters: a dense first layer for glm4_moe, deepseek_v2,
deepseek_v3, dots1, ernie4_5_moe, exaone_moe, glm4_moe_lite, hy_v3, laguna and mimo_v2_flash (the last six declared in
`mlp_layer_types`), latent attention for deepseek_v2, deepseek_v3 and glm4_moe_lite, an `mlp_only_layers` dense layer
for qwen3_moe, GatedDeltaNet linear-attention layers for qwen3_5_moe and qwen3_next, alternating sliding/full layers
with attention sinks for gpt_oss, sliding layers with sinks and narrower values for mimo_v2_flash, sliding layers
before a full one for exaone_moe and laguna, a wider full layer whose keys are its values for gemma4_text, q/k/v
biases for qwen2_moe, Granite's multipliers, shared experts where the family has them. The families added later
(mellum, kolibri1, beam, flint, granitemoe_swa, minicpm5_moe, axk1, lara_mini, mistral4, aria, kimi_linear,
lfm2_moe, llama4_text, granitemoehybrid, jamba, dbrx, jetmoe, ergo, longcat_flash, the DSA families) keep theirs
likewise; each entry's comment says what.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers

from .drafter import drafter_config, save_drafter  # noqa: F401  (save_drafter: the tests' writer too)
from .families import FAMILIES, auto_model_class, decoder_layers, experts_modules

_COMMON = dict(
    vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    tie_word_embeddings=False,
)
_ROUTED = dict(num_experts_per_tok=2)  # top-k
_DEEPSEEK_ROUTING = dict(n_routed_experts=8, n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                         routed_scaling_factor=2.5, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1)
# the same where the config declares its dense layers itself (`mlp_layer_types`), or has none
_DECLARED_DEEPSEEK_ROUTING = {key: value for key, value in _DEEPSEEK_ROUTING.items() if key != "first_k_dense_replace"}
# Qwen3.5-MoE and Qwen3-Next: a GatedDeltaNet linear-attention layer, then a full-attention one, a shared expert
_GATED_DELTA_NET = dict(num_hidden_layers=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                        num_experts=8, head_dim=16, layer_types=["linear_attention", "full_attention"],
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4)
# DeepSeek-V3 and GLM-4.7-Flash: multi-head latent attention, as many key/value heads as heads
_MLA = dict(num_hidden_layers=3, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, **{**_COMMON, "num_key_value_heads": 4})
_DSA = dict(index_topk=6, index_n_heads=16, index_head_dim=16)
# Kimi Linear's layers (KDA twice, then latent attention; a dense first MLP) and routing, which Ling 3 shares
_KIMI_LINEAR_LAYERS = dict(layer_types=["linear_attention", "linear_attention", "full_attention"],
                           mlp_layer_types=["dense", "sparse", "sparse"], num_local_experts=8, bos_token_id=1,
                           eos_token_id=2, pad_token_id=0, **_MLA, **_ROUTED, **_DECLARED_DEEPSEEK_ROUTING)

TINY_CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        num_hidden_layers=2, intermediate_size=48, num_local_experts=4, **_ROUTED, **_COMMON),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=8, head_dim=16,
        mlp_only_layers=[0], norm_topk_prob=True, **_ROUTED, **_COMMON),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(  # q/k/v biases, a sigmoid-gated shared expert
        num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=8, decoder_sparse_step=1, mlp_only_layers=[], **_ROUTED, **_COMMON),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**_GATED_DELTA_NET, **_ROUTED, **_COMMON),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        decoder_sparse_step=1, mlp_only_layers=[], **_GATED_DELTA_NET, **_ROUTED, **_COMMON),
    "gpt_oss": lambda: transformers.GptOssConfig(
        num_hidden_layers=2, intermediate_size=48, num_local_experts=4, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], **_ROUTED, **_COMMON),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        num_hidden_layers=3, head_dim=16, **_DEEPSEEK_ROUTING, **_ROUTED, **_COMMON),
    "dots1": lambda: transformers.Dots1Config(  # q/k norms; one expert group and no sliding window, as released
        num_hidden_layers=3, head_dim=16, initializer_range=0.1, **_ROUTED, **_COMMON,
        **{**_DEEPSEEK_ROUTING, "n_group": 1, "topk_group": 1}),  # router scores wider than the correction bias
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**_MLA, **_DEEPSEEK_ROUTING, **_ROUTED),
    # DeepSeek-V3.2 and GLM-MoE-DSA: each query attends over the 6 keys its layer's indexer scores best (prompts are
    # longer), 16 indexer heads (4 would score many keys exactly 0 alike, ties the top-k may break either way)
    "deepseek_v32": lambda: transformers.DeepseekV32Config(**_MLA, **_DSA, **_DEEPSEEK_ROUTING, **_ROUTED),
    # dots.llm3: two DSA layers (the first MLP dense), then two sliding latent-attention layers of their own ranks
    # and heads (`swa_*`: wider latents, fewer heads) over an 8-token window
    "dots3_note": lambda: transformers.Dots3NoteTextConfig(
        head_dim=16, shared_experts_intermediate_size=32, sliding_window=8, swa_num_attention_heads=2,
        swa_num_key_value_heads=2, swa_q_lora_rank=32, swa_kv_lora_rank=24, swa_head_dim=16, swa_qk_nope_head_dim=8,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
        **{**_MLA, "num_hidden_layers": 4}, **_DSA, **_DEEPSEEK_ROUTING, **_ROUTED),
    "glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(  # its second layer reuses the first's choice of keys
        index_topk_pattern="FSF", initializer_range=0.1, **_MLA, **_DSA, **_DEEPSEEK_ROUTING, **_ROUTED),
    # DeepSeek-V4: an HCA layer (entries of 4 tokens), a CSA one (of 2, 2 picked a query), a sliding one, a CSA one,
    # all in a 6-token window; the first routed by token id; hyper-connection streams. 16 index heads: an entry's
    # score ties another's (at 0) only where every head's ReLU is 0, and top-k would break such ties by shape
    "deepseek_v4": lambda: transformers.DeepseekV4Config(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, head_dim=32, q_lora_rank=32,
        partial_rotary_factor=0.25, o_groups=2, o_lora_rank=16, sliding_window=6, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, layer_types=["heavily_compressed_attention",
        "compressed_sparse_attention", "sliding_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], index_n_heads=16, index_head_dim=16, index_topk=2,
        hc_mult=2, hc_sinkhorn_iters=3, swiglu_limit=0.5, vocab_size=128, max_position_embeddings=256,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "hy_v4": lambda: transformers.HYV4Config(
        mlp_layer_types=["dense", "sparse", "sparse"], layer_types=["indexed_attention"] * 3,
        indexer_types=["full", "shared", "full"], hc_mult=2, swiglu_limit=0.5, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **_MLA, **_DSA, **_DECLARED_DEEPSEEK_ROUTING, **_ROUTED),
    # MiniMax: a lightning-attention layer, a full-attention one, another lightning one; 8-token blocks (prompts
    # span two)
    "minimax": lambda: transformers.MiniMaxConfig(
        num_hidden_layers=3, intermediate_size=48, num_local_experts=4, head_dim=16, block_size=8,
        layer_types=["linear_attention", "full_attention", "linear_attention"], **_ROUTED, **_COMMON),
    # ZAYA1: a full CCA layer, a sliding one, another full one; 4 experts and the skip expert, top-1 (its only one);
    # weights of std 1 (at 0.1 the residual scalings' biases, random in tiny models, decide every token alike)
    "zaya": lambda: transformers.ZayaConfig(
        num_hidden_layers=3, layer_types=["hybrid", "hybrid_sliding", "hybrid"], sliding_window=8, head_dim=16,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1, router_hidden_size=16, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, initializer_range=1.0, **_COMMON),
    # MiniMax-M3 (its text model): a dense full-attention layer, then two sparse layers whose indexer picks 2 blocks
    # of 4 keys a query, the query's own block among them; experts with gpt-oss's clamped SwiGLU, not interleaved
    "minimax_m3_vl": lambda: transformers.MiniMaxM3VLTextConfig(
        num_hidden_layers=3, head_dim=16, rotary_dim=8, intermediate_size=32, num_local_experts=8,
        dense_intermediate_size=96, shared_intermediate_size=48, mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"], index_n_heads=2,
        index_head_dim=16, index_block_size=4, index_topk_blocks=2, index_local_blocks=1, swiglu_limit=0.5,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0, **_ROUTED, **_COMMON),
    # Inkling: two sliding layers (heads of their own, an 8-token window), then a full one; relative logits over 16
    # distances, log-scaled queries past position 4; a dense first layer, then 8 routed experts and a shared one
    "inkling": lambda: transformers.InklingTextConfig(
        num_hidden_layers=3, layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid"], head_dim=16,
        mlp_layer_types=["dense", "sparse", "sparse"], swa_num_attention_heads=2, swa_num_key_value_heads=1,
        swa_head_dim=16, sliding_window_size=8, d_rel=4, rel_extent=16, log_scaling_n_floor=2, log_scaling_alpha=1.0,
        intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, conv_kernel_size=4, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, initializer_range=0.1, **_ROUTED, **_COMMON),
    # Inkling 2: Inkling's tiny shape, every layer routed; a residual block every 2 layers, softcaps that bound
    "inkling2": lambda: transformers.Inkling2TextConfig(
        num_hidden_layers=3, layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid"], head_dim=16,
        swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=16, sliding_window_size=8, d_rel=4,
        rel_extent=16, log_scaling_n_floor=2, log_scaling_alpha=1.0, moe_intermediate_size=32, n_routed_experts=8,
        conv_kernel_size=4, n_layers_per_attn_res_block=2, mlp_gate_softcap=1.0, mlp_up_softcap=1.0,
        final_logit_softcapping=30.0, unpadded_vocab_size=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.1, **_ROUTED, **_COMMON),
    # Inkling 2 with looped layers: its tiny config's layers plus a sliding one, the last two looped twice
    "inkling2_loop": lambda: transformers.Inkling2LoopTextConfig(**settings_of("inkling2") | dict(
        num_hidden_layers=4, layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid_sliding"],
        loop_layer_index_start=2, loop_layer_index_end=4, loop_num_passes=2, loop_gate_rank=8)),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(  # DeepSeek-V2's group-limited softmax router
        topk_method="group_limited_greedy", **_MLA, **_DEEPSEEK_ROUTING, **_ROUTED),
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(  # GLM-4.7-Flash: one group, MLPs declared per layer
        mlp_layer_types=["dense", "sparse", "sparse"], **_MLA, **_ROUTED,
        **{**_DEEPSEEK_ROUTING, "n_group": 1, "topk_group": 1, "first_k_dense_replace": None}),
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(  # a dense first layer, a shared expert
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, moe_num_experts=8,
        moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=2, moe_layer_interval=1,
        initializer_range=0.1, **_ROUTED, **_COMMON),  # routing probabilities that differ by more than the bias
    "granitemoe": lambda: transformers.GraniteMoeConfig(  # embedding, residual, attention and logit multipliers
        num_hidden_layers=2, intermediate_size=48, num_local_experts=4, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0, **_ROUTED, **_COMMON),
    "granitemoeshared": lambda: transformers.GraniteMoeSharedConfig(  # and a shared MLP
        num_hidden_layers=2, intermediate_size=48, shared_intermediate_size=64, num_local_experts=4, **_ROUTED,
        **_COMMON),
    "cohere2_moe": lambda: transformers.Cohere2MoeConfig(  # a dense first layer, a shared expert averaged in
        num_hidden_layers=3, head_dim=16, sliding_window=8, intermediate_size=32, prefix_dense_intermediate_size=96,
        num_experts=8, num_shared_experts=1, mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2,
        pad_token_id=0, **_ROUTED, **_COMMON),
    "minimax_m2": lambda: transformers.MiniMaxM2Config(  # q/k norms over all heads, the bias on the MoE block
        num_hidden_layers=2, head_dim=16, intermediate_size=32, num_local_experts=8, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, **_ROUTED, **_COMMON),
    "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1Config(  # q/k norms after the rotary embedding
        num_hidden_layers=2, head_dim=16, intermediate_size=32, num_experts=8, **_ROUTED, **_COMMON),
    "hy_v3": lambda: transformers.HYV3Config(  # a dense first layer, a shared expert
        num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_shared_experts=1, mlp_layer_types=["dense", "sparse", "sparse"], initializer_range=0.1, **_ROUTED,
        **_COMMON),
    "laguna": lambda: transformers.LagunaConfig(  # a dense first layer; sliding, then full attention
        num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        shared_expert_intermediate_size=48, sliding_window=8, mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], initializer_range=0.05, **_ROUTED,
        **_COMMON),
    "mimo_v2_flash": lambda: transformers.MiMoV2FlashConfig(  # sliding layers with sinks, values of 8 for keys of 16
        num_hidden_layers=3, head_dim=16, v_head_dim=8, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, n_group=2, topk_group=1, sliding_window=8, mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], initializer_range=0.1, **_ROUTED,
        **_COMMON),
    "afmoe": lambda: transformers.AfmoeConfig(  # a dense first layer; sliding layers, then a full one
        num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_shared_experts=1, num_dense_layers=1, sliding_window=8, global_attn_every_n_layers=3,
        initializer_range=0.05, **_ROUTED, **_COMMON),
    "gemma4_text": lambda: transformers.Gemma4TextConfig(  # GELU-gated experts beside each MLP; sliding layers, then a
        # full one with wider heads, one key/value head and its keys as values (the 26B-A4B's attention)
        num_hidden_layers=3, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, top_k_experts=2, enable_moe_block=True,
        sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0, final_logit_softcapping=30.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **_COMMON),
    "mellum": lambda: transformers.MellumConfig(  # q/k norms; a dense first layer; sliding layers, then a full one
        num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        sliding_window=8, mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], **_ROUTED, **_COMMON),
    "kolibri1": lambda: transformers.Kolibri1Config(  # sliding layers, then a full one without rotary positions
        num_hidden_layers=3, head_dim=16, moe_intermediate_size=32, num_experts=8, shared_expert_intermediate_size=48,
        sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"], **_ROUTED,
        **_COMMON),
    # Kolibri 1.1: a dense first layer; sliding, indexed (its indexer picks; the last layer reads its keys, values
    # and pool), sliding and indexed layers; 6 keys a query (topk 3, a sink, 2 local) from a pool of 2 blocks of 4
    "kolibri1_1": lambda: transformers.Kolibri1_1Config(
        num_hidden_layers=4, head_dim=16, moe_intermediate_size=32, num_experts=8, shared_expert_intermediate_size=48,
        mlp_only_layers=[0], mlp_only_intermediate_size=96, sliding_window=8,
        layer_types=["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention"],
        index_layers=[1], kv_source_layers=[0, 1, 2, 1], index_topk=3, index_pool_size=8, index_compression=4,
        index_num_heads=2, index_num_local_tokens=2, index_num_sink_tokens=1, **_ROUTED, **_COMMON),
    "beam": lambda: transformers.BeamConfig(  # a dense first layer; sliding layers, then a full one without rotary
        num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, n_group=2,
        topk_group=1, sliding_window=8, mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], initializer_range=0.1, **_ROUTED,
        **_COMMON),
    "flint": lambda: transformers.FlintConfig(  # an `mlp_only_layers` dense layer; sliding layers, then a full one
        num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        shared_expert_intermediate_size=48, mlp_only_layers=[0], sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], initializer_range=0.1, **_ROUTED,
        **_COMMON),
    "granitemoe_swa": lambda: transformers.GraniteMoeSWAConfig(  # a full layer, then sliding ones; multipliers
        num_hidden_layers=3, intermediate_size=48, shared_intermediate_size=64, num_local_experts=4, sliding_window=8,
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0, **_ROUTED,
        **_COMMON),
    "minicpm5_moe": lambda: transformers.MiniCPM5MoeConfig(  # a dense first layer, a shared expert
        num_hidden_layers=3, head_dim=16, num_local_experts=8, mlp_layer_types=["dense", "sparse", "sparse"],
        initializer_range=0.05, **_ROUTED, **_COMMON,
        **{key: value for key, value in _DEEPSEEK_ROUTING.items()
           if key not in ("first_k_dense_replace", "n_routed_experts")}),
    "axk1": lambda: transformers.AXK1Config(  # DeepSeek-V3's latent attention, MLPs declared
        mlp_layer_types=["dense", "sparse", "sparse"], bos_token_id=1, eos_token_id=2, **_MLA, **_ROUTED,
        **_DECLARED_DEEPSEEK_ROUTING),
    "axk2": lambda: transformers.AXK2Config(  # A.X K1's with DSA layers (DeepSeek-V3.2's) and a gated output
        mlp_layer_types=["dense", "sparse", "sparse"], bos_token_id=1, eos_token_id=2, initializer_range=0.1, **_MLA,
        **_DSA, **_ROUTED, **_DECLARED_DEEPSEEK_ROUTING),
    "lara_mini": lambda: transformers.LaraMiniConfig(  # GatedDeltaNet, sliding and full layers, a shared expert
        sliding_window=8, **{**_GATED_DELTA_NET, "num_hidden_layers": 3,
                             "layer_types": ["linear_attention", "sliding_attention", "full_attention"]},
        **_ROUTED, **_COMMON),
    "mistral4": lambda: transformers.Mistral4Config(  # latent attention, queries scaled by position; a dense layer
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **_MLA, **_DEEPSEEK_ROUTING, **_ROUTED),
    "aria": lambda: transformers.AriaTextConfig(  # experts stored [E, in, out], shared experts
        num_hidden_layers=2, intermediate_size=32, moe_num_experts=8, moe_topk=2, moe_num_shared_experts=1,
        **_COMMON),
    "kimi_linear": lambda: transformers.KimiLinearConfig(  # KDA linear attention, then latent attention; a dense
        # first layer, a shared expert
        linear_head_dim=16, linear_num_heads=4, **_KIMI_LINEAR_LAYERS),
    "bailing_hybrid": lambda: transformers.BailingHybridConfig(  # Kimi Linear's layers, gated; KDA's heads are
        # the attention's (its head_dim, before the config sets head_dim to the rotary part); layer 1's experts
        # clamped at 0.5 (transformers 5.25; 5.24 has no clamps)
        head_dim=16, swiglu_limits=[0, 0.5, 0], **_KIMI_LINEAR_LAYERS),
    "lfm2_moe": lambda: transformers.Lfm2MoeConfig(  # a dense first layer; short convolutions, then attention
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_dense_layers=1,
        layer_types=["conv", "conv", "full_attention"], initializer_range=0.1, **_ROUTED, **_COMMON),
    "llama4_text": lambda: transformers.Llama4TextConfig(  # dense layers between MoE ones; chunked attention with
        # rotary positions and L2-normed q/k, then a full layer without rotary (position-scaled queries past 8191)
        num_hidden_layers=4, head_dim=16, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=8,
        interleave_moe_layer_step=2, attention_chunk_size=256, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **_ROUTED, **_COMMON),
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(  # Mamba2 layers (two groups, 16-token chunks),
        # then attention without rotary positions; a shared MLP beside the experts
        num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"],
        intermediate_size=32, shared_intermediate_size=48, num_local_experts=8, mamba_n_heads=8, mamba_d_head=16,
        mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=16, **_ROUTED, **_COMMON),
    "nemotron_h": lambda: transformers.NemotronHConfig(  # one mixer a layer: Mamba2 (two groups, 16-token chunks),
        # MoE (experts without a gate, a shared MLP), attention, MoE
        layers_block_type=["linear_attention", "moe", "full_attention", "moe"], head_dim=16, mamba_num_heads=8,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16, n_routed_experts=8, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, intermediate_size=96, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, initializer_range=0.1, **_ROUTED, **_COMMON),
    "jamba": lambda: transformers.JambaConfig(  # Mamba layers and an attention one; experts in the first and third
        # layers, MLPs in the others
        num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=0,
        intermediate_size=32, num_experts=8, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        **_ROUTED, **_COMMON),
    "phimoe": lambda: transformers.PhimoeConfig(  # LayerNorms, q/k/v biases
        num_hidden_layers=2, intermediate_size=48, num_local_experts=4, **_ROUTED, **_COMMON),
    "flex_olmo": lambda: transformers.FlexOlmoConfig(  # post-attention and post-MLP norms
        num_hidden_layers=2, intermediate_size=32, num_experts=8, pad_token_id=0, eos_token_id=1, **_ROUTED,
        **_COMMON),
    "solar_open": lambda: transformers.SolarOpenConfig(  # every layer routed
        num_hidden_layers=2, head_dim=16, initializer_range=0.1, **_ROUTED, **_COMMON,
        **_DECLARED_DEEPSEEK_ROUTING),
    "exaone_moe": lambda: transformers.ExaoneMoeConfig(  # a dense first layer; sliding, then full without rotary
        num_hidden_layers=3, head_dim=16, sliding_window=8, mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_experts=8,
        num_shared_experts=1, initializer_range=0.1, **_ROUTED, **_COMMON,
        **{key: value for key, value in _DEEPSEEK_ROUTING.items()
           if key not in ("first_k_dense_replace", "n_routed_experts", "n_shared_experts")}),
    "dbrx": lambda: transformers.DbrxConfig(  # experts flattened in 2-D, routing weights divided by their 1-norm,
        # q/k/v clipped at 0.5 (most values of the random weights)
        d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=128, tie_word_embeddings=False,
        attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=10000.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2, moe_normalize_expert_weights=1.0)),
    "ergo": lambda: transformers.ErgoConfig(  # a dense first layer (relu^2); sliding, full, sliding layers; experts
        # without a gate, their routes normed per expert; a normed shared expert
        num_hidden_layers=3, first_dense_intermediate_size=96, moe_intermediate_size=32, shared_intermediate_size=48,
        num_experts=8, sliding_window=8, global_attention_every_n_layers=2, rms_norm_eps=1e-6,
        initializer_range=0.1, **_ROUTED, **_COMMON),
    "jetmoe": lambda: transformers.JetMoeConfig(  # MLP experts and attention experts (query heads) routed alike
        num_hidden_layers=2, num_key_value_heads=2, kv_channels=16, intermediate_size=32, num_local_experts=4,
        **_ROUTED, **{key: value for key, value in _COMMON.items() if "heads" not in key}),
    "longcat_flash": lambda: transformers.LongcatFlashConfig(  # two latent-attention sublayers and two MLPs a
        # decoder layer, routed experts picked with 4 zero-compute ones, a correction bias for the choice
        num_layers=2, head_dim=8, ffn_hidden_size=96, expert_ffn_hidden_size=32, n_routed_experts=8,
        zero_expert_num=4, moe_topk=3, routed_scaling_factor=2.5, initializer_range=0.1,
        **{key: value for key, value in _MLA.items() if key != "num_hidden_layers"}),
    "olmoe": lambda: transformers.OlmoeConfig(
        num_hidden_layers=2, intermediate_size=32, num_experts=8, **_ROUTED, **_COMMON),
}


def in_installed_transformers(family: str) -> bool:
    """Whether the installed transformers has the family's model (MiniCPM5-MoE came in 5.25; 5.24 is supported) in
    a version dflash-compile supports (Jamba's from 5.25). Its own model type decides, not the releases on its classes
    the registry also names (Param-2's `param2moe`, on GLM-4.5's, came in 5.25)."""
    spec = FAMILIES[family]
    return spec.installed() and spec.model_types[0] in transformers.CONFIG_MAPPING


def settings_of(family: str) -> dict:
    """`family`'s tiny config as settings for another config class (a release on its kind of model)."""
    return {key: value for key, value in tiny_config(family).to_dict().items()
            if key not in ("model_type", "transformers_version", "architectures")}


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    if family not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for {family!r}; choose one of {sorted(TINY_CONFIGS)}")
    if not in_installed_transformers(family):
        raise ValueError(f"transformers {transformers.__version__} has no {family!r} model: "
                         "pip install -U transformers")
    config = TINY_CONFIGS[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _vision_tower(hidden_size: int, **settings) -> dict:
    """A one-block vision tower of Qwen-VL's and GLM-4.5V's kind, projecting into the text decoder's width."""
    return dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=hidden_size, **settings)


def _pixtral_tower(hidden_size: int) -> dict:
    """Pixtral's vision tower (Mistral Small 4's and Mistral Large 4's), one block."""
    return dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                image_size=64, patch_size=8)


def _sam_and_encoder(hidden_size: int) -> dict:
    """DeepSeek-OCR 2's vision model: SAM's ViT (one block, its neck down to 32 channels) and a one-layer encoder
    over its patches and learned queries, projected into the text decoder's width by the model."""
    return dict(sam_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                                patch_size=16, window_size=2, global_attn_indexes=[0], output_channels=16,
                                downsample_channels=[16, 32]),
                encoder_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2))


def _omni_thinker(hidden_size: int) -> dict:
    """Qwen3-Omni's thinker beside its vision tower: a one-layer audio tower projecting into the decoder's width, and
    the token ids of its images, video and audio (its config class sets no `vision_start_token_id`, which the
    released config does and text prompts' positions read)."""
    return dict(audio_config=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                                  d_model=32, output_dim=hidden_size, n_window=4, n_window_infer=8,
                                  downsample_hidden_size=8),
                vision_start_token_id=120, image_token_id=121, video_token_id=122, audio_token_id=123,
                audio_start_token_id=124)


def _muse_spark_towers(hidden_size: int) -> dict:
    """Muse Spark's audio tower (one stage, projecting into the decoder's width), its vision adapter's widths and the
    token ids of its images, video and audio."""
    return dict(audio_config=dict(patch_sizes=(4,), hidden_sizes=(16,), depths=(1,), num_hidden_layers=1,
                                  out_hidden_size=hidden_size),
                out_hidden_size=hidden_size, projector_hidden_size=32, image_token_id=121, video_token_id=122,
                audio_token_id=123)


# Families released as image-text-to-text models (the decoder under `model.language_model`, a vision tower beside
# it): the multimodal config class, the tiny text config, the vision tower's settings (a function of the decoder's
# width), and where the config has more, a function of the width giving those settings. Qwen3-VL-MoE's text config
# has no causal LM class, so it is not in TINY_CONFIGS.
MULTIMODAL = {
    "qwen3_5_moe": (transformers.Qwen3_5MoeConfig, lambda: tiny_config("qwen3_5_moe"), _vision_tower),
    "qwen3_vl_moe": (transformers.Qwen3VLMoeConfig, lambda: transformers.Qwen3VLMoeTextConfig(
        num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32, num_experts=8, head_dim=16,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True),
        **_ROUTED, **_COMMON), lambda hidden_size: _vision_tower(hidden_size, deepstack_visual_indexes=[0])),
    "glm4v_moe": (transformers.Glm4vMoeConfig, lambda: transformers.Glm4vMoeTextConfig(
        num_hidden_layers=3, head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                               partial_rotary_factor=0.5, mrope_section=[1, 1, 2]),
        **_DEEPSEEK_ROUTING, **_ROUTED, **_COMMON), _vision_tower),
    "gemma4": (transformers.Gemma4Config, lambda: tiny_config("gemma4_text"), lambda hidden_size: dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
        intermediate_size=32)),
    "mistral3": (transformers.Mistral3Config, lambda: tiny_config("mistral4"), _pixtral_tower),
    # DSA without a query LoRA: layers 1 and 3 read layers 0 and 2's latents (2 and 3 without rotary positions),
    # layer 1 reuses layer 0's choice of keys, layer 3 picks its own over layer 2's latents
    "mistral_large4": (transformers.MistralLarge4Config, lambda: transformers.MistralLarge4TextConfig(
        kv_source_layers=[0, 0, 2, 2], no_rope_layers=[1, 1, 0, 0], index_topk_pattern="FSFF",
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0, **_DSA, **_DEEPSEEK_ROUTING,
        **_ROUTED, **{key: value for key, value in _MLA.items() if key != "q_lora_rank"} | {"num_hidden_layers": 4}),
        _pixtral_tower),
    # Qwen3-Omni's thinker (an audio tower too): Qwen3-VL-MoE's decoder
    "qwen3_omni_moe": (transformers.Qwen3OmniMoeThinkerConfig, lambda: transformers.Qwen3OmniMoeTextConfig(
        num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32, num_experts=8, head_dim=16,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True),
        **_ROUTED, **_COMMON), lambda hidden_size: _vision_tower(hidden_size, deepstack_visual_indexes=[0]),
        _omni_thinker),
    # HY V4's release (Hy4): HY V4's tiny decoder under rotary positions in three sections
    "hy_v4_vl": (transformers.HYV4VLConfig, lambda: transformers.HYV4VLTextConfig(
        **tiny_config("hy_v4").to_dict() | dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                      mrope_section=[2, 1, 1]))),
        lambda hidden_size: dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 out_hidden_size=hidden_size, patch_size=8, max_image_size=64),
        lambda hidden_size: dict(image_token_id=121, video_token_id=122)),
    # Inkling's release: its tiny decoder beside a one-block vision tower and a mel-token audio embedding
    "inkling": (transformers.InklingConfig, lambda: tiny_config("inkling"),
                lambda hidden_size: dict(text_hidden_size=hidden_size, patch_size=4, hidden_size=32,
                                         num_hidden_layers=4, num_attention_heads=2),  # a layer a scale: no scipy
                lambda hidden_size: dict(audio_config=dict(text_hidden_size=hidden_size, n_mel_bins=8,
                                                           mel_vocab_size=16),
                                         image_token_id=121, audio_token_id=122, image_bos_token_id=123,
                                         audio_bos_token_id=124)),
    # Inkling 2's release: its tiny decoder beside a one-block vision tower (its looped kind's release wraps its
    # decoder alike)
    "inkling2": (transformers.Inkling2Config, lambda: tiny_config("inkling2"),
                 lambda hidden_size: dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                                          text_hidden_size=hidden_size, projection_hidden_dim=32, posemb_grid_size=4),
                 lambda hidden_size: dict(image_token_id=121)),
    # MiniMax-M3's release: its tiny decoder beside a one-block vision tower
    "minimax_m3_vl": (transformers.MiniMaxM3VLConfig, lambda: tiny_config("minimax_m3_vl"),
                      lambda hidden_size: dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=56, patch_size=14),
                      lambda hidden_size: dict(image_token_index=121, video_token_index=122,
                                               projector_hidden_size=hidden_size)),
    # Muse Spark (audio and vision towers): a dense first layer, two sliding layers then a full one without rotary
    # positions; experts of their own width
    "muse_spark": (transformers.MuseSparkConfig, lambda: transformers.MuseSparkTextConfig(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, moe_hidden_size=48, num_local_experts=8,
        head_dim=16, sliding_window=8, mlp_layer_types=["dense", "sparse", "sparse"], initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **_ROUTED, **_COMMON),
        lambda hidden_size: dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 patch_size=8, pos_emb_height=4, pos_emb_width=4, max_position_embeddings=16),
        _muse_spark_towers),
    # DeepSeek-OCR 2: a dense first layer, then DeepSeek-V2's router inside groups with a shared expert
    "deepseek_ocr2": (transformers.DeepseekOcr2Config, lambda: transformers.DeepseekOcr2TextConfig(
        num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"], topk_method="group_limited_greedy",
        **_DECLARED_DEEPSEEK_ROUTING, **_ROUTED, **_COMMON), _sam_and_encoder),
    # Unlimited OCR: DeepSeek-OCR 2's kind of decoder whose layers see the prompt whole and the last 4 generated tokens
    "unlimited_ocr": (transformers.UnlimitedOcrConfig, lambda: transformers.UnlimitedOcrTextConfig(
        num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"], topk_method="group_limited_greedy",
        sliding_window=4, bos_token_id=1, eos_token_id=2, pad_token_id=0, **_DECLARED_DEEPSEEK_ROUTING, **_ROUTED,
        **_COMMON), lambda hidden_size: _sam_and_encoder(hidden_size) | dict(encoder_config=dict(
            hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
            patch_size=16)), lambda hidden_size: dict(image_token_id=121)),
    # GLM-5-Next: a KDA layer, two DSA layers without rotary positions (the second reusing the first's pick), another
    # KDA layer; each indexer picks 2 pools of 4 keys a query and the tail of its newest keys not yet pooled; 4
    # hyper-connection streams; experts and MLPs clamped at 0.5; a dense first MLP
    "glm5_next": (transformers.Glm5NextConfig, lambda: transformers.Glm5NextTextConfig(
        layer_types=["linear_attention", "full_attention", "full_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        index_kpool=4, linear_head_dim=16, linear_num_heads=4, hc_mult=4, hc_sinkhorn_iters=3,
        swiglu_limit=0.5, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **{**_MLA, "num_hidden_layers": 4, "qk_rope_head_dim": 0, "qk_nope_head_dim": 16}, **{**_DSA, "index_topk": 8},
        **_DECLARED_DEEPSEEK_ROUTING, **_ROUTED),
        lambda hidden_size: _vision_tower(hidden_size, projection_intermediate_size=32)),
    # Qwen4-Exp: GatedDeltaNet layers with n-gram embeddings and a dilated convolution beside them, an indexed layer
    # between them whose indexer picks 2 blocks of 4 keys a query and the tail (16 index heads: 2 tie at 0 too often),
    # 4 hyper-connection streams flattened into one vector a token; rotary positions in three sections
    "qwen4_exp": (transformers.Qwen4ExpConfig, lambda: transformers.Qwen4ExpTextConfig(
        num_hidden_layers=3, layer_types=["linear_attention", "indexed_attention", "linear_attention"],
        head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
        indexer_budget=8, indexer_compress_ratio=4, indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=16,
        ngram_vocab_size_base=256, split_ngram_parts=4, hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=32,
        heads_per_ngram=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True),
        **_ROUTED, **_COMMON), lambda hidden_size: _vision_tower(hidden_size)),
    # Kimi K2.5: DeepSeek-V3's tiny decoder beside a one-block vision tower
    "kimi_k25": (transformers.Kimi_K25Config, lambda: tiny_config("deepseek_v3"),
                 lambda hidden_size: dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, patch_size=8, pos_emb_height=4, pos_emb_width=4),
                 lambda hidden_size: dict(image_token_id=121, video_token_id=122, vision_start_token_id=123,
                                          vision_end_token_id=124, projection_hidden_size=32)),
    # Nemotron-H Omni: a whole Nemotron-H causal LM (`language_model`) beside a one-block RADIO vision tower (no audio)
    "nemotron_h_omni": (transformers.NemotronH_Omni_Reasoning_V3_Config, lambda: tiny_config("nemotron_h"),
                        lambda hidden_size: dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                 patch_size=8, image_size=32, max_img_size=64,
                                                 video_temporal_patch_size=2),
                        lambda hidden_size: dict(vision_hidden_size=32, projector_hidden_size=32, image_token_id=121)),
    "aria": (transformers.AriaConfig, lambda: tiny_config("aria"), lambda hidden_size: dict(  # Idefics3's
        hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=8)),
    "ernie4_5_vl_moe": (transformers.Ernie4_5_VLMoeConfig, lambda: transformers.Ernie4_5_VLMoeTextConfig(  # a dense
        # first layer; text and image experts in the others, shared experts
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=[32, 32], moe_num_experts=8,
        moe_layer_start_index=1, rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[3, 3, 2]),
        **_ROUTED, **_COMMON), lambda hidden_size: dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32)),
    "step3p7": (transformers.Step3p7Config, lambda: transformers.Step3p7TextConfig(  # a dense first layer, sliding
        # layers of fewer heads, then full; the experts clamped in layer 1 (at 0.5: most values), not in layer 2
        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], sliding_window=8, num_sliding_attention_heads=2, head_dim=16,
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, share_expert_dim=48,
        swiglu_limits=[0, 0.5, 0], swiglu_limits_shared=[0, 1.0, 0], moe_router_scaling_factor=2.0, pad_token_id=0,
        **_ROUTED, **_COMMON),
        lambda hidden_size: dict(width=32, layers=1, heads=2, image_size=28, patch_size=14)),
    "llama4": (transformers.Llama4Config, lambda: tiny_config("llama4_text"), lambda hidden_size: dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=8,
        vision_output_dim=32, projector_input_dim=32, projector_output_dim=hidden_size,
        intermediate_layers_indices=[0])),
}


def tiny_multimodal_config(family: str, **text_overrides) -> transformers.PretrainedConfig:
    """`family` as released (image-text-to-text): its tiny text config with a one-block vision tower beside it."""
    config_class, text_config, vision_tower, *more = MULTIMODAL[family]
    text = text_config()
    for key, value in text_overrides.items():
        setattr(text, key, value)
    settings = more[0](text.hidden_size) if more else {}
    return config_class(text_config=text.to_dict(), vision_config=vision_tower(text.hidden_size),
                        tie_word_embeddings=False, **settings)


def _randomize_zero_inits(model: torch.nn.Module, generator: torch.Generator) -> None:
    """transformers initialises biases, sinks and router corrections to zero; random ones exercise more math. Its
    token-to-experts tables too (`randomize_token_routes`)."""
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.is_floating_point() and tensor.numel() and not tensor.any():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
    randomize_token_routes(model, generator)


def randomize_token_routes(model: torch.nn.Module, generator: torch.Generator | None = None) -> None:
    """DeepSeek-V4's hash routers' token-to-experts tables (`tid2eid`), all expert 0 as transformers initialises them:
    distinct random experts for each token, as a checkpoint's."""
    for module in model.modules():
        if hasattr(module, "tid2eid"):
            tokens, top_k = module.tid2eid.shape
            scores = torch.rand(tokens, module.num_experts, generator=generator, device=module.tid2eid.device)
            module.tid2eid.copy_(scores.argsort(-1)[:, :top_k])


def save_tiny_model(family: str, directory: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a random tiny model of `family` to `directory` with `save_pretrained` (fp32 weights)."""
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = auto_model_class(config).from_config(config, dtype=torch.float32)
    _randomize_zero_inits(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(directory)
    return Path(directory)


def save_release(family: str, directory: str | Path, expert_dtype: str = "fp4", seed: int = 0, **overrides) -> Path:
    """A random tiny `family` model written as an FP8 release is, by the names `save_pretrained` stores
    (`save_tiny_model`, then requantized): the linear layers transformers' FP8 loading converts
    (`checkpoint._fp8_in_transformers`) float8_e4m3fn per 128 x 128 block, but the output head and the routers,
    listed in `modules_to_not_convert`; each routed expert's projections FP8 likewise (`expert_dtype` "fp8": fp32
    `weight_scale_inv`, DeepSeek-V3's and Mixtral FP8's style) or, as DeepSeek-V4's release, FP4 (`expert_dtype`
    "fp4": int8 pairs of e2m1 codes, low nibble first, a float8_e8m0fnu scale per 32 as `.scale`; the FP8 layers'
    scales powers of two, E8M0 bytes as `.scale`; config `expert_dtype` and `scale_fmt` "ue8m0")."""
    import json

    from safetensors.torch import load_file, save_file

    from .checkpoint import _fp8_in_transformers, _meta_model, _model_names, _unquantized_fp8_linears
    from .quant import quantize_fp8_block, quantize_mxfp4

    if expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"expert_dtype={expert_dtype!r}: a release's experts are 'fp4' (DeepSeek-V4's) or 'fp8'")
    fp4 = expert_dtype == "fp4"
    directory = save_tiny_model(family, directory, seed, **overrides)
    model = _meta_model(transformers.AutoConfig.from_pretrained(directory))
    model_name, modules, experts = _model_names(model), dict(model.named_modules()), experts_modules(model)
    kept = _unquantized_fp8_linears(model)

    def fp8(key, tensor):
        values, scales = quantize_fp8_block(tensor, power_of_two=fp4)
        stem = key.removesuffix(".weight")
        return {key: values, **({f"{stem}.scale": scales.to(torch.float8_e8m0fnu)} if fp4
                                else {f"{stem}.weight_scale_inv": scales})}

    (file,) = directory.glob("*.safetensors")
    tensors = {}
    for key, tensor in load_file(str(file)).items():
        path = model_name(key)[0].removesuffix(".weight")
        module = modules.get(path)
        if key.endswith(".weight") and path.rsplit(".", 2)[0] in experts:
            if fp4:
                codes, scales = quantize_mxfp4(tensor)
                tensors |= {key: codes.reshape(tensor.shape[0], -1).view(torch.int8),
                            key.removesuffix(".weight") + ".scale": scales.view(torch.float8_e8m0fnu)}
            else:
                tensors |= fp8(key, tensor)
        elif (key.endswith(".weight") and module is not None and _fp8_in_transformers(model, path, module)
              and path not in kept):
            tensors |= fp8(key, tensor)
        else:
            tensors[key] = tensor
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128], "modules_to_not_convert": kept}
    config["quantization_config"] = quantization | ({"scale_fmt": "ue8m0"} if fp4 else {})
    if fp4:
        config["expert_dtype"] = "fp4"
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def load_tiny_model(
    family: str, dtype: torch.dtype = torch.float32, directory: str | Path | None = None, **load_kwargs
) -> transformers.PreTrainedModel:
    """A tiny model of `family` loaded with `from_pretrained` (from `directory`, or written to a temp dir first)."""
    if directory is None:
        with tempfile.TemporaryDirectory() as tmp:
            return load_tiny_model(family, dtype, save_tiny_model(family, tmp), **load_kwargs)
    config = transformers.AutoConfig.from_pretrained(directory)
    model_class = auto_model_class(config)
    implementation = None
    if not model_class._model_mapping[type(config)]._can_set_experts_implementation():
        # Llama 4 takes none (transformers runs its experts densely); the experts `adapt_model` makes read the config's
        implementation = load_kwargs.pop("experts_implementation", None)
    model = model_class.from_pretrained(directory, dtype=dtype, **load_kwargs)
    if implementation:
        model.config._experts_implementation = implementation
    return model.eval()


def tiny_drafter_config(target_config, block_size: int = 4, layer_types=("full_attention",) * 2,
                        target_layer_ids=None, nested: bool = True, **extra) -> dict:
    """A z-lab-format drafter config.json for `target_config` (DFlash keys nested in `dflash_config` or not)."""
    target = target_config.get_text_config()
    ids = target_layer_ids if target_layer_ids is not None else [0, decoder_layers(target) - 1]
    extra = {"sliding_window": 8 if "sliding_attention" in layer_types else None} | extra
    return drafter_config(target_config, block_size=block_size, mask_token_id=target.vocab_size - 1,
                          target_layer_ids=ids, layer_types=layer_types, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, nested=nested, **extra)


def random_drafter_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in z-lab names for a drafter config (a drafter whose drafts the target mostly rejects)."""
    from .drafter import DFlashDrafter, DrafterConfig

    parsed = DrafterConfig.from_dict(config)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(parsed, len(parsed.target_layer_ids))
    with torch.no_grad():
        for name, tensor in drafter.named_parameters():
            if "norm" in name:
                tensor.uniform_(0.5, 1.5)
            else:
                tensor.normal_(0, 0.2)
    return drafter.state_dict()


class OracleDrafter:
    """Proposes the target's own greedy continuation (from a reference `generate` output), each proposed token
    replaced by a random one with probability `corruption`: acceptance from all-accepted (0) down to about none.

    `reference` is [batch, prompt + new] as `model.generate` returns it, `attention_mask` the prompt's mask.
    """

    def __init__(self, reference: torch.Tensor, attention_mask: torch.Tensor | None, block_size: int,
                 corruption: float = 0.0, vocab_size: int | None = None, seed: int = 0):
        from types import SimpleNamespace

        pad = (attention_mask == 0).sum(dim=1) if attention_mask is not None else torch.zeros(len(reference))
        self.rows = [reference[b, int(pad[b]):] for b in range(reference.shape[0])]  # real tokens per row
        self.config = SimpleNamespace(block_size=block_size)
        self.corruption, self.vocab_size = corruption, vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def new_cache(self, batch, max_len, dtype, device):
        from .cache import RowCache

        return RowCache(batch, max_len, dtype, device)  # only its lengths are used

    def add_context(self, cache, features, counts) -> None:
        cache.commit(counts)

    def propose(self, anchor, cache, embed, lm_head, sampler=None, draft_logits=None):
        """The reference's next tokens (deterministic given the prefix: judged by the one-hot rule); it has no
        forward, so `draft_logits` is not used."""
        width = self.config.block_size - 1
        drafts = torch.zeros(len(self.rows), width, dtype=torch.long)
        for b, (row, anchor_position) in enumerate(zip(self.rows, cache.lengths.tolist())):
            future = row[anchor_position + 1: anchor_position + 1 + width]
            drafts[b, : len(future)] = future
        if self.corruption:
            corrupt = torch.rand(drafts.shape, generator=self.generator) < self.corruption
            noise = torch.randint(0, self.vocab_size, drafts.shape, generator=self.generator)
            drafts = torch.where(corrupt, noise, drafts)
        return drafts.to(anchor.device), None
