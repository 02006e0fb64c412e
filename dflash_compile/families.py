"""The family registry: the only place in dflash-compile that knows how a model family is built.

Each supported family gets one `FamilySpec`, keyed by `config.model_type`. Passes, the expert store and the
generation code ask the registry; they never look for a module name pattern such as ".mlp.experts." (Mixtral-style
models name their MoE block `block_sparse_moe` in older checkpoints, Qwen3.5 nests experts beside a gated shared
expert, DeepSeek-V3 keeps its first layers dense). Routed-expert modules are recognised by their class.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import torch
import transformers
from packaging.version import Version
from transformers.integrations.moe import (_can_use_grouped_mm, _grouped_linear, grouped_mm_experts_forward,
                                           use_experts_implementation)

from .compressed_attention import row_compressor
from .key_selection import (batched_qwen4_exp_indexer, captured_kolibri_indexer, keeps_no_position_history,
                            no_position_history, row_aligned_minimax_m3_indexer, row_pooled_glm5_next_indexer)
from .row_positions import distances_per_row, row_positioned_inkling_attention, row_relative_distances
from .subclassing import subclass_once

GateUpLayout = Literal["concatenated", "interleaved", "ungated"]
Activation = Literal["act_fn", "clamped_swiglu", "clamped_act_fn", "clamped_gate_silu", "softcapped_swiglu"]
AttentionKind = Literal["full_attention", "indexed_attention", "reference_sliding_attention", "sliding_attention",
                        "compressed_attention", "chunked_attention", "linear_attention", "conv", "mlp"]
# kinds whose layers keep a conv window (and a linear-attention layer a recurrent state), not keys and values: their
# padding masks are 2-D, their states committed by `TargetCache.commit_linear`; LFM2's short-convolution layers ("conv")
# need no recurrent rule, a block's convolution over the kept window being exact
RECURRENT_KINDS = ("linear_attention", "conv")
# kinds of layers that neither attend nor keep a state: Nemotron-H's MLP and MoE layers, a mixer of their own
STATELESS_KINDS = ("mlp",)
# kinds whose layers see at most their window's last keys (`ring_window`), which `TargetCache` keeps in a ring:
# sliding-window layers (DeepSeek-V4's "compressed_attention" ones with compressed entries of earlier windows beside,
# `compressed_attention`), and Llama 4's chunked ones, whose queries see the keys of their own chunk
RING_KINDS = ("sliding_attention", "compressed_attention", "chunked_attention")
# kinds whose layers attend over every cached key: full attention, DSA's ("indexed_attention": DeepSeek-V3.2's,
# over the keys its indexer picks from all of them), and reference sliding attention (every prompt key, a window of
# the tokens generated after them: `REFERENCE_KINDS`)
FULL_KINDS = ("full_attention", "indexed_attention", "reference_sliding_attention")
# kinds whose layers see every key of the prompt and a window (`ring_window`) of the generated ones (Unlimited OCR's):
# their keys kept whole, the window masked past the prompt (`TargetCache.masks`)
REFERENCE_KINDS = ("reference_sliding_attention",)
# kinds whose layers read their mask themselves (a DSA indexer scores the keys under it; DeepSeek-V4's layers append
# their entries' visibility to it): always given one
MASK_READING_KINDS = ("indexed_attention", "compressed_attention")
# kinds whose layers attend over cached keys and values: every kind but the recurrent and the stateless ones
KEYED_KINDS = (*FULL_KINDS, *RING_KINDS)


@dataclass(frozen=True)
class ExpertLayout:
    """How one family stores and applies its routed experts (transformers' 3-D `gate_up_proj` / `down_proj`)."""

    gate_up: GateUpLayout  # "concatenated": [gate; up] rows; "interleaved": gate = rows 0::2, up = rows 1::2;
    # "ungated": `up_proj` [E, I, H] alone, act(up) (Nemotron-H's squared ReLU)
    transposed: bool  # weights stored [E, in, out] instead of [E, out, in]
    bias: bool  # `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H]
    activation: Activation  # "act_fn": act(gate) * up with the module's `act_fn`;
    # "clamped_swiglu": gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate), from `alpha`/`limit`;
    # "clamped_act_fn": act(gate) <= limit times up clamped to [-limit, limit], the module's `limit` (None or inf:
    # act(gate) * up; Step 3.7 and, from transformers 5.25, Ling 3 clamp a few layers);
    # "clamped_gate_silu": SiLU(gate <= limit) times up clamped to [-limit, limit], the module's `swiglu_limit` (HY V4;
    # DeepSeek-V4's `limit`);
    # "softcapped_swiglu": softcap(gate) sigmoid(gate) softcap(up), its act_fn's two softcaps (Inkling 2)


@dataclass(frozen=True)
class RouterSpec:
    """What the router computes before the experts see `top_k_index` / `top_k_weights`."""

    scoring: Literal["softmax", "sigmoid", "top_k_then_softmax", "sqrtsoftplus"]
    correction_bias: str | None = None  # the router's attribute (path): a bias added to the scores for the choice only
    grouped_top_k: bool = False  # experts chosen inside the best `topk_group` of `n_group` groups
    routed_scaling_factor: bool = False  # weights multiplied by `config.routed_scaling_factor`
    module: str = "gate"  # the router's attribute (path) on the MoE block, beside the experts module
    # an attribute of the MoE block that the block passes to the router's call by the same name (MiniMax-M2 keeps its
    # correction bias there, not on the router)
    block_bias: str | None = None
    tokens_in_rows: bool = False  # the router takes hidden states [batch, tokens, H] (AFMoE's), not [tokens, H]
    # a method of the MoE block that `routing_of` calls instead of the router, where the router does not return the
    # choice (Llama 4's returns every expert's score; `Llama4RoutedMoe.route` chooses)
    call: str | None = None
    # outputs the router returns after its expert indices (ZAYA1's: its state for the next layer's router), which
    # `routing_of` leaves out
    after_indices: int = 0


@dataclass(frozen=True)
class LinearAttentionSpec:
    """A linear-attention mixer (a gated delta rule, or a Mamba2 state space scan): its attribute on the decoder layer,
    and the names of the rules its module calls for a multi-token input (chunked) and for one token with a state
    (recurrent; transformers' decode)."""

    mixer: str
    chunked: str
    recurrent: str
    # config -> fp32 elements the chunked rule holds per prompt token at its peak (`prefill_memory`)
    chunked_elements_per_token: Callable[[object], int]
    # config -> the recurrent state's elements: `linear_attention`'s stepped rule keeps one after each token of a
    # block it steps (a verify block, or a prefill chunk of at most STEPWISE_TOKENS after the first)
    state_elements: Callable[[object], int]
    # the rules' signature, by which `linear_attention.stepwise_linear_attention` steps a verify block: "delta"
    # (GatedDeltaNet, KDA: query, key, value, g, beta), "mamba2" (hidden states, dt, A, B, C), "mamba1" (Jamba's
    # scan of the mixer, its inputs and the cache), "lightning" (MiniMax's mixer forward itself, named
    # `Class.forward`, which reads and writes its state in the cache) or "delayed_value" (ZAYA1's CCA projection
    # forward, its state the last token's delayed value projection)
    rule: Literal["delta", "mamba2", "mamba1", "lightning", "delayed_value"] = "delta"


def first_projection(experts: torch.nn.Module) -> str:
    """The experts module's first projection parameter: `gate_up_proj`, or `up_proj` where transformers declares the
    experts ungated (`has_gate`, set by `@use_experts_implementation`)."""
    return "gate_up_proj" if getattr(experts, "has_gate", True) else "up_proj"


def ring_window(config, kind: AttentionKind) -> int | None:
    """How many of the latest keys a layer of `kind` sees at most: a sliding layer's window, a chunked layer's
    chunk (`attention_chunk_size`), a reference sliding layer's window past the prompt; None for every other kind,
    or where the config sets none."""
    setting = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size",
               "reference_sliding_attention": "sliding_window", "compressed_attention": "sliding_window"}.get(kind)
    return getattr(config, setting, None) if setting else None


def layer_configs(config) -> list:
    """Each decoder layer's view of the config: transformers' per-layer config, where a layer's own settings override
    the model's (Gemma 4's full-attention layers: wider heads, their own key/value heads), else the config itself."""
    per_layer = getattr(config, "per_layer_config", None)
    return [config if per_layer is None else per_layer[i] for i in range(config.num_hidden_layers)]


def routed_top_k(config) -> int:
    """Experts each token is routed to: `num_experts_per_tok`, Gemma 4's `top_k_experts`, Aria's `moe_topk`, DBRX's
    `ffn_config.moe_top_k`."""
    if hasattr(config, "ffn_config"):
        return config.ffn_config.moe_top_k
    return getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k_experts", None) or config.moe_topk


def head_dim(config, layer: int = 0) -> int:
    """An attention head's dimension in decoder layer `layer`: its `head_dim` (Gemma 4's full layers have their own),
    else hidden size / heads (Mixtral, OLMoE)."""
    return getattr(layer_configs(config)[layer], "head_dim", None) or config.hidden_size // config.num_attention_heads


def _reads_anothers_cache(config, layer: int) -> bool:
    """Whether the layer attends over an earlier layer's cached keys and values, caching none of its own (the layers
    `kv_source_layers` names to another: Mistral Large 4's, Kolibri 1.1's)."""
    sources = getattr(config, "kv_source_layers", None)
    return bool(sources) and sources[layer] != layer


def _keys_and_values(config, kind: AttentionKind, layer: int) -> int:
    """A key and a value of every key/value head of the layer (Gemma 4's full layers: wider heads, their own
    key/value heads; with `attention_k_eq_v` their values are their keys, cached as both), none where it reads
    another layer's."""
    if _reads_anothers_cache(config, layer):
        return 0
    return 2 * layer_configs(config)[layer].num_key_value_heads * head_dim(config, layer)


def _compressed_entries(config, layer: int) -> list[tuple[int, int]]:
    """DeepSeek-V4: the (rate, width) of each buffer of compressed entries a layer keeps, one entry of `width` per
    `rate` tokens: an HCA's (head_dim), a CSA's and its indexer's (`index_head_dim`)."""
    layer_type = config.layer_types[layer]
    rate = config.compress_rates.get(layer_type)
    widths = {"heavily_compressed_attention": [config.head_dim],
              "compressed_sparse_attention": [config.head_dim, config.index_head_dim]}.get(layer_type, [])
    return [(rate, width) for width in widths]


def _compressor_projections(config, kind: AttentionKind, layer: int) -> int:
    """DeepSeek-V4: its one key/value head cached as key and value, and the projections its compressors cache per
    token in the same ring (`compressed_attention`): a `kv_proj` and a `gate_proj` per buffer of entries, each of the
    entries' width, twice that in a CSA layer (its windows also read the previous window's halves)."""
    overlap = 2 if config.layer_types[layer] == "compressed_sparse_attention" else 1
    projections = sum(2 * overlap * width for _, width in _compressed_entries(config, layer))
    return _keys_and_values(config, kind, layer) + projections


def _keys_values_and_block_keys(config, kind: AttentionKind, layer: int) -> int:
    """MiniMax-M3: keys and values, and in its sparse layers ("minimax_m3_sparse") the indexer's key."""
    sparse = config.layer_types[layer] == "minimax_m3_sparse"
    return _keys_and_values(config, kind, layer) + (config.index_head_dim if sparse else 0)


def _keys_values_and_indexer_key(config, kind: AttentionKind, layer: int) -> int:
    """Qwen4-Exp: keys and values, and in its indexed layers the indexer's keys (`indexer_kv_heads`)."""
    indexed = config.indexer_kv_heads * config.indexer_head_dim if kind == "indexed_attention" else 0
    return _keys_and_values(config, kind, layer) + indexed


def _inkling_keys_and_values(config, kind: AttentionKind, layer: int) -> int:
    """Inkling: keys and values of its full layers' heads, or of its sliding layers' own (`swa_*`)."""
    if kind == "sliding_attention":
        return 2 * config.swa_num_key_value_heads * config.swa_head_dim
    return 2 * config.num_key_value_heads * config.head_dim


def _mimo_keys_and_values(config, kind: AttentionKind, layer: int) -> int:
    """MiMo-V2-Flash: keys of `head_dim`, values of `v_head_dim`, and sliding layers twice the key/value heads."""
    heads = config.num_key_value_heads * (2 if kind == "sliding_attention" else 1)
    return heads * (head_dim(config) + config.v_head_dim)


def _latent(config, kind: AttentionKind, layer: int) -> int:
    """Multi-head latent attention: one compressed key/value latent and one shared rotary key, for every head (none
    in Mistral Large 4's layers without rotary positions: `no_rope_layers` is 0 there), of the layer's own ranks
    (dots.llm3's sliding layers have theirs)."""
    no_rope_layers = getattr(config, "no_rope_layers", None)
    rotary = not no_rope_layers or no_rope_layers[layer]
    own = layer_configs(config)[layer]
    return own.kv_lora_rank + (own.qk_rope_head_dim if rotary else 0)


def _indexed_latent(config, kind: AttentionKind, layer: int) -> int:
    """DeepSeek sparse attention (DSA): latent attention's latent and rotary key where the layer caches its own
    (Mistral Large 4's layers named to an earlier source in `kv_source_layers` read that layer's), and the indexer's
    key where the layer runs an indexer: an "indexed_attention" layer but GLM-MoE-DSA's "shared" ones
    (`indexer_types`), which reuse an earlier layer's choice (dots.llm3's sliding layers run none)."""
    latent = 0 if _reads_anothers_cache(config, layer) else _latent(config, kind, layer)
    shared = getattr(config, "indexer_types", None) and config.indexer_types[layer] == "shared"
    # GLM-5-Next's indexer caches its pool gate's score per token beside its key
    indexer = config.index_head_dim * (2 if getattr(config, "index_kpool", None) else 1)
    return latent + (indexer if kind == "indexed_attention" and not shared else 0)


def _latent_expansion(config) -> int:
    """Elements a latent-attention prefill holds per visible cache slot: transformers expands each latent through
    kv_b_proj into every head's key and value parts, then concatenates the keys with their rotary part (the widest
    layer's, where layers have their own heads and widths)."""
    return max(view.num_attention_heads * ((view.qk_nope_head_dim + view.v_head_dim)
                                           + (view.qk_nope_head_dim + view.qk_rope_head_dim) + view.v_head_dim)
               for view in layer_configs(config))


def _gated_delta_rule_elements(config) -> int:
    """transformers' torch_chunk_gated_delta_rule per token: fp32, value-head-wide copies of the query, key and
    value (grouped heads repeated, transposed, padded, scaled by beta) and three 64-wide rows of its chunk's
    triangular matrices, held together at its peak."""
    width = max(config.linear_key_head_dim, config.linear_value_head_dim)
    return config.linear_num_value_heads * (10 * width + 3 * 64)


def _delta_state(config) -> int:
    """GatedDeltaNet's state: [value heads, key dim, value dim]."""
    return config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim


def _kimi_delta_state(config) -> int:
    """KDA's state: [heads, head dim, head dim]."""
    return config.linear_num_heads * config.linear_head_dim ** 2


def _mamba2(mixer: str, heads: str, head_dim: str, state: str, chunk: str) -> LinearAttentionSpec:
    """A Mamba2 mixer (the decoder layer's attribute `mixer`), its sizes under the config's names: its state is
    [heads, head dim, state size]. transformers' mamba2_chunk_scan holds per token fp32 copies of the input, its
    dt-scaled form and two partial outputs (heads x head dim each), B and C repeated to every head and B decayed
    (heads x state size), its chunk's decay, scores and masked scores (heads x chunk size each), and eight chunk
    states' share ([heads, head dim, state size] a chunk: the chunks' states, their concatenation, the decayed ones,
    ...), held together at its peak."""

    def state_elements(config) -> int:
        return getattr(config, heads) * getattr(config, head_dim) * getattr(config, state)

    def scan_elements(config) -> int:
        per_head = 4 * getattr(config, head_dim) + 3 * getattr(config, state) + 3 * getattr(config, chunk)
        return getattr(config, heads) * per_head + 8 * state_elements(config) // getattr(config, chunk)

    return LinearAttentionSpec(mixer, "mamba2_chunk_scan", "mamba2_selective_state_update", scan_elements,
                               state_elements, rule="mamba2")


def _lightning_state(config) -> int:
    """MiniMax's lightning attention state (keys' outer products with values, decayed): [heads, head dim, head
    dim]."""
    return config.num_attention_heads * head_dim(config) ** 2


def _lightning_elements(config) -> int:
    """MiniMax's lightning attention over a prompt per token: its q/k/v projection, activated and masked (3 head dims
    a head each), its block's intra-block scores and their decayed copy (`block_size` wide), the decayed queries,
    the inter- and intra-block outputs and their sum (a head dim each)."""
    return config.num_attention_heads * (10 * head_dim(config) + 2 * config.block_size)


def _delayed_value_state(config) -> int:
    """ZAYA1's CCA state beside its conv window: the last token's delayed value projection (half the key/value
    width)."""
    return config.num_key_value_heads * config.head_dim // 2


def _cca_elements(config) -> int:
    """ZAYA1's CCA projection over a prompt per token: its query and key projections, their concatenation, two
    convolutions' outputs, the residual paths (query-wide each), and the value halves."""
    qk = (config.num_attention_heads + config.num_key_value_heads) * config.head_dim
    return 6 * qk + 2 * config.num_key_value_heads * config.head_dim


def _hybrid_layer_kinds(config) -> list[AttentionKind]:
    """ZAYA1 and Inkling: "hybrid" layers attend over every key, "hybrid_sliding" ones over a window (with their
    convolutions: ZAYA1's CCA, Inkling's short convolutions)."""
    return _hybrid_kinds(config.layer_types)


def _hybrid_kinds(layer_types: list[str]) -> list[AttentionKind]:
    return ["sliding_attention" if kind == "hybrid_sliding" else "full_attention" for kind in layer_types]


def _looped_hybrid_layer_kinds(config) -> list[AttentionKind]:
    """Inkling 2 with looped layers, by cache index: its layers', then the looped layers' again for each pass after
    the first (transformers' caches for those passes come after the model's layers, in that order)."""
    looped = config.layer_types[config.loop_layer_index_start:config.loop_layer_index_end]
    return _hybrid_kinds(list(config.layer_types) + looped * (config.loop_num_passes - 1))


def _looped_states(config) -> int:
    """Looped Inkling 2, per token: its block states (one hidden vector a block of `n_layers_per_attn_res_block` layers
    visited) held thrice (before the loop, the last pass's, this pass's), their stacked fp32 copy and its norm in the
    message attention, and a looped layer's 4 messages and their gates' fp32 inputs (2 each)."""
    blocks = -(-config.total_num_hidden_layers // config.n_layers_per_attn_res_block) + 1
    return 5 * blocks + 4 * 3


def _mamba1_state(config) -> int:
    """Jamba's Mamba state: [intermediate size (mamba_expand x hidden size), state size]."""
    return config.mamba_expand * config.hidden_size * config.mamba_d_state


def _mamba1_scan_elements(config) -> int:
    """transformers' mamba_selective_scan (its PyTorch scan) per token: fp32 copies of the input, its time step and
    gate (intermediate size each), and the discretized decay and input, the associative scan's two levels of them
    and the states it outputs ([intermediate size, state size] each, six held together at its peak)."""
    return (6 * config.mamba_d_state + 3) * config.mamba_expand * config.hidden_size


def _kimi_delta_rule_elements(config) -> int:
    """transformers' chunk_kimi_delta_attention per token: fp32 copies of the query, key, value, gate and their
    beta-scaled and decayed forms, and, its forget gate being one value per key dimension, each 64-token chunk's
    decay mask and the product summed into its triangular matrix over every key dimension ([64, 64, key dim] a chunk
    each, three held together at its peak), with the matrix's rows."""
    return config.linear_num_heads * ((3 * 64 + 11) * config.linear_head_dim + 3 * 64)


@dataclass(frozen=True)
class FamilySpec:
    name: str
    model_types: tuple[str, ...]
    experts_class: str  # the `@use_experts_implementation` module class holding the routed experts
    layout: ExpertLayout
    router: RouterSpec
    moe_layers: Callable[[object], list[int]]  # config -> indices of decoder layers with routed experts

    attention_kinds: Callable[[object], list[AttentionKind]]  # config -> attention kind of every decoder layer
    linear_attention: LinearAttentionSpec | None = None  # how its "linear_attention" layers compute
    # the attention's softmax takes one learned logit per head (`sinks`, passed as `s_aux`) and drops it after, in
    # the family's eager attention (dflash_compile.attention reproduces it without copying keys and values)
    attention_sinks: bool = False
    # groups of sibling linear layers that read one input, laid out in one buffer by `optimize` so that one GEMM
    # serves each group (`projections.share_storage`, pass `projection_fusion`); absent names are skipped
    shared_input_linears: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
    # (config, attention kind, layer) -> elements the layer hands the cache per token (what `generate` budgets its
    # cache by)
    cached_per_token: Callable[[object, AttentionKind, int], int] = _keys_and_values
    # (config, layer) -> the (rate, width) of each buffer of compressed entries a layer keeps beside its cache, one
    # entry of `width` elements per `rate` slots of every slot, not a ring's: DeepSeek-V4's (`compressed_attention`)
    compressed_entries: Callable[[object, int], list[tuple[int, int]]] = lambda config, layer: []
    # rewrites, in place, of modules transformers builds otherwise: MoE blocks into blocks that call routed experts
    # (Llama 4: every expert on every token, the router's scores on the inputs; Step 3.7's experts undecorated on
    # transformers 5.24), Llama 4's NoPE query temperature per row; `adapt_model` applies each
    adapt: tuple[Adapter, ...] = ()
    # the decoder layers' module (path) of experts of attention heads routed as its MLP experts are (the same number,
    # top-k and layers: JetMoE's `self_attention.experts`): the cost model reads their 3-D weights per expert picked
    routed_attention_experts: str | None = None
    # whether its attention adds a learned bias by position (Inkling's relative logits, `position_bias`), which
    # transformers' SDPA folds into the mask and the decoder's grouped attention does not: that one is left out
    position_bias: bool = False
    # (config, itemsize) -> bytes a prefill's layer holds per (query, visible slot) beyond its mask where its attention
    # picks keys or biases them (`prefill_memory`: Kolibri 1.1's, MiniMax-M3's, Inkling's); DSA's follow from
    # `cached_per_token`
    query_slot_bytes: Callable[[object, int], int] | None = None
    # the attribute of an MoE block (ERNIE-4.5-VL's `vision_moe`) whose experts text prompts never call: left to the
    # model's own code (images), out of `experts_modules`
    image_experts: str | None = None
    # linears FP8 checkpoints keep in the model's dtype (by how their path ends): those the family's code multiplies by
    # their `weight` instead of calling (Jamba's `dt_proj`) or reads the dtype of (Ergo's `o_proj`: its layers' compute
    # dtype; looped Inkling 2's message gates' `message_gate.down_proj`), and routers beside the MoE blocks' (JetMoE's
    # attention experts' `router.layer`), which route in the model's dtype as the MoE blocks' do
    unquantized_linears: tuple[str, ...] = ()
    # whether a router reads what the experts read (offload's prefetch guesses the next MoE layer's experts by its
    # router on this layer's experts' input): Muse Spark's experts read the block's input projected into their own
    # width, so offloading it prefetches nothing
    routers_read_experts_input: bool = True
    # the masks the model's forward takes by its own names, from ours by kind (ZAYA1's layer types "hybrid" and
    # "hybrid_sliding", and "conv": the 2-D padding mask its CCA convolution reads in every attention layer); None:
    # ours as they are
    model_masks: dict[str, str] | None = None
    # whether the target's forwards tell the model `use_cache` with the target cache: MiniMax's model refuses any
    # cache but its own (`MiniMaxCache`) when told, while its layers read and write the cache they are given either way
    use_cache: bool = True
    # (config) -> hidden-wide fp32 vectors a prefill's forward holds per token beyond its layers' own
    # (`prefill_memory`): looped Inkling 2's block states across its passes and the messages between them
    held_per_token: Callable[[object], int] | None = None
    # the config's count of zero-compute experts, which a router picks as it picks routed ones and which read no weights
    # (LongCat-Flash's `zero_expert_num`: each returns its input)
    zero_compute_experts_key: str | None = None
    # the config's count of decoder layers (of hidden states a forward returns, less the embeddings' own), where
    # `num_hidden_layers` counts something else (LongCat-Flash's: its attention sublayers, two a decoder layer)
    decoder_layers_key: str = "num_hidden_layers"
    # the oldest transformers whose model code for the family dflash-compile reproduces (Jamba's verify blocks need
    # 5.25's cache-reading scan); an older one is refused by `spec_for_config`
    min_transformers: str | None = None

    def installed(self) -> bool:
        """Whether the installed transformers is recent enough for the family (`min_transformers`)."""
        return self.min_transformers is None or Version(transformers.__version__) >= Version(self.min_transformers)

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash): the cache holds compressed latents, which each
        forward of transformers' expands through kv_b_proj over the cache's whole capacity (`attention` attends in
        the latent space instead where that costs less)."""
        return self.cached_per_token in (_latent, _indexed_latent)

    def expanded_per_slot(self, config) -> int:
        """Elements a prefill's attention layer expands each visible cache slot into (`prefill_memory`): a latent
        one's keys and values, none elsewhere."""
        return _latent_expansion(config) if self.latent_attention else 0

    def indexed_per_query_slot(self, config, itemsize: int) -> int:
        """Bytes a prefill's DSA layer holds per (query, visible slot), masked or not (`prefill_memory`): its mask and
        the copy with the keys the indexer did not pick masked out, which keys those are (bool), the indexer's fp32
        scores of every indexer head and their ReLU, the weighted sum and its masked copy; elsewhere the family's
        `query_slot_bytes` (none without). GLM-5-Next's indexer scores pools of `index_kpool` slots (those fp32
        scores, and which pools a query may pick, per pool), then counts its picks per slot (int32) and makes its mask
        from them (bool, then additive)."""
        if self.cached_per_token is _indexed_latent:
            scores = (2 * config.index_n_heads + 2) * 4
            pool = getattr(config, "index_kpool", None)
            return 3 * itemsize + 6 + -(-(scores + 1) // pool) if pool else 2 * itemsize + 1 + scores
        return self.query_slot_bytes(config, itemsize) if self.query_slot_bytes else 0


def _kolibri_selection_bytes(config, itemsize: int) -> int:
    """Kolibri 1.1's indexed layers (`key_selection`), per (query, slot): the mask and its copy, 8 bool masks
    (visible, pool, sinks, local, candidates and the top-k rule's), fp32 scores, a head's product and its ReLU, the
    masked copy, the tie ranks (int32)."""
    return 2 * itemsize + 8 + 5 * 4


def _block_picks_bytes(config, itemsize: int) -> int:
    """MiniMax-M3's sparse layers, per (query, slot): the mask, its per-head copy with the unpicked blocks masked,
    which keys those are per head (bool, gathered and repeated), the indexer's fp32 scores per index head (the
    product, the future masked, the copy padded to whole blocks)."""
    heads = config.num_attention_heads
    return itemsize * (1 + heads) + 2 * heads + 3 * 4 * config.index_n_heads


def _scored_blocks_bytes(config, itemsize: int) -> int:
    """Qwen4-Exp's indexed layers (`key_selection.BatchedQwen4ExpIndexer`), per (query, slot): the mask and its copy
    with the unpicked keys masked, which keys the query sees, its tail, its picked blocks laid onto the slots and
    their union (bool); per block of `indexer_compress_ratio` slots, each index head's fp32 score and its ReLU, their
    sum and its masked copy, which blocks the query may pick and picked (bool)."""
    per_block = 2 * 4 * config.indexer_n_heads + 2 * 4 + 2
    return 2 * itemsize + 4 + -(-per_block // config.indexer_compress_ratio)


def _compressed_entries_bytes(config, itemsize: int) -> int:
    """DeepSeek-V4's layers (`compressed_attention`), per (query, slot): per compressed entry (one per `rate` slots, the
    CSA's rate the smaller) a CSA indexer's fp32 scores per index head (the product, its ReLU, scaled, weighted),
    their sum and masked copy, which entries the query sees (bool), and the entries' bias, its copy in the layer's
    mask and that mask folded over the heads (one key/value head)."""
    per_entry = 4 * 4 * config.index_n_heads + 2 * 4 + 1 + (3 + config.num_attention_heads) * itemsize
    return -(-per_entry // min(config.compress_rates.values()))


def _position_bias_bytes(config, itemsize: int) -> int:
    """Inkling's and Inkling 2's layers (`row_positions`), per (query, slot): the distances and their clamped copy
    (int64), where they fall outside (bool), and per head the profiles gathered, masked, log-scaled in fp32 and
    back, and added to the mask."""
    heads = max(config.num_attention_heads, config.swa_num_attention_heads)
    return 2 * 8 + 1 + heads * (4 * itemsize + 4)


def _all_layers(config) -> list[int]:
    """Every decoder layer (`decoder_layers`: LongCat-Flash's `num_layers`, else `num_hidden_layers`)."""
    return list(range(decoder_layers(config)))


def _after_first_k_dense(config) -> list[int]:
    return list(range(config.first_k_dense_replace, config.num_hidden_layers))


def _declared_sparse_layers(config) -> list[int]:
    """GLM-4.7-Flash (glm4_moe_lite): `mlp_layer_types` names each layer's MLP "dense" or "sparse"."""
    return [i for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse"]


def _qwen3_sparse_layers(config) -> list[int]:
    """Qwen3-MoE: every `decoder_sparse_step`-th layer (Flint's and Kolibri 1.1's: every one) but `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", 1)
    return [i for i in range(config.num_hidden_layers)
            if i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % step == 0]


def _after_num_dense_layers(config) -> list[int]:
    """AFMoE: every layer after its first `num_dense_layers` dense ones."""
    return list(range(config.num_dense_layers, config.num_hidden_layers))


def _every_layer_when(setting: str) -> Callable[[object], list[int]]:
    """config -> every layer when the config's `setting` is set, else none: Gemma 4's `enable_moe_block` (an MoE block
    beside each layer's MLP), Granite 4.0-H's `num_local_experts` (its dense releases have none)."""
    return lambda config: list(range(config.num_hidden_layers)) if getattr(config, setting) else []


def _ernie_sparse_layers(config) -> list[int]:
    """ERNIE-4.5-MoE: every `moe_layer_interval`-th layer from `moe_layer_start_index` to `moe_layer_end_index`."""
    return [i for i in range(config.num_hidden_layers) if (i + 1) % config.moe_layer_interval == 0
            and config.moe_layer_start_index <= i <= config.moe_layer_end_index]


def _declared_layer_types(config) -> list[AttentionKind]:
    return list(config.layer_types)


def _every_layer_indexed(config) -> list[AttentionKind]:
    """MiniMax-M3: its model gives every layer one mask, which its sparse layers' indexers read: always given."""
    return ["indexed_attention"] * config.num_hidden_layers


def _compressed_everywhere(config) -> list[AttentionKind]:
    """DeepSeek-V4: its model gives every layer one sliding-window mask, to which its compressed layers append their
    entries' visibility: always given (`compressed_attention`)."""
    return ["compressed_attention"] * config.num_hidden_layers


def _full_attention(config) -> list[AttentionKind]:
    return ["full_attention"] * config.num_hidden_layers


def _window_everywhere(config) -> list[AttentionKind]:
    """Mixtral and Qwen3-MoE: one `sliding_window` (Qwen3 only with `use_sliding_window`) for every layer."""
    slides = config.sliding_window and getattr(config, "use_sliding_window", True)
    return ["sliding_attention" if slides else "full_attention"] * config.num_hidden_layers


@use_experts_implementation(is_transposed=True)
class Llama4RoutedExperts(torch.nn.Module):
    """Llama 4's experts (`Llama4TextExperts`, weights [E, H, 2I] and [E, I, H]) called as routed experts, each row
    through the experts `top_k_index` names (transformers' grouped_mm; the model's experts implementation, as for any
    decorated experts class), where transformers runs every expert on every row. `Llama4RoutedMoe` gives them one row
    per (token, expert) pair. Made by changing a module's class: the attributes the decorator's __init__ would set
    are the class's, `config` the adapter's."""

    has_gate, has_bias, has_post_expert_norm, is_transposed, is_concatenated = True, False, False, True, True
    _is_expert_parallel = False

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return grouped_mm_experts_forward(self, hidden, top_k_index, top_k_weights)


class Llama4RoutedMoe(torch.nn.Module):
    """Llama 4's MoE block (`Llama4TextMoe`) calling its experts as routed experts, with the same sums: transformers
    scales each token's input to every expert by sigmoid(the expert's logit if among the top-k, else -inf) and runs
    every expert, so only the chosen ones add anything. Here each (token, chosen expert) pair is one row, its input
    scaled by its score, through that expert alone (weight 1), and a token's rows are summed."""

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (the chosen experts' scores, their indices), both [T, k]: the router's choice, which
        offload's prefetch asks for too."""
        _, logits = self.router(hidden)  # and every expert's score, which the choice does not need
        top, index = torch.topk(logits, self.top_k, dim=1)
        return torch.sigmoid(top.float()).to(top.dtype), index

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        hidden = hidden_states.reshape(-1, self.hidden_dim)
        scores, index = self.route(hidden)
        pairs = (hidden[:, None, :] * scores[..., None]).reshape(-1, self.hidden_dim)
        routed = self.experts(pairs, index.reshape(-1, 1), torch.ones_like(pairs[:, :1]))
        out = self.shared_expert(hidden)
        return out + routed.view(-1, self.top_k, self.hidden_dim).sum(dim=1), None  # the decoder drops the second


class _MovedExperts(torch.nn.Module):
    """Routed experts in transformers' layout, `gate_up_proj` [E, 2I, H] (gate rows, then up) and `down_proj`
    [E, H, I], made from a family's own experts module by a weight-moving adapter; the attributes the decorator's
    __init__ would set are the class's, `config` the adapter's."""

    has_gate, has_bias, has_post_expert_norm, is_transposed, is_concatenated = True, False, False, False, True
    _is_expert_parallel = False

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return grouped_mm_experts_forward(self, hidden, top_k_index, top_k_weights)


@use_experts_implementation
class DbrxRoutedExperts(_MovedExperts):
    """DBRX's experts (`DbrxExperts`, which loops over experts) as routed experts: `gate_up_proj` and `down_proj`
    from its `mlp.w1` (gate), `mlp.v1` (up) and `mlp.w2` (down, multiplied as h @ w2), each expert's [I, H] rows
    stacked into one [E * I, H] matrix. Made by changing a module's class and moving its weights
    (`_route_dbrx_experts`)."""


class DbrxRoutedFfn(torch.nn.Module):
    """DBRX's MoE block (`DbrxFFN`) calling `DbrxRoutedExperts` on its tokens as rows [T, H] (`DbrxFFN` hands the
    experts [batch, tokens, H]), routed as `DbrxFFN` routes: softmax, top-k, the weights divided by their p-norm.
    Made by changing a module's class, as Llama 4's blocks (the registry names transformers' classes, never imports
    them)."""

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (the chosen experts' weights, their indices), both [T, k]: the router's choice, which
        offload's prefetch asks for too."""
        logits = self.router(hidden)
        weights, index = torch.topk(torch.softmax(logits, dim=1, dtype=logits.dtype), self.top_k, dim=-1)
        if self.moe_normalize_expert_weights is not None:
            weights = weights / torch.norm(weights, p=self.moe_normalize_expert_weights, dim=-1, keepdim=True)
        return weights, index

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, index = self.route(hidden)
        return self.experts(hidden, index, weights).view(hidden_states.shape)


def _route_dbrx_experts(model: torch.nn.Module, block: torch.nn.Module) -> None:
    """DBRX: a `DbrxFFN` becomes a `DbrxRoutedFfn` and its experts `DbrxRoutedExperts`, their weights moved into
    `gate_up_proj` / `down_proj` (the same values; each matrix replaced as it is made, so memory holds one more
    layer's experts at most) and their activation kept as `act_fn`."""
    experts, mlp = block.experts, block.experts.mlp
    per_expert = (experts.num_experts, experts.ffn_hidden_size, experts.hidden_size)
    gate, up, down = (getattr(mlp, name).detach().view(per_expert) for name in ("w1", "v1", "w2"))
    trained = mlp.w1.requires_grad
    block.__class__ = DbrxRoutedFfn
    experts.__class__ = DbrxRoutedExperts
    experts.config = model.config.get_text_config()
    experts.act_fn = mlp.activation_fn
    del experts.mlp
    experts.gate_up_proj = torch.nn.Parameter(torch.cat([gate, up], dim=1), requires_grad=trained)
    del gate, up
    experts.down_proj = torch.nn.Parameter(down.transpose(1, 2).contiguous(), requires_grad=trained)


@use_experts_implementation
class JetMoeRoutedExperts(_MovedExperts):
    """JetMoE's MLP experts (two `JetMoeParallelExperts`, which split rows by a `tolist()` of their group sizes and
    loop over experts: no graph captures them whole) as routed experts: `gate_up_proj` is its `input_linear`'s weight
    [E, 2I, H] (the MoE block chunks its output into gate, then up), `down_proj` its `output_linear`'s. A new module
    holding the same tensors (`_route_jetmoe_experts`)."""


class JetMoeRoutedMoe(torch.nn.Module):
    """JetMoE's MoE block (`JetMoeMoE`) calling `JetMoeRoutedExperts` on its tokens as rows, routed as `JetMoeMoE`
    routes (the top-k of the router's fp32 logits, then their softmax), its output bias added after. Made by changing
    a module's class."""

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (the chosen experts' weights, their indices), both [T, k]: the router's choice, which
        offload's prefetch asks for too."""
        return _top_k_then_softmax(self.router.layer(hidden).float(), self.router.top_k, hidden.dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, index = self.route(hidden)
        return self.experts(hidden, index, weights).view(hidden_states.shape) + self.bias


def _top_k_then_softmax(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A `JetMoeTopKGating`'s choice from its fp32 logits [T, E]: the softmax of the top-k in `dtype` (the hidden
    states'), and their indices, both [T, k]."""
    top, index = logits.topk(top_k, dim=1)
    return torch.softmax(top, dim=1).to(dtype), index


class _ExpertRows(NamedTuple):
    """A mixture of attention heads' (token, pick) rows grouped by expert."""

    rows: torch.Tensor  # [T * k] the rows in expert order (row t * k + j: token t's j-th pick)
    experts: torch.Tensor  # [T * k] the expert of each of them
    weights: torch.Tensor  # [T * k] their routing weights
    offsets: torch.Tensor  # [E] int32: where each expert's rows end


def _expert_linear(inputs: torch.Tensor, weight: torch.Tensor, grouping: _ExpertRows) -> torch.Tensor:
    """inputs [T * k, in] in expert order, each row through its expert's weight [E, out, in]: one grouped GEMM
    (transformers' `_grouped_linear`: torch's grouped_mm, or transformers' loop over the groups where torch's takes no
    such weights). On CUDA that loop reads the group sizes on the host, which a CUDA graph cannot capture: there,
    every expert's product of every row instead, the row's own kept (E times the FLOPs; no sync)."""
    if weight.is_cuda and not _can_use_grouped_mm(inputs, weight, grouping.offsets):
        return _every_expert_linear(inputs, weight, grouping.experts)
    return _grouped_linear(inputs, weight, grouping.offsets)


def _every_expert_linear(inputs: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """inputs [R, in] through every expert's weight [E, out, in], each row's own expert's product kept: [R, out]."""
    every = torch.einsum("ri,eoi->reo", inputs, weight)
    return every.gather(1, experts[:, None, None].expand(-1, 1, every.shape[-1])).squeeze(1)


class JetMoeGroupedAttentionExperts(torch.nn.Module):
    """JetMoE's mixture of attention heads (`JetMoeMoA`): each token's query heads come from the query projections
    of the top-k experts its router picks, and their outputs go through those experts' output projections, weighted.
    transformers groups the rows by a `tolist()` of the group sizes (data-dependent: no graph captures the layer
    whole); here each projection is one grouped GEMM over the rows sorted by expert (`_expert_linear`), as
    transformers' grouped_mm runs routed experts, with the same sums. The attention experts stay the model's own
    weights (resident): only the MLP experts are dispatched and offloaded. Made by changing a module's class."""

    @property
    def out_features(self) -> int:
        """Elements its grouped GEMMs output per token, as a linear's (`prefill_memory`): a query row and an output
        row of the hidden size for each of the token's k picks."""
        return self.top_k * (self.hidden_size + self.input_size)

    def _grouping(self, hidden: torch.Tensor) -> tuple[torch.Tensor, _ExpertRows]:
        """hidden [T, H] -> (the router's logits, its picks' rows grouped by expert)."""
        logits = self.router.layer(hidden).float()
        weights, index = _top_k_then_softmax(logits, self.top_k, hidden.dtype)
        experts, rows = torch.sort(index.reshape(-1))
        # histc, not bincount: no host sync (CUDA graphs); on CPU it counts floats only
        counts = torch.histc(experts.float() if experts.is_cpu else experts.int(), bins=self.num_experts, min=0,
                             max=self.num_experts - 1)
        return logits, _ExpertRows(rows, experts, weights.reshape(-1)[rows],
                                   torch.cumsum(counts, dim=0, dtype=torch.int32))

    def map(self, layer_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _ExpertRows]:
        """layer_input [B, S, H] -> (queries [B, S, k, kv heads x head dim], the router's logits, the grouping that
        `reduce` takes)."""
        batch, length, width = layer_input.shape
        hidden = layer_input.reshape(-1, width)
        logits, grouping = self._grouping(hidden)
        queries = _expert_linear(hidden[grouping.rows // self.top_k], self.input_linear.weight, grouping)
        unsorted = torch.empty_like(queries).index_copy_(0, grouping.rows, queries)
        return unsorted.view(batch, length, self.top_k, -1), logits, grouping

    def reduce(self, layer_input: torch.Tensor, grouping: _ExpertRows) -> torch.Tensor:
        """layer_input [B, S, k, kv heads x head dim] (each pick's attention output) -> [B, S, H]."""
        picks = layer_input.reshape(-1, layer_input.shape[-1])
        out = _expert_linear(picks[grouping.rows], self.output_linear.weight, grouping) * grouping.weights[:, None]
        unsorted = torch.empty_like(out).index_copy_(0, grouping.rows, out)
        summed = unsorted.view(*layer_input.shape[:2], self.top_k, -1).sum(dim=2)
        return summed + self.bias


def _route_jetmoe_experts(model: torch.nn.Module, block: torch.nn.Module) -> None:
    """JetMoE: a `JetMoeMoE` becomes a `JetMoeRoutedMoe` whose new `experts` (`JetMoeRoutedExperts`) hold its
    `input_linear` / `output_linear` weights as `gate_up_proj` / `down_proj` (the same tensors)."""
    experts = JetMoeRoutedExperts.__new__(JetMoeRoutedExperts)
    torch.nn.Module.__init__(experts)
    experts.config = model.config.get_text_config()
    experts.num_experts = block.input_linear.num_experts
    experts.act_fn = block.activation
    experts.gate_up_proj = block.input_linear.weight
    experts.down_proj = block.output_linear.weight
    del block.input_linear, block.output_linear, block.activation
    block.experts = experts
    block.__class__ = JetMoeRoutedMoe


def _group_jetmoe_attention_experts(model: torch.nn.Module, moa: torch.nn.Module) -> None:
    moa.__class__ = JetMoeGroupedAttentionExperts


def _normed_routes(experts: torch.nn.Module, hidden: torch.Tensor, weights: torch.Tensor, index: torch.Tensor,
                   norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """hidden [T, H] -> [T, H] in its dtype: each (token, route) pair of `index` one row through its expert (weight 1),
    normed by `norm(rows, their experts)`, then weighted by `weights` and summed per token, as transformers' experts
    with a post-expert norm compute (Ergo's, Muse Spark's)."""
    routes = index.reshape(-1, 1)
    rows = hidden.repeat_interleave(index.shape[1], dim=0)
    normed = norm(experts(rows, routes, rows.new_ones(routes.shape)), routes.flatten())
    return (normed.view(*index.shape, hidden.shape[-1]) * weights.unsqueeze(-1)).sum(1).to(hidden.dtype)


class ErgoNormedMoe(torch.nn.Module):
    """Ergo's MoE block (`ErgoMoE`) with the routes' norm (`post_expert_norm`, an RMSNorm weight [E, H] for each
    expert) moved out of its experts module into the block: each (token, route) pair is one row through its expert
    (transformers' `ErgoExpertProjections`, the routed experts the registry dispatches), normed by that expert's
    weight, then weighted and summed per token, as transformers' `ErgoExperts` computes, and the normed shared expert
    added. `ErgoExperts` derives from the projections' class, so dispatching it would drop the norm. Made by changing
    a module's class (`_move_ergo_route_norms`)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        _, weights, index = self.gate(hidden_states)
        last = self.experts.num_experts - 1
        routed = _normed_routes(self.experts, hidden_states.reshape(-1, hidden_states.shape[-1]), weights, index,
                                lambda out, routes: self.post_expert_norm(out, routes.clamp_max(last)))
        return routed.view(hidden_states.shape) + self.shared_experts(hidden_states)


def _move_ergo_route_norms(model: torch.nn.Module, block: torch.nn.Module) -> None:
    """Ergo: an `ErgoMoE` becomes an `ErgoNormedMoe` holding its experts' `post_expert_norm`, and the experts module
    becomes the class it derives from, transformers' decorated `ErgoExpertProjections` (the same weights)."""
    block.post_expert_norm = block.experts.post_expert_norm
    del block.experts.post_expert_norm
    block.experts.__class__ = type(block.experts).__mro__[1]
    block.__class__ = ErgoNormedMoe


class MuseSparkNormedMoe(torch.nn.Module):
    """Muse Spark's MoE block (`MuseSparkMoE`) with its experts' route norm (`post_expert_norm`, one norm for every
    expert) moved into the block: the input projected into the experts' width and normed, each (token, route) pair
    one row through its expert, normed, then weighted and summed per token, as transformers' `MuseSparkExperts`
    computes, and projected back. Dispatching the experts module with the norm inside would drop it (the kernels
    weight and sum the rows). Made by changing a module's class (`_move_muse_spark_route_norm`)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        _, weights, index = self.gate(hidden_states)
        hidden = self.pre_expert_norm(self.pre_expert_proj(hidden_states.reshape(-1, hidden_states.shape[-1])))
        routed = _normed_routes(self.experts, hidden, weights, index, lambda out, _: self.post_expert_norm(out))
        return self.post_expert_proj(routed).view(hidden_states.shape)


def _move_muse_spark_route_norm(model: torch.nn.Module, block: torch.nn.Module) -> None:
    """Muse Spark: a `MuseSparkMoE` becomes a `MuseSparkNormedMoe` holding its experts' `post_expert_norm`; the
    experts module keeps an identity in its place (its own forward and transformers' implementations call one)."""
    block.post_expert_norm = block.experts.post_expert_norm
    block.experts.post_expert_norm = torch.nn.Identity()
    block.__class__ = MuseSparkNormedMoe


class LongcatRoutedMoe(torch.nn.Module):
    """LongCat-Flash's MoE block (`LongcatFlashMoE`), its router picking among `num_routed_experts` experts and
    `zero_expert_num` zero-compute ones that return their input. transformers moves each zero-compute pick to a routed
    expert spread over all of them, at weight 0, and adds the input times those picks' weights. Here such a pick goes
    to the token's lowest-numbered routed pick (expert 0 where it has none), at weight 0 too: no expert is read, or
    fetched from an offload store, that the token does not need, and the sums are the same (the moved rows add
    zeros). Made by changing a module's class."""

    def _routed_and_identity(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (the routed experts' weights, their indices, both [T, k]; the zero-compute picks' summed
        weights [T, 1])."""
        _, weights, index = self.router(hidden)
        zero = index >= self.num_routed_experts
        lowest_routed = torch.where(zero, self.num_routed_experts, index).amin(dim=-1, keepdim=True)
        moved_to = lowest_routed.masked_fill(lowest_routed == self.num_routed_experts, 0)
        identity = weights.masked_fill(~zero, 0.0).sum(dim=-1, keepdim=True)
        return weights.masked_fill(zero, 0.0), torch.where(zero, moved_to, index), identity

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (the routed experts' weights, their indices), both [T, k]: what the experts are called
        with, which offload's prefetch asks for too."""
        return self._routed_and_identity(hidden)[:2]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, index, identity = self._routed_and_identity(hidden)
        routed = self.experts(hidden, index, weights)
        return (routed + (hidden * identity).to(routed.dtype)).reshape(hidden_states.shape)


def _route_longcat_experts(model: torch.nn.Module, block: torch.nn.Module) -> None:
    block.__class__ = LongcatRoutedMoe


@dataclass(frozen=True)
class Adapter:
    """A family's in-place rewrite of the modules transformers builds so that they call routed experts the registry
    dispatches: `rewrite(model, module)` for each module `pending` picks out (after which it picks none: adapting
    again changes nothing). `reason`: what transformers' modules do that the rewrite changes (said when a model is
    traced before it). `moves_weights`: the rewrite makes new weights from the old (DBRX's), so on a model offloaded
    to disk it runs a module at a time with the weights read in (`checkpoint._adapt_offloaded`)."""

    pending: Callable[[torch.nn.Module], bool]
    rewrite: Callable[[torch.nn.Module, torch.nn.Module], None]
    reason: str
    moves_weights: bool = False

    def __call__(self, model: torch.nn.Module) -> None:
        for module in [module for module in model.modules() if self.pending(module)]:
            self.rewrite(model, module)

    def needed(self, model: torch.nn.Module) -> bool:
        return any(self.pending(module) for module in model.modules())


def _route_llama4_experts(model: torch.nn.Module, block: torch.nn.Module) -> None:
    """Llama 4: a `Llama4TextMoe` becomes a `Llama4RoutedMoe` and its experts `Llama4RoutedExperts` (the same
    modules and weights, another class)."""
    block.__class__ = Llama4RoutedMoe
    block.experts.__class__ = Llama4RoutedExperts
    block.experts.config = model.config.get_text_config()


def _query_slots(attention: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """The pre-hook of a tempered Llama 4 NoPE attention (`_temper_llama4_queries`): its queries' scales, from each
    row's own slots where the cache keeps rows of their own lengths (a `TargetCache`), else from the cache's one
    length as transformers' layer does, left on `q_proj` for `_tempered_queries`."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        first = 0
    elif hasattr(cache, "lengths"):  # dflash_compile.cache.TargetCache
        first = cache.lengths[:, None]
    else:
        first = cache.get_seq_length(attention.layer_idx)
    slots = torch.arange(hidden.shape[1], device=hidden.device) + first
    scales = torch.log1p(torch.floor((slots.float() + 1.0) / attention.floor_scale)) * attention.attn_scale + 1.0
    attention.q_proj.query_scales = scales[..., None]  # [rows or 1, tokens, 1]: over q_proj's heads x head_dim


def _tempered_queries(q_proj: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """The forward hook of a tempered Llama 4 NoPE attention's `q_proj`: transformers' `(q * scales).to(q.dtype)`
    (fp32 products, the same bits), per row."""
    return (output * q_proj.query_scales).to(output.dtype)


def _temper_llama4_queries(model: torch.nn.Module, attention: torch.nn.Module) -> None:
    """Llama 4's NoPE layers scale queries by log1p(floor((slot + 1) / floor_scale)) * attn_scale + 1, the slots
    counted from the cache's one length (`get_seq_length`). Rows that speculative decoding leaves at different lengths
    each need their own: the layer's own scaling is turned off and done by hooks instead, per row where the cache has
    rows' lengths (module-level functions: the model still pickles)."""
    attention.attn_temperature_tuning = False
    attention.register_forward_pre_hook(_query_slots, with_kwargs=True)
    attention.q_proj.register_forward_hook(_tempered_queries)


def _tempered_by_one_length(module: torch.nn.Module) -> bool:
    """A Llama 4 NoPE attention whose queries transformers' layer scales by the cache's one length."""
    return (type(module).__name__ == "Llama4TextAttention" and module.attn_temperature_tuning
            and not module.use_rope)


_ROUTE_DBRX_EXPERTS = Adapter(lambda module: type(module).__name__ == "DbrxFFN", _route_dbrx_experts,
                              "DBRX's experts loop over flattened 2-D weights", moves_weights=True)
_ROUTE_JETMOE_EXPERTS = Adapter(lambda module: type(module).__name__ == "JetMoeMoE", _route_jetmoe_experts,
                                "JetMoE's experts split their rows by a host list of group sizes", moves_weights=True)
_GROUP_JETMOE_ATTENTION_EXPERTS = Adapter(lambda module: type(module).__name__ == "JetMoeMoA",
                                          _group_jetmoe_attention_experts,
                                          "JetMoE's attention experts split their rows by a host list of group sizes")
_MOVE_ERGO_ROUTE_NORMS = Adapter(lambda module: type(module).__name__ == "ErgoMoE", _move_ergo_route_norms,
                                 "Ergo's experts norm each route's output by its expert inside the experts module",
                                 moves_weights=True)
_MOVE_MUSE_SPARK_ROUTE_NORM = Adapter(lambda module: type(module).__name__ == "MuseSparkMoE",
                                      _move_muse_spark_route_norm,
                                      "Muse Spark's experts norm each route's output inside the experts module",
                                      moves_weights=True)
_ROUTE_LONGCAT_EXPERTS = Adapter(lambda module: type(module).__name__ == "LongcatFlashMoE", _route_longcat_experts,
                                 "LongCat-Flash's MoE blocks send zero-compute picks to experts the token did not pick")
_ROUTE_LLAMA4_EXPERTS = Adapter(lambda module: type(module).__name__ == "Llama4TextMoe", _route_llama4_experts,
                                "Llama 4's MoE blocks run every expert on every token")
_TEMPER_LLAMA4_QUERIES = Adapter(_tempered_by_one_length, _temper_llama4_queries,
                                 "Llama 4's NoPE layers scale queries by the cache's one length")
_ALIGN_MINIMAX_M3_BLOCKS = Adapter(lambda module: type(module).__name__ == "MiniMaxM3VLIndexer",
                                   row_aligned_minimax_m3_indexer,
                                   "MiniMax-M3's indexers count key blocks from slot 0, padding included")
_POSITION_INKLING_ATTENTION = Adapter(lambda module: type(module).__name__ == "InklingAttention",
                                      row_positioned_inkling_attention,
                                      "Inkling's attention reads positions from the cache's one length")
_ROW_INKLING2_DISTANCES = Adapter(lambda module: type(module).__name__ in ("Inkling2TextModel",
                                                                          "Inkling2LoopTextModel")
                                  and not distances_per_row(module), row_relative_distances,
                                  "Inkling 2's model reads its layers' distances from the cache's one length")
_CAPTURE_KOLIBRI_INDEXERS = Adapter(lambda module: type(module).__name__ == "Kolibri1_1Indexer",
                                    captured_kolibri_indexer,
                                    "Kolibri 1.1's indexers loop over host lists of query groups")
_POOL_GLM5_NEXT_INDEXERS = Adapter(lambda module: type(module).__name__ == "Glm5NextTextIndexer",
                                   row_pooled_glm5_next_indexer,
                                   "GLM-5-Next's indexers read the cache's one length and keep only the pools some row "
                                   "completes (a shape that follows the data)")
_BATCH_QWEN4_EXP_INDEXERS = Adapter(lambda module: type(module).__name__ == "Qwen4ExpTextQSAIndexer",
                                    batched_qwen4_exp_indexer,
                                    "Qwen4-Exp's indexers loop over rows and queries by host lists of visible keys")
_NO_QWEN4_EXP_POSITION_HISTORY = Adapter(lambda module: type(module).__name__ == "Qwen4ExpTextModel"
                                         and not keeps_no_position_history(module), no_position_history,
                                         "Qwen4-Exp's model keeps the positions of every cached token in the cache")
_ROW_DEEPSEEK_V4_COMPRESSORS = Adapter(
    lambda module: type(module).__name__ in ("DeepseekV4HCACompressor", "DeepseekV4CSACompressor",
                                             "DeepseekV4Indexer"), row_compressor,
    "DeepSeek-V4's compressors keep one running state for the batch, counted from slot 0 and not taken back")


def _decorated(cls: type) -> type:
    """`cls`'s `@use_experts_implementation` subclass (`subclass_once`: made once, its modules pickle)."""
    return subclass_once(_decorate, cls)


def _decorate(cls: type) -> type:
    return use_experts_implementation(type(cls.__name__, (cls,), {"__module__": cls.__module__}))


def _decorate_experts(model: torch.nn.Module, experts: torch.nn.Module) -> None:
    """For transformers versions that leave a family's routed experts undecorated (Step 3.7 before 5.25): the module
    gets a subclass of the same name decorated with `@use_experts_implementation` (its defaults: concatenated
    [E, 2I, H] gate/up, no bias), and the flags and `config` the decorator's __init__ would have set; a model whose
    config names no experts implementation (its class cannot set one) gets "eager", which traces as transformers'
    grouped_mm (`seam`)."""
    config = model.config.get_text_config()
    experts.__class__ = _decorated(type(experts))
    experts.config = config
    experts.has_gate, experts.has_bias, experts.has_post_expert_norm = True, False, False
    experts.is_transposed, experts.is_concatenated, experts._is_expert_parallel = False, True, False
    if getattr(config, "_experts_implementation", None) is None:
        config._experts_implementation = "eager"


def _undecorated(class_name: str) -> Adapter:
    """The adapter decorating each module of class `class_name` that transformers left undecorated."""
    return Adapter(lambda module: type(module).__name__ == class_name and not is_experts_module_class(type(module)),
                   _decorate_experts, f"transformers {transformers.__version__} leaves {class_name} undecorated")


def _nemotron_moe_layers(config) -> list[int]:
    """Nemotron-H: the layers whose one mixer is an MoE block (`layers_block_type` "moe")."""
    return [i for i, block in enumerate(config.layers_block_type) if block == "moe"]


def _nemotron_layer_kinds(config) -> list[AttentionKind]:
    """Nemotron-H: each layer is one mixer, Mamba2 ("linear_attention"), attention, or an MLP or MoE block ("mlp":
    nothing in the cache)."""
    return [block if block in ("linear_attention", "full_attention") else "mlp" for block in config.layers_block_type]


def _jamba_layer_kinds(config) -> list[AttentionKind]:
    """Jamba: Mamba layers ("linear_attention") and every `attn_layer_period`-th an attention layer."""
    return ["full_attention" if block == "attention" else "linear_attention" for block in config.layers_block_type]


def _jamba_moe_layers(config) -> list[int]:
    """Jamba: every `expert_layer_period`-th layer has routed experts, the others one MLP."""
    return [layer for layer, experts in enumerate(config.layers_num_experts) if experts > 1]


def _declared_moe_layers(config) -> list[int]:
    """Llama 4: `moe_layers` (every `interleave_moe_layer_step`-th layer unless listed)."""
    return list(config.moe_layers)


_SWIGLU = ExpertLayout(gate_up="concatenated", transposed=False, bias=False, activation="act_fn")
# SiLU experts clamped in the layers their config's `swiglu_limits` names (Step 3.7; Ling 3 from transformers 5.25)
_CLAMPED_SWIGLU = ExpertLayout(gate_up="concatenated", transposed=False, bias=False, activation="clamped_act_fn")
_GATE_CLAMPED_SWIGLU = ExpertLayout(gate_up="concatenated", transposed=False, bias=False,
                                    activation="clamped_gate_silu")
_SOFTMAX = RouterSpec(scoring="softmax")
_TOP_K_THEN_SOFTMAX = RouterSpec(scoring="top_k_then_softmax", module="router")  # gpt-oss, Granite-MoE
_GATED_DELTA_NET = LinearAttentionSpec("linear_attn", "torch_chunk_gated_delta_rule",
                                       "torch_recurrent_gated_delta_rule", _gated_delta_rule_elements, _delta_state)
# Mamba2 layers (Granite 4.0-H): the decoder layer's `mamba`
_MAMBA2 = _mamba2("mamba", "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_chunk_size")
# Kimi Linear's KDA layers: the decoder layer's `self_attn`, as its latent-attention layers
_KIMI_DELTA_ATTENTION = LinearAttentionSpec("self_attn", "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention",
                                            _kimi_delta_rule_elements, _kimi_delta_state)
# Multi-head latent attention's linears reading the same input (q_proj where there is no q_lora_rank)
_MLA_SHARED_INPUTS = (("q_a_proj", "kv_a_proj_with_mqa"), ("q_proj", "kv_a_proj_with_mqa"), ("gate_proj", "up_proj"))
# and where the attention's output gate reads the layer's input too (HY V4)
_GATED_MLA_SHARED_INPUTS = (("q_a_proj", "kv_a_proj_with_mqa", "gate_proj"), ("gate_proj", "up_proj"))
_ERNIE_ROUTER = RouterSpec(scoring="softmax", correction_bias="moe_statics.e_score_correction_bias")
_DEEPSEEK_ROUTER = RouterSpec(scoring="sigmoid", correction_bias="e_score_correction_bias", grouped_top_k=True,
                              routed_scaling_factor=True)
# DeepSeek-V2: softmax scores, top-k over all experts ("greedy") or inside the best `topk_group` groups by their
# largest score ("group_limited_greedy"), times `routed_scaling_factor`
_DEEPSEEK_V2_ROUTER = RouterSpec(scoring="softmax", grouped_top_k=True, routed_scaling_factor=True)
# HY V4: GLM-MoE-DSA's sparse attention with sinks and a per-head output gate, hyper-connection streams between layers
# (`drafter.context_features` averages them), experts clamping the gate before SiLU; GLM-4.5's router, a shared
# expert; MLPs declared
# Inkling 2 (its text model; a vision tower beside it): Kolibri's kind of router, scaled; experts with softcapped
# SwiGLU; Inkling's relative logits (distances per row: `row_positions`), log-scaled queries in full layers (by the
# rows' own positions), convolutions (dynamic ones on full layers' keys and values), attention sinks per token; block
# attention residuals across layers (within a forward)
_INKLING2 = FamilySpec(
    "inkling2", ("inkling2_text", "inkling2"), "Inkling2Experts",
    ExpertLayout(gate_up="concatenated", transposed=False, bias=False, activation="softcapped_swiglu"),
    RouterSpec(scoring="sigmoid", correction_bias="e_score_correction_bias"), _all_layers, _hybrid_layer_kinds,
    model_masks={"conv": "linear_attention"}, cached_per_token=_inkling_keys_and_values,
    adapt=(_ROW_INKLING2_DISTANCES,), position_bias=True, attention_sinks=True, query_slot_bytes=_position_bias_bytes,
)

_HY_V4 = FamilySpec(
    "hy_v4", ("hy_v4",), "HYV4Experts", _GATE_CLAMPED_SWIGLU, _DEEPSEEK_ROUTER, _declared_sparse_layers,
    _declared_layer_types, attention_sinks=True, shared_input_linears=_GATED_MLA_SHARED_INPUTS,
    cached_per_token=_indexed_latent, unquantized_linears=("weights_proj",),
)

FAMILIES: dict[str, FamilySpec] = {
    spec.name: spec
    for spec in (
        FamilySpec("mixtral", ("mixtral",), "MixtralExperts", _SWIGLU, _SOFTMAX, _all_layers, _window_everywhere),
        FamilySpec(
            "qwen3_moe", ("qwen3_moe",), "Qwen3MoeExperts", _SWIGLU, _SOFTMAX, _qwen3_sparse_layers,
            _window_everywhere,
        ),
        FamilySpec(
            "qwen3_5_moe",
            ("qwen3_5_moe", "qwen3_5_moe_text"),
            "Qwen3_5MoeExperts",
            _SWIGLU,
            _SOFTMAX,
            _all_layers,
            _declared_layer_types,  # GatedDeltaNet "linear_attention" layers between "full_attention" ones
            _GATED_DELTA_NET,
        ),
        FamilySpec(  # Qwen4-Exp: Qwen3.5's GatedDeltaNet layers, router and gated shared expert; "indexed_attention"
            # layers whose QSA indexer picks blocks of keys (`key_selection`), n-gram embeddings of earlier token ids
            # and a dilated convolution beside its linear-attention layers (their states as conv windows: the last
            # ids, the convolution's input), hyper-connection streams flattened into one vector a token
            "qwen4_exp", ("qwen4_exp", "qwen4_exp_text"), "Qwen4ExpTextExperts", _SWIGLU, _SOFTMAX, _all_layers,
            _declared_layer_types, _GATED_DELTA_NET, cached_per_token=_keys_values_and_indexer_key,
            query_slot_bytes=_scored_blocks_bytes, adapt=(_BATCH_QWEN4_EXP_INDEXERS, _NO_QWEN4_EXP_POSITION_HISTORY),
        ),
        FamilySpec(  # Qwen3-VL-MoE's text decoder (image-text-to-text models): Qwen3-MoE's router and sparse-layer rule
            "qwen3_vl_moe", ("qwen3_vl_moe", "qwen3_vl_moe_text"), "Qwen3VLMoeTextExperts", _SWIGLU, _SOFTMAX,
            _qwen3_sparse_layers, _full_attention,
        ),
        FamilySpec(  # Qwen3-Omni's thinker (text prompts; the released model's `thinker`, the whole model refused:
            # `_TEXT_GENERATED_BY`): Qwen3-VL-MoE's decoder beside audio and vision towers
            "qwen3_omni_moe", ("qwen3_omni_moe_thinker", "qwen3_omni_moe_text"), "Qwen3OmniMoeThinkerTextExperts",
            _SWIGLU, _SOFTMAX, _qwen3_sparse_layers, _full_attention,
        ),
        FamilySpec(  # Muse Spark (image-text-audio-to-text; its text model muse_spark_text): the MoE block projects
            # its input into the experts' width and back, its experts norm each route's output (one norm for all,
            # the block's after the family's adapt: `MuseSparkNormedMoe`); a sigmoid router on scaled fp32 logits,
            # choosing with a correction bias, renormalised and scaled; sliding and full layers (some without rotary
            # positions), q/k norms, the output gated, gated residuals; MLPs declared
            "muse_spark", ("muse_spark", "muse_spark_text"), "MuseSparkExperts", _SWIGLU,
            RouterSpec(scoring="sigmoid", correction_bias="e_score_correction_bias", routed_scaling_factor=True),
            _declared_sparse_layers, _declared_layer_types, adapt=(_MOVE_MUSE_SPARK_ROUTE_NORM,),
            routers_read_experts_input=False,
        ),
        FamilySpec(  # Ergo: experts without a gate (relu(up)^2, weights [E, in, out]) whose routes are normed each by
            # a weight of its expert's before the weighted sum, that norm the MoE block's after the family's adapt
            # (`ErgoNormedMoe`); a sigmoid router choosing with a correction bias, renormalised and
            # scaled, a normed shared expert; sliding and full layers, gated residuals; MLPs declared
            "ergo", ("ergo",), "ErgoExpertProjections",
            ExpertLayout(gate_up="ungated", transposed=True, bias=False, activation="act_fn"),
            RouterSpec(scoring="sigmoid", correction_bias="e_score_correction_bias"), _declared_sparse_layers,
            _declared_layer_types, adapt=(_MOVE_ERGO_ROUTE_NORMS,),
            unquantized_linears=("o_proj",),  # its decoder layers compute in the dtype of o_proj's weight
        ),
        FamilySpec(  # Qwen1.5-MoE / Qwen2-MoE: Qwen3-MoE's router and sparse-layer rule, a sigmoid-gated shared expert
            "qwen2_moe", ("qwen2_moe",), "Qwen2MoeExperts", _SWIGLU, _SOFTMAX, _qwen3_sparse_layers,
            _declared_layer_types,
        ),
        FamilySpec(  # Qwen3-Next: Qwen3.5-MoE's GatedDeltaNet and shared expert, Qwen3-MoE's sparse-layer rule
            "qwen3_next", ("qwen3_next",), "Qwen3NextExperts", _SWIGLU, _SOFTMAX,
            _qwen3_sparse_layers, _declared_layer_types, _GATED_DELTA_NET,
        ),
        FamilySpec(
            "gpt_oss",
            ("gpt_oss",),
            "GptOssExperts",
            ExpertLayout(gate_up="interleaved", transposed=True, bias=True, activation="clamped_swiglu"),
            _TOP_K_THEN_SOFTMAX,
            _all_layers,
            _declared_layer_types,  # alternating 128-token "sliding_attention" and "full_attention", with sinks
            attention_sinks=True,
        ),
        FamilySpec(  # GLM-4.5; Sarvam-30B and Param-2 are released on its model classes (configs of their own)
            "glm4_moe", ("glm4_moe", "sarvam_moe", "param2moe"), "Glm4MoeExperts", _SWIGLU, _DEEPSEEK_ROUTER,
            _after_first_k_dense, _full_attention,
        ),
        FamilySpec(  # GLM-4.5V / GLM-4.6V's text decoder (image-text-to-text models): GLM-4.5's MoE layers
            "glm4v_moe", ("glm4v_moe", "glm4v_moe_text"), "Glm4vMoeTextExperts", _SWIGLU, _DEEPSEEK_ROUTER,
            _after_first_k_dense, _full_attention,
        ),
        FamilySpec(  # dots.llm1: GLM-4.5's router, shared experts and dense first layers; sliding layers declared
            "dots1", ("dots1",), "Dots1Experts", _SWIGLU, _DEEPSEEK_ROUTER, _after_first_k_dense,
            _declared_layer_types,
        ),
        FamilySpec(  # DeepSeek-V3 (Kimi K2.5: a vision tower beside its decoder); Sarvam-105B on its model classes
            "deepseek_v3", ("deepseek_v3", "sarvam_mla", "kimi_k25"), "DeepseekV3Experts", _SWIGLU, _DEEPSEEK_ROUTER,
            _after_first_k_dense, _full_attention, shared_input_linears=_MLA_SHARED_INPUTS, cached_per_token=_latent,
        ),
        FamilySpec(  # DeepSeek-V3.2: DeepSeek-V3's experts and latent attention, over the keys a DSA indexer picks for
            # each query (the `index_topk` best by its own scores of its own cached keys, under the mask); MLPs
            # declared; the indexer's `weights_proj` casts its input to its weight's dtype (kept unquantized)
            "deepseek_v32", ("deepseek_v32",), "DeepseekV32Experts", _SWIGLU, _DEEPSEEK_ROUTER, _declared_sparse_layers,
            _declared_layer_types, shared_input_linears=_MLA_SHARED_INPUTS, cached_per_token=_indexed_latent,
            unquantized_linears=("weights_proj",),
        ),
        FamilySpec(  # GLM-MoE-DSA (GLM-5): DeepSeek-V3.2's, its indexer's rotary keys interleaved, and layers that
            # reuse the previous indexer's choice (`indexer_types` "shared")
            "glm_moe_dsa", ("glm_moe_dsa",), "GlmMoeDsaExperts", _SWIGLU, _DEEPSEEK_ROUTER, _declared_sparse_layers,
            _declared_layer_types, shared_input_linears=_MLA_SHARED_INPUTS, cached_per_token=_indexed_latent,
            unquantized_linears=("weights_proj",),
        ),
        FamilySpec(  # GLM-5-Next (its image-text model's decoder): Kimi Linear's KDA layers between latent-attention
            # DSA layers without rotary positions, whose indexers pick pools of keys (`key_selection`; "shared"
            # layers reuse the previous layer's pick), hyper-connection streams, experts clamping gate and up before
            # SiLU, GLM-4.5's router and shared experts; MLPs declared
            "glm5_next", ("glm5_next", "glm5_next_text"), "Glm5NextTextExperts", _GATE_CLAMPED_SWIGLU,
            _DEEPSEEK_ROUTER, _declared_sparse_layers, _declared_layer_types, _KIMI_DELTA_ATTENTION,
            shared_input_linears=_MLA_SHARED_INPUTS, cached_per_token=_indexed_latent,
            unquantized_linears=("weights_proj",), adapt=(_POOL_GLM5_NEXT_INDEXERS,),
        ),
        FamilySpec(  # dots.llm3 (Dots 3 Note; its causal LM): DeepSeek-V3.2's sparse attention in "indexed_attention"
            # layers, latent attention of its own ranks and heads over a window in "sliding_attention" ones
            # (`per_layer_config`), the output gated per head; GLM-4.5's router, a shared expert; MLPs declared
            "dots3_note", ("dots3_note", "dots3_note_text"), "Dots3NoteExperts", _SWIGLU, _DEEPSEEK_ROUTER,
            _declared_sparse_layers, _declared_layer_types, shared_input_linears=_MLA_SHARED_INPUTS,
            cached_per_token=_indexed_latent, unquantized_linears=("weights_proj",),
        ),
        _HY_V4,
        # HY V4's image-text-to-text release (Hy4; its text model hy_v4_vl_text): HY V4's decoder under rotary
        # positions in three sections
        replace(_HY_V4, name="hy_v4_vl", model_types=("hy_v4_vl", "hy_v4_vl_text"), experts_class="HYV4VLExperts"),
        FamilySpec(  # Mistral Large 4 (image-text-to-text; its text model mistral_large4_text): GLM-MoE-DSA's sparse
            # attention without a query LoRA, queries scaled by position (Mistral 4's), layers without rotary
            # positions (`no_rope_layers`) and layers that read an earlier layer's latents (`kv_source_layers`);
            # Mistral 4's softmax router inside groups on fp32 logits, a shared expert; MLPs declared
            "mistral_large4", ("mistral_large4", "mistral_large4_text"), "MistralLarge4TextExperts", _SWIGLU,
            _DEEPSEEK_V2_ROUTER, _declared_sparse_layers, _declared_layer_types,
            shared_input_linears=_MLA_SHARED_INPUTS, cached_per_token=_indexed_latent,
            unquantized_linears=("weights_proj",),
        ),
        FamilySpec(  # DeepSeek-V2 (-Lite): DeepSeek-V3's latent attention and dense first layers, a softmax router
            "deepseek_v2", ("deepseek_v2",), "DeepseekV2Experts", _SWIGLU, _DEEPSEEK_V2_ROUTER,
            _after_first_k_dense, _full_attention, shared_input_linears=_MLA_SHARED_INPUTS, cached_per_token=_latent,
        ),
        FamilySpec(  # DeepSeek-OCR 2 (image-text-to-text; its text model deepseek_ocr2_text): DeepSeek-V2's softmax
            # router (greedy, or inside groups) and shared experts under plain multi-head attention; MLPs declared
            "deepseek_ocr2", ("deepseek_ocr2", "deepseek_ocr2_text"), "DeepseekOcr2TextExperts", _SWIGLU,
            _DEEPSEEK_V2_ROUTER, _declared_sparse_layers, _full_attention,
        ),
        FamilySpec(  # Unlimited OCR (image-text-to-text; its text model unlimited_ocr_text): DeepSeek-OCR 2's decoder
            # with reference sliding attention (every prompt key, a window of the generated tokens); MLPs declared
            "unlimited_ocr", ("unlimited_ocr", "unlimited_ocr_text"), "UnlimitedOcrTextExperts", _SWIGLU,
            _DEEPSEEK_V2_ROUTER, _declared_sparse_layers, _declared_layer_types,
        ),
        FamilySpec(  # GLM-4.7-Flash: DeepSeek-V3's latent attention and router, its MLPs named layer by layer
            "glm4_moe_lite", ("glm4_moe_lite",), "Glm4MoeLiteExperts", _SWIGLU, _DEEPSEEK_ROUTER,
            _declared_sparse_layers, _full_attention, shared_input_linears=_MLA_SHARED_INPUTS,
            cached_per_token=_latent,
        ),
        FamilySpec("olmoe", ("olmoe",), "OlmoeExperts", _SWIGLU, _SOFTMAX, _all_layers, _full_attention),
        FamilySpec(  # FlexOlmo: OLMoE's router on OLMo-2's post-norm layers
            "flex_olmo", ("flex_olmo",), "FlexOlmoExperts", _SWIGLU, _SOFTMAX, _all_layers, _full_attention),
        FamilySpec(  # Solar Open: GLM-4.5's router and shared experts in every layer
            "solar_open", ("solar_open",), "SolarOpenExperts", _SWIGLU, _DEEPSEEK_ROUTER, _all_layers, _full_attention),
        FamilySpec(  # EXAONE-MoE: GLM-4.5's router and shared experts, MLPs and attention layers declared (sliding with
            # rotary positions, full without)
            "exaone_moe", ("exaone_moe",), "ExaoneMoeExperts", _SWIGLU, _DEEPSEEK_ROUTER, _declared_sparse_layers,
            _declared_layer_types,
        ),
        FamilySpec(  # Granite-MoE (3.0 / 3.1 MoE): top-k of the router's logits, then their softmax; multipliers on
            # the embeddings, residuals, attention and logits stay the model's own code
            "granitemoe", ("granitemoe",), "GraniteMoeExperts", _SWIGLU, _TOP_K_THEN_SOFTMAX, _all_layers,
            _full_attention,
        ),
        FamilySpec(  # Granite-MoE with a shared MLP beside the routed experts (`shared_mlp`, a model module)
            "granitemoeshared", ("granitemoeshared",), "GraniteMoeSharedExperts", _SWIGLU, _TOP_K_THEN_SOFTMAX,
            _all_layers, _full_attention,
        ),
        FamilySpec(  # Command-A-style Cohere2-MoE: top-k of the router's logits, then their softmax or sigmoid; MLPs
            # and attention layers declared (sliding with rotary, full without)
            "cohere2_moe", ("cohere2_moe",), "Cohere2MoeExperts", _SWIGLU, RouterSpec(scoring="top_k_then_softmax"),
            _declared_sparse_layers, _declared_layer_types,
        ),
        FamilySpec(  # MiniMax-M3 (image-text-to-text; its text model minimax_m3_vl_text): sigmoid scores chosen with
            # the router's correction bias, renormalised; gpt-oss's clamped SwiGLU on concatenated gate/up rows, a
            # shared expert; MLPs declared; full and sparse layers (an indexer picks blocks of keys per key/value
            # head, counted from each row's first key: `key_selection`) under one mask, which the sparse ones read
            "minimax_m3_vl", ("minimax_m3_vl", "minimax_m3_vl_text"), "MiniMaxM3VLExperts",
            ExpertLayout(gate_up="concatenated", transposed=False, bias=False, activation="clamped_swiglu"),
            RouterSpec(scoring="sigmoid", correction_bias="e_score_correction_bias"), _declared_sparse_layers,
            _every_layer_indexed, cached_per_token=_keys_values_and_block_keys, adapt=(_ALIGN_MINIMAX_M3_BLOCKS,),
            query_slot_bytes=_block_picks_bytes,
        ),
        FamilySpec(  # MiniMax-M2: sigmoid scores, the choice made on them plus the block's correction bias
            "minimax_m2", ("minimax_m2",), "MiniMaxM2Experts", _SWIGLU,
            RouterSpec(scoring="sigmoid", block_bias="e_score_correction_bias"), _all_layers, _full_attention,
        ),
        FamilySpec(  # Hunyuan-A13B: a softmax router over an fp32 linear (`gate.wg`), a shared MLP in every layer
            "hunyuan_v1_moe", ("hunyuan_v1_moe",), "HunYuanMoEV1Experts", _SWIGLU, _SOFTMAX, _all_layers,
            _full_attention,
        ),
        FamilySpec(  # Hunyuan 3 (hy_v3): MiniMax-M2's sigmoid router with the block's correction bias, scaled; MLPs
            # declared, shared experts added in fp32
            "hy_v3", ("hy_v3",), "HYV3Experts", _SWIGLU,
            RouterSpec(scoring="sigmoid", block_bias="e_score_correction_bias"), _declared_sparse_layers,
            _full_attention,
        ),
        FamilySpec(  # Laguna: a sigmoid router with its own correction bias and logit soft-capping, renormalised;
            # MLPs and attention layers declared (sliding and full), the attention output gated per head
            "laguna", ("laguna",), "LagunaExperts", _SWIGLU,
            RouterSpec(scoring="sigmoid", correction_bias="e_score_correction_bias"), _declared_sparse_layers,
            _declared_layer_types,
        ),
        FamilySpec(  # MiMo-V2-Flash: GLM-4.5's router without shared experts; sliding layers with twice the key/value
            # heads and sinks, values narrower than keys
            "mimo_v2_flash", ("mimo_v2_flash",), "MiMoV2FlashExperts", _SWIGLU, _DEEPSEEK_ROUTER,
            _declared_sparse_layers, _declared_layer_types, attention_sinks=True,
            cached_per_token=_mimo_keys_and_values,
        ),
        FamilySpec(  # AFMoE (Arcee Trinity): a sigmoid router over rows of tokens, choosing with the block's
            # `expert_bias`, renormalised and scaled; sliding and full layers declared, the attention output gated
            "afmoe", ("afmoe",), "AfmoeExperts", _SWIGLU,
            RouterSpec(scoring="sigmoid", module="router", block_bias="expert_bias", tokens_in_rows=True),
            _after_num_dense_layers, _declared_layer_types,
        ),
        FamilySpec(  # Gemma 4 (its MoE releases): routed experts beside each layer's MLP, GELU-gated, a softmax router
            # on the layer's input times per-expert scales (`router`, on the decoder layer); sliding and full layers
            # declared, the full ones with wider heads (per-layer config)
            "gemma4_text", ("gemma4_text", "gemma4"), "Gemma4TextExperts", _SWIGLU,
            RouterSpec(scoring="softmax", module="router"), _every_layer_when("enable_moe_block"),
            _declared_layer_types,
        ),
        FamilySpec(  # Mellum: Qwen3-MoE's router and q/k norms; MLPs and attention layers declared (sliding and full)
            "mellum", ("mellum",), "MellumExperts", _SWIGLU, _SOFTMAX, _declared_sparse_layers, _declared_layer_types,
        ),
        FamilySpec(  # Kolibri: a sigmoid of the chosen logits, chosen with the router's correction bias; a shared
            # expert, post-attention and post-MLP norms; sliding layers with rotary positions, full ones without
            "kolibri1", ("kolibri1",), "Kolibri1Experts", _SWIGLU,
            RouterSpec(scoring="sigmoid", correction_bias="e_score_correction_bias"), _all_layers,
            _declared_layer_types,
        ),
        FamilySpec(  # Kolibri 1.1: Kolibri's router, experts and sliding layers; its full layers (no rotary positions)
            # attend to the keys an indexer picks (`key_selection`: NVFP4-rounded scores over blocks, then keys; the
            # pick shared with later layers until the next indexer), over NVFP4-rounded keys and values, some reading
            # an earlier layer's (`kv_source_layers`); dense `mlp_only_layers`
            "kolibri1_1", ("kolibri1_1",), "Kolibri1_1Experts", _SWIGLU,
            RouterSpec(scoring="sigmoid", correction_bias="e_score_correction_bias"), _qwen3_sparse_layers,
            _declared_layer_types, adapt=(_CAPTURE_KOLIBRI_INDEXERS,), query_slot_bytes=_kolibri_selection_bytes,
            min_transformers="5.25",
        ),
        FamilySpec(  # Beam: GLM-4.5's router (its scaling applied to the block's output); the attention output gated
            # per head, full layers without rotary positions and with position-scaled queries
            "beam", ("beam",), "BeamExperts", _SWIGLU, _DEEPSEEK_ROUTER, _declared_sparse_layers,
            _declared_layer_types,
        ),
        FamilySpec(  # Flint: sigmoid scores without a bias, renormalised; an ungated shared expert; sliding layers with
            # rotary positions and full ones without, all with sinks
            "flint", ("flint",), "FlintExperts", _SWIGLU, RouterSpec(scoring="sigmoid"), _qwen3_sparse_layers,
            _declared_layer_types, attention_sinks=True,
        ),
        FamilySpec(  # Granite-MoE with sliding layers: Granite-MoE's router and multipliers, attention sinks
            "granitemoe_swa", ("granitemoe_swa",), "GraniteMoeSWAExperts", _SWIGLU, _TOP_K_THEN_SOFTMAX, _all_layers,
            _declared_layer_types, attention_sinks=True,
        ),
        FamilySpec(  # MiniCPM5-MoE: GLM-4.5's router and shared experts, MLPs declared, the attention output gated
            "minicpm5_moe", ("minicpm5_moe",), "MiniCPM5MoeExperts", _SWIGLU, _DEEPSEEK_ROUTER,
            _declared_sparse_layers, _full_attention,
        ),
        FamilySpec(  # A.X K1: DeepSeek-V3 (latent attention, router, shared experts) with a norm on the MoE block's
            # output; MLPs declared
            "axk1", ("axk1",), "AXK1Experts", _SWIGLU, _DEEPSEEK_ROUTER, _declared_sparse_layers, _full_attention,
            shared_input_linears=_MLA_SHARED_INPUTS, cached_per_token=_latent,
        ),
        FamilySpec(  # A.X K2: A.X K1's with DeepSeek-V3.2's sparse attention (a DSA indexer's keys), its attention
            # output gated from the query latent; grouped routing only where the config sets groups (not in Light)
            "axk2", ("axk2",), "AXK2Experts", _SWIGLU, _DEEPSEEK_ROUTER, _declared_sparse_layers,
            _declared_layer_types, shared_input_linears=_MLA_SHARED_INPUTS, cached_per_token=_indexed_latent,
            unquantized_linears=("weights_proj",),
        ),
        FamilySpec(  # Lara Mini: Qwen3.5-MoE's GatedDeltaNet between sliding and full attention layers, a softmax
            # router over fp32 logits, an ungated shared expert
            "lara_mini", ("lara_mini",), "LaraMiniExperts", _SWIGLU, _SOFTMAX, _all_layers, _declared_layer_types,
            _GATED_DELTA_NET,
        ),
        FamilySpec(  # Mistral 4: DeepSeek-V2's latent attention (queries scaled by position, Llama 4's rule) and
            # softmax router inside groups, a shared expert
            "mistral4", ("mistral4",), "Mistral4Experts", _SWIGLU, _DEEPSEEK_V2_ROUTER, _after_first_k_dense,
            _full_attention, shared_input_linears=_MLA_SHARED_INPUTS, cached_per_token=_latent,
        ),
        FamilySpec(  # Aria: experts stored [E, in, out], SiLU-gated whatever `hidden_act` says; top-k of the router's
            # logits, then their softmax; shared experts
            "aria", ("aria_text", "aria"), "AriaExperts",
            ExpertLayout(gate_up="concatenated", transposed=True, bias=False, activation="act_fn"), _TOP_K_THEN_SOFTMAX,
            _all_layers, _full_attention,
        ),
        FamilySpec(  # Kimi Linear: KDA linear attention (a delta rule with a forget gate per key dimension) between
            # DeepSeek-V3's latent-attention layers, its router and shared experts; MLPs declared
            "kimi_linear", ("kimi_linear",), "KimiLinearExperts", _SWIGLU, _DEEPSEEK_ROUTER, _declared_sparse_layers,
            _declared_layer_types, _KIMI_DELTA_ATTENTION, shared_input_linears=_MLA_SHARED_INPUTS,
            cached_per_token=_latent,
        ),
        FamilySpec(  # Ling 3 (bailing_hybrid): Kimi Linear's layers (KDA with its forget gate beside the mixer,
            # latent attention) with the attention outputs gated, DeepSeek-V3's router and shared experts; from
            # transformers 5.25 Step 3.7's per-layer clamps (`swiglu_limits`)
            "bailing_hybrid", ("bailing_hybrid",), "BailingHybridExperts", _CLAMPED_SWIGLU, _DEEPSEEK_ROUTER,
            _declared_sparse_layers, _declared_layer_types, _KIMI_DELTA_ATTENTION,
            shared_input_linears=_MLA_SHARED_INPUTS, cached_per_token=_latent,
        ),
        FamilySpec(  # LFM2-MoE: short-convolution layers between full-attention ones (dense MLPs first,
            # `num_dense_layers`), a sigmoid router choosing with the MoE block's `expert_bias`, renormalised, scaled
            "lfm2_moe", ("lfm2_moe",), "Lfm2MoeExperts", _SWIGLU,
            RouterSpec(scoring="sigmoid", block_bias="expert_bias", routed_scaling_factor=True),
            _after_num_dense_layers, _declared_layer_types,
        ),
        FamilySpec(  # Llama 4 (Scout, Maverick): experts stored [E, in, out] that transformers runs on every token,
            # rewritten to routed ones (`Llama4RoutedMoe`: the sigmoid of each chosen logit on the expert's input), a
            # shared expert; MoE layers declared; chunked-attention layers (a ring) with rotary positions and L2-normed
            # q/k, full ones without rotary and with position-scaled queries
            "llama4_text", ("llama4_text", "llama4"), "Llama4RoutedExperts",
            ExpertLayout(gate_up="concatenated", transposed=True, bias=False, activation="act_fn"),
            RouterSpec(scoring="sigmoid", module="router", call="route"), _declared_moe_layers, _declared_layer_types,
            adapt=(_ROUTE_LLAMA4_EXPERTS, _TEMPER_LLAMA4_QUERIES),
        ),
        FamilySpec(  # DBRX: experts flattened into 2-D matrices in a module that loops over them, moved into
            # transformers' layout (`DbrxRoutedExperts`); a softmax router whose top-k weights are divided by their
            # p-norm; fused q/k/v clipped, LayerNorms
            "dbrx", ("dbrx",), "DbrxRoutedExperts", _SWIGLU,
            RouterSpec(scoring="softmax", module="router", call="route"),
            _all_layers, _full_attention, adapt=(_ROUTE_DBRX_EXPERTS,),
        ),
        FamilySpec(  # JetMoE: experts in a module that loops over them, held by a routed-experts module instead
            # (`JetMoeRoutedExperts`), routed by the softmax of the top-k logits, an output bias; a mixture of
            # attention heads (each token's query heads from its top-k attention experts) grouped likewise
            "jetmoe", ("jetmoe",), "JetMoeRoutedExperts", _SWIGLU,
            RouterSpec(scoring="top_k_then_softmax", module="router.layer", call="route"), _all_layers,
            _full_attention, adapt=(_ROUTE_JETMOE_EXPERTS, _GROUP_JETMOE_ATTENTION_EXPERTS),
            unquantized_linears=("layer",), routed_attention_experts="self_attention.experts",
        ),
        FamilySpec(  # LongCat-Flash: decoder layers of two latent-attention sublayers (DeepSeek-V3's, LoRA-scaled) and
            # two MLPs, the MoE block reading the first MLP's input (a shortcut); a softmax router scaled, choosing with
            # a correction bias among routed and zero-compute experts (`LongcatRoutedMoe`); `num_hidden_layers` counts
            # the attention sublayers (the cache's layers), `num_layers` the decoder layers
            "longcat_flash", ("longcat_flash",), "LongcatFlashExperts", _SWIGLU,
            RouterSpec(scoring="softmax", correction_bias="e_score_correction_bias", routed_scaling_factor=True,
                       module="router", call="route"),
            _all_layers, _full_attention, shared_input_linears=_MLA_SHARED_INPUTS, cached_per_token=_latent,
            adapt=(_ROUTE_LONGCAT_EXPERTS,), zero_compute_experts_key="zero_expert_num",
            decoder_layers_key="num_layers", min_transformers="5.25",
        ),
        FamilySpec(  # Step 3.7 (step3p7; its text model step3p5): sliding and full layers of their own head counts,
            # the attention output gated per head; a sigmoid router choosing with a correction bias, renormalised;
            # SiLU experts clamped in the layers `swiglu_limits` names, a shared expert; MLPs declared. transformers
            # 5.24 leaves its experts undecorated (`_decorate_experts`)
            "step3p7", ("step3p5", "step3p7"), "Step3p7Experts", _CLAMPED_SWIGLU,
            RouterSpec(scoring="sigmoid", correction_bias="e_score_correction_bias"), _declared_sparse_layers,
            _declared_layer_types, adapt=(_undecorated("Step3p7Experts"),),
        ),
        FamilySpec(  # Nemotron-H (Nemotron 3): layers of one mixer each, Mamba2, attention (no rotary), or MoE
            # blocks of experts without a gate (relu(up)^2) beside a shared MLP, DeepSeek-V3's router; Nemotron 3
            # Nano Omni wraps its causal LM (`_CAUSAL_LM_INSIDE`)
            "nemotron_h", ("nemotron_h", "nemotron_h_omni"), "NemotronHExperts",
            ExpertLayout(gate_up="ungated", transposed=False, bias=False, activation="act_fn"), _DEEPSEEK_ROUTER,
            _nemotron_moe_layers, _nemotron_layer_kinds,
            _mamba2("mixer", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "chunk_size"),
        ),
        FamilySpec(  # Jamba: Mamba (Mamba1) layers with every eighth an attention one (no rotary positions), routed
            # experts in every other layer (a softmax router, its top-k weights not renormalised), MLPs between.
            # Verify blocks step the scan through `mamba_scan_forward`, which transformers 5.25 gives the cache
            # (5.24's multi-token scan ignores the cached state: refused there)
            "jamba", ("jamba",), "JambaExperts", _SWIGLU, RouterSpec(scoring="softmax", module="router"),
            _jamba_moe_layers, _jamba_layer_kinds,
            LinearAttentionSpec("mamba", "mamba_scan_forward", "mamba_selective_state_update", _mamba1_scan_elements,
                                _mamba1_state, rule="mamba1"),
            unquantized_linears=("dt_proj",), min_transformers="5.25",
        ),
        FamilySpec(  # MiniMax-Text-01 / M1: lightning (linear) attention layers between full-attention ones, Mixtral's
            # router and experts. Verify blocks step the lightning forward a token at a time (its own decode); its
            # model takes the target cache with `use_cache` off (it refuses any cache but its own when told)
            "minimax", ("minimax",), "MiniMaxExperts", _SWIGLU, _SOFTMAX, _all_layers, _declared_layer_types,
            LinearAttentionSpec("self_attn", "MiniMaxLightningAttention.forward",
                                "MiniMaxLightningAttention.forward", _lightning_elements, _lightning_state,
                                rule="lightning"),
            shared_input_linears=(("q_proj", "k_proj", "v_proj"), ("qkv_proj", "output_gate")), use_cache=False,
        ),
        FamilySpec(  # ZAYA1: compressed convolutional attention (CCA: queries and keys through a causal convolution
            # whose window the cache keeps, half of each value head the previous token's, a state beside the keys
            # and values), an MLP router carrying its state from layer to layer with a skip expert; masks by its own
            # layer types, the convolution's padding mask among them. transformers 5.24's hands its cache the
            # convolution's new window rather than its input (refused there)
            "zaya", ("zaya",), "ZayaExperts", _SWIGLU, RouterSpec(scoring="softmax", tokens_in_rows=True,
                                                                  after_indices=1),
            _all_layers, _hybrid_layer_kinds,
            LinearAttentionSpec("qkv_proj", "ZayaCCAProjection.forward", "ZayaCCAProjection.forward", _cca_elements,
                                _delayed_value_state, rule="delayed_value"),
            model_masks={"full_attention": "hybrid", "sliding_attention": "hybrid_sliding", "conv": "conv"},
            shared_input_linears=(("q_proj", "k_proj", "v_proj_current", "v_proj_delayed"),), min_transformers="5.25",
        ),
        FamilySpec(  # Inkling (its text model; image and audio towers beside it): a sigmoid router over the routed and
            # shared experts, choosing among the routed ones with its correction bias, the shared ones weighted by it
            # (returned after the indices); short convolutions on keys, values and both sublayers' outputs (four
            # conv windows a layer); relative logits by query-to-key distance and, in full layers, log-scaled
            # queries: positions per row (`row_positions`); sliding layers of their own heads
            "inkling", ("inkling_text", "inkling_mm_model"), "InklingExperts", _SWIGLU,
            RouterSpec(scoring="sigmoid", correction_bias="e_score_correction_bias", after_indices=1),
            _declared_sparse_layers, _hybrid_layer_kinds, model_masks={"conv": "linear_attention"},
            cached_per_token=_inkling_keys_and_values, adapt=(_POSITION_INKLING_ATTENTION,), position_bias=True,
            query_slot_bytes=_position_bias_bytes,
        ),
        _INKLING2,
        # Inkling 2 with looped layers: its layers from `loop_layer_index_start` to `loop_layer_index_end` run
        # `loop_num_passes` times a forward, each pass after the first with caches of its own after the model's
        # layers (`_looped_hybrid_layer_kinds`); layers visited, MoE calls and hidden states count every pass
        replace(_INKLING2, name="inkling2_loop", model_types=("inkling2_loop_text", "inkling2_loop"),
                experts_class="Inkling2LoopExperts", attention_kinds=_looped_hybrid_layer_kinds,
                decoder_layers_key="total_num_hidden_layers", unquantized_linears=("message_gate.down_proj",),
                held_per_token=_looped_states),
        FamilySpec(  # DeepSeek-V4: sliding-window attention (one key/value head, its keys its values, sinks) plus
            # compressed entries of earlier windows (HCA: all; CSA: those a lightning indexer picks), per row over our
            # cache (`compressed_attention`); hyper-connection streams; sqrt-softplus scores with a correction bias,
            # the first layers routed by token id (`tid2eid`); experts with the gate clamped before SiLU, a shared one
            "deepseek_v4", ("deepseek_v4",), "DeepseekV4Experts", _GATE_CLAMPED_SWIGLU,
            RouterSpec(scoring="sqrtsoftplus", correction_bias="e_score_correction_bias", routed_scaling_factor=True),
            _all_layers, _compressed_everywhere, attention_sinks=True, cached_per_token=_compressor_projections,
            compressed_entries=_compressed_entries, adapt=(_ROW_DEEPSEEK_V4_COMPRESSORS,),
            query_slot_bytes=_compressed_entries_bytes,
        ),
        FamilySpec(  # Granite 4.0-H (GraniteMoeHybrid): Mamba2 layers between full-attention ones (without rotary
            # positions as released), Granite-MoE's router and multipliers, a shared MLP beside the experts everywhere
            "granitemoehybrid", ("granitemoehybrid",), "GraniteMoeHybridExperts", _SWIGLU, _TOP_K_THEN_SOFTMAX,
            _every_layer_when("num_local_experts"), _declared_layer_types, _MAMBA2,
        ),
        FamilySpec(  # Phi-3.5-MoE: Mixtral's layout and window rule, a sparsemixer router (top-2 by masked softmaxes)
            "phimoe", ("phimoe",), "PhimoeExperts", _SWIGLU, RouterSpec(scoring="softmax", module="router"),
            _all_layers, _window_everywhere,
        ),
        FamilySpec(  # ERNIE-4.5-MoE: softmax scores, the choice made on them plus `moe_statics`' bias, renormalised
            "ernie4_5_moe", ("ernie4_5_moe",), "Ernie4_5_MoeExperts", _SWIGLU, _ERNIE_ROUTER, _ernie_sparse_layers,
            _full_attention,
        ),
        FamilySpec(  # ERNIE-4.5-VL (text prompts): ERNIE-4.5's router and experts under `text_moe`, image tokens' own
            # experts beside them (`vision_moe`), shared experts, MLPs declared; rotary positions in three sections
            "ernie4_5_vl_moe", ("ernie4_5_vl_moe", "ernie4_5_vl_moe_text"), "Ernie4_5_VLMoeMoeExperts", _SWIGLU,
            _ERNIE_ROUTER, _declared_sparse_layers, _full_attention, image_experts="vision_moe",
        ),
    )
}

_BY_MODEL_TYPE = {model_type: spec for spec in FAMILIES.values() for model_type in spec.model_types}
_BY_EXPERTS_CLASS = {spec.experts_class: spec for spec in FAMILIES.values()}
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def auto_model_class(config):
    """transformers' auto class that builds a checkpoint of `config`: its causal LM, or the image-text-to-text model
    of a family released only so (Qwen3-VL-MoE, GLM-4.5V), whose text prompts `optimize` runs; Mistral 4's causal LM
    too, which transformers maps only there."""
    causal = type(config) in transformers.AutoModelForCausalLM._model_mapping
    return transformers.AutoModelForCausalLM if causal else transformers.AutoModelForImageTextToText


def builds_causal_lm(config) -> bool:
    """Whether `auto_model_class` builds `config` as a causal LM (the decoder's weights at the top level, as quantized
    checkpoints keep them): anything mapped as one, and Mistral 4's `Mistral4ForCausalLM` mapped as image-text."""
    model_class = auto_model_class(config)
    mapping = model_class._model_mapping
    return model_class is transformers.AutoModelForCausalLM or (
        type(config) in mapping and mapping[type(config)].__name__.endswith("ForCausalLM"))


class UnsupportedFamilyError(ValueError):
    pass


def supported_families() -> list[str]:
    return sorted(FAMILIES)


def _unsupported(what: str) -> UnsupportedFamilyError:
    return UnsupportedFamilyError(
        f"{what} is a Mixture-of-Experts model that dflash-compile does not support yet. "
        f"Supported families (config.model_type): {', '.join(supported_families())}. "
        "Compile it with another backend, or add a FamilySpec to dflash_compile/families.py."
    )


def is_experts_module_class(cls: type) -> bool:
    """True for any transformers routed-experts class (decorated with `@use_experts_implementation`)."""
    forward = getattr(cls, "forward", None)
    return hasattr(cls, "_apply_gate") and hasattr(forward, "__wrapped__")


def spec_for_experts_class(cls: type) -> FamilySpec | None:
    """The family whose routed experts are `cls`; None for a module that is not routed experts.

    Raises UnsupportedFamilyError for routed experts of a family the registry does not know.
    """
    spec = _BY_EXPERTS_CLASS.get(cls.__name__)
    if spec is None and is_experts_module_class(cls):
        raise _unsupported(f"{cls.__name__} (from {cls.__module__})")
    return spec


def _recognised_experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Experts modules of a registry class inside the text decoder, but a layer's image experts (ERNIE-4.5-VL's): a
    vision tower may hold experts of the decoder's class (dots.llm3's), which generating text never runs."""
    decoder = _text_decoder_prefix(model)
    found = {}
    for name, module in model.named_modules():
        spec = spec_for_experts_class(type(module))
        if (spec and name.startswith(decoder)
                and not (spec.image_experts and name.rpartition(".")[0].endswith("." + spec.image_experts))):
            found[name] = module
    return found


def _text_decoder_prefix(model: torch.nn.Module) -> str:
    """The qualified name of `model`'s text decoder (transformers' `get_decoder`), with its dot; "" for the whole
    model."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    return next((name + "." for name, module in model.named_modules() if module is decoder and name), "")


def adapt_model(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its family's `adapt` applied (in place; again changes nothing). `experts_modules` applies it; so
    must anything that traces a model before looking for its experts (`optimize`, `explain`)."""
    spec = spec_for_model(model)
    for adapter in spec.adapt if spec is not None else ():
        adapter(model)
    return model


def traced_unadapted(model: torch.nn.Module) -> list[str]:
    """The `reason` of each adapter of `model`'s family that has modules left to rewrite (a graph traced from it would
    not dispatch their experts as the registry does, or would scale Llama 4's queries by one length); empty when
    adapted."""
    spec = spec_for_model(model)
    return [adapter.reason for adapter in spec.adapt if adapter.needed(model)] if spec is not None else []


def experts_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The routed-experts modules of a model by name, as the registry recognises them (by class), its family's
    `adapt` applied first (Llama 4's experts are routed experts only after it)."""
    return _recognised_experts(adapt_model(model))


def _block_and_router(model: torch.nn.Module, experts_name: str) -> tuple[torch.nn.Module, RouterSpec]:
    """The MoE block holding the routed-experts module `experts_name`, and its family's router spec."""
    spec = spec_for_experts_class(type(model.get_submodule(experts_name)))
    return model.get_submodule(experts_name.rpartition(".")[0]), spec.router


def router_of(model: torch.nn.Module, experts_name: str) -> torch.nn.Module:
    """The router module that picks the experts of the routed-experts module `experts_name` (its MoE block's
    registry-named sibling)."""
    block, router = _block_and_router(model, experts_name)
    return block.get_submodule(router.module)


def routing_of(model: torch.nn.Module, experts_name: str) -> Callable[[torch.Tensor], tuple] | None:
    """hidden [T, H] -> the router's outputs (expert indices last), as the MoE block of the routed-experts module
    `experts_name` calls its router: with the block's `RouterSpec.block_bias` where the family has one (read at each
    call: moving the model to a device replaces a buffer such as MiniMax-M2's; None where the block keeps none, as
    LFM2-MoE's without `use_expert_bias` passes), the tokens as one row where it takes rows. None for a router that
    routes by token ids (DeepSeek-V4's hash routers: hidden states alone do not say)."""
    block, router = _block_and_router(model, experts_name)
    module = getattr(block, router.call) if router.call else block.get_submodule(router.module)
    if "input_ids" in inspect.signature(getattr(module, "forward", module)).parameters:  # a module, or a method
        return None

    def route(hidden: torch.Tensor) -> tuple:
        bias = {} if router.block_bias is None else {router.block_bias: getattr(block, router.block_bias, None)}
        outputs = module(hidden[None] if router.tokens_in_rows else hidden, **bias)
        return outputs[:len(outputs) - router.after_indices]

    return route


# model types whose text one of their sub-models generates, `optimize` taking that one: Qwen3-Omni's thinker (its
# talker turns the thinker's states into speech, another generation)
_TEXT_GENERATED_BY = {"qwen3_omni_moe": "thinker"}
# releases that wrap a whole causal LM (its decoder and head) beside their towers and run text prompts through it
# alone: Nemotron-H Omni's `language_model` (Nemotron-H) beside its vision and audio towers
_CAUSAL_LM_INSIDE = {"nemotron_h_omni": "language_model"}


def text_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM that generates `model`'s text: a wrapper's (`_CAUSAL_LM_INSIDE`), whose text prompts give the
    wrapper's tokens, else `model` itself."""
    part = _CAUSAL_LM_INSIDE.get(getattr(getattr(model, "config", None), "model_type", None))
    return model.get_submodule(part) if part else model


def spec_for_config(config) -> FamilySpec | None:
    """The family of a model config; None for a dense model; UnsupportedFamilyError for an unknown MoE family, or
    for a model whose text one of its sub-models generates (`_TEXT_GENERATED_BY`)."""
    part = _TEXT_GENERATED_BY.get(getattr(config, "model_type", None))
    if part:
        raise UnsupportedFamilyError(
            f"model_type {config.model_type!r} generates text with its `{part}` and speech with its talker, which "
            f"dflash-compile does not run: optimize the {part}, dflash_compile.optimize(model.{part}, ...), for text")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for cfg in (config, text_config):
        spec = _BY_MODEL_TYPE.get(getattr(cfg, "model_type", None))
        if spec is not None:
            if not spec.installed():
                raise UnsupportedFamilyError(f"model_type {cfg.model_type!r} needs transformers >= "
                                             f"{spec.min_transformers} (installed: {transformers.__version__}): pip "
                                             "install -U transformers")
            return spec
    if any((getattr(text_config, key, 0) or 0) > 0 for key in _EXPERT_COUNT_KEYS):
        raise _unsupported(f"model_type {config.model_type!r}")
    return None


def decoder_layers_key(config) -> str:
    """The setting of a (text) config that counts its decoder layers: its family's `decoder_layers_key`,
    `num_hidden_layers` for every other model."""
    spec = spec_for_config(config)
    return spec.decoder_layers_key if spec else "num_hidden_layers"


def zero_compute_experts(config) -> int:
    """How many of the experts a (text) config's routers choose from compute nothing (its family's
    `zero_compute_experts_key`; none for most)."""
    spec = spec_for_config(config)
    key = spec.zero_compute_experts_key if spec else None
    return getattr(config, key) or 0 if key else 0


def decoder_layers(config) -> int:
    """The decoder layers of a model config (of its text decoder), as its hidden states count them."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text_config, decoder_layers_key(text_config))


def spec_for_model(model: torch.nn.Module) -> FamilySpec | None:
    config = getattr(model, "config", None)
    return spec_for_config(config) if config is not None else None


def warn_dense(what: str) -> None:
    warnings.warn(
        f"{what} has no routed experts: dflash-compile compiled it with 0 expert_dispatch matches. "
        f"Expert dispatch and offload apply to these families: {', '.join(supported_families())}.",
        stacklevel=3,
    )
