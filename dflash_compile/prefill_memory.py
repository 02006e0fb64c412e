"""Device memory a prompt's forward (the prefill) holds beyond the weights and the caches, as an upper bound read off
the model's own modules and the paths its layers take, so that `generate` can pick a prefill chunk that fits the
device's free memory before it allocates anything, or refuse the prompt naming what it needs.

    bytes(rows, chunk, prompt) = rows * chunk * (layer + experts(rows * chunk))       one decoder layer at a time
                               + max(rows * chunk rounded up to 64 * linear_rule,    a linear-attention layer's
                                     rows * chunk * stepped_rule if stepped)
                               + rows * prompt * (prompt_token + slot)               held for the whole prompt
                               + rows * chunk * prompt * mask entry                  masked chunks only
                               + rows * chunk * prompt * indexed entry               DSA families
                               + experts' weight buffer(rows * chunk)                dequantizing path only

- layer: the largest decoder layer's activations per token, as if every one of its linears' outputs (attention,
  routers, shared experts, dense MLPs) were held at once, with the residual stream and the routers' fp32 scores, and
  what the forward holds across layers (`FamilySpec.held_per_token`: looped Inkling 2's block states and messages).
- linear_rule: a linear-attention layer's chunked rule per token (`LinearAttentionSpec.chunked_elements_per_token`),
  over the chunk padded to the rule's 64-token chunks (Kimi Linear's decay masks make that count); or, for chunks of
  at most 64 tokens after the first, which `linear_attention` steps token by token, stepped_rule: the state kept
  after each token, 4 times (`LinearAttentionSpec.state_elements`; Qwen3.5's 32 x 128 x 128 fp32, 8 MiB a token).
- experts: packed experts' temporaries on the path `kernels.moe.fused_moe` takes at that many pairs per expert: its
  fused launches' activated rows and fp32 down rows, or from DEQUANTIZE_PAIRS the dequantizing path's gathered rows,
  grouped GEMM outputs and their concatenation, plus the buffer its experts are dequantized into (a fixed term: a
  shorter chunk that stays on the fused launches does without it). Resident bf16 experts run transformers' own
  experts in the (eager) prefill: gathered rows, gate/up, the activation's intermediates, down rows. Offloaded
  experts count as packed ones: a prompt's experts are staged into slots and read as the layer's (`OffloadedExperts`).
- prompt_token: the drafter's features of every prompt token (the chunks' and their concatenation, then the
  left-aligned copy) and the drafter's forward over them.
- slot: a latent-attention layer's keys and values expanded over every visible slot
  (`FamilySpec.expanded_per_slot`); the last chunk sees the whole prompt.
- mask entry: a chunk that takes [rows, 1, chunk, slots] masks (a left-padded batch shorter than ROWS_WITHOUT_MASKS)
  holds them per attention kind, folded over the query groups.
- indexed entry: a DSA layer's mask (always given), its indexer's scores of every (query, slot) per indexer head
  and what it makes of them (`FamilySpec.indexed_per_query_slot`).

Measured on the H200 (docs/benchmarks.md "Prefill memory", bench/prefill.py's peak column, which now prints this
estimate beside it): gpt-oss-20b, 4 layers, MXFP4 experts, an 8192-token prompt in one forward 2140 MiB beyond what
was allocated before, in chunks of 2048 193 MiB; the estimate is 2570 and 266 MiB (1.20x and 1.38x). On a CPU, where
the tests measure every family's prefill op by op, it is 1.02-2.07x the peak (tests/test_prefill_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from .families import KEYED_KINDS, experts_modules, layer_configs, routed_top_k, spec_for_model
from .kernels.moe import DEQUANTIZE_EXPERT_ELEMENTS, DEQUANTIZE_PAIRS, pairs_per_routed_expert
from .linear_attention import STEPWISE_TOKENS as RULE_CHUNK
from .packed import expert_weights

RESIDUAL_STREAM = 4  # hidden-wide tensors a decoder layer holds besides its linears' outputs: input, residual, norms
FP32 = 4


@dataclass(frozen=True)
class RoutedExperts:
    """What sizes the routed experts' prefill temporaries: their stored format, shape and path."""

    format: str  # "dense", "mxfp4" or "fp8_block"
    experts: int
    intermediate: int  # I: gate/up has 2I rows
    hidden: int
    top_k: int
    grouped_mm: bool  # resident unpacked experts, which the (eager) prefill runs through transformers' experts

    def bytes(self, tokens: int, itemsize: int) -> tuple[int, int]:
        """(bytes per token, fixed bytes) of one MoE call over `tokens` tokens."""
        k, i, h = self.top_k, self.intermediate, self.hidden
        if self.grouped_mm:  # gathered rows, gate/up, the activation's intermediates, down rows, weighted, the sum
            return k * (3 * h + 9 * i) * itemsize + h * itemsize, 0
        if pairs_per_routed_expert(tokens, k, self.experts) < DEQUANTIZE_PAIRS[self.format]:
            return k * (i * itemsize + h * FP32) + 2 * h * itemsize, 0  # activated rows, fp32 down rows, x, the sum
        # gathered rows, gate/up, activated, down rows and their concatenation, the sum, 3 int64 orders; the buffer
        group = max(1, DEQUANTIZE_EXPERT_ELEMENTS // (2 * i * h))
        buffer = min(self.experts, tokens * k, group) * 2 * i * h * itemsize
        return k * (3 * h + 3 * i) * itemsize + h * itemsize + 3 * 8 * k, buffer


@dataclass(frozen=True)
class PrefillActivations:
    itemsize: int
    layer: int  # bytes per token of the largest decoder layer, routed experts aside
    linear_rule: int  # bytes per token, padded to the rule's chunks, of a linear-attention layer's chunked rule
    stepped_rule: int  # bytes per token of a chunk the layer steps token by token: the state after each, 4 times
    experts: RoutedExperts | None
    prompt_token: int  # bytes per prompt token held through the prefill
    slot: int  # bytes per visible slot of a latent-attention layer's expansion
    mask_entry: int  # bytes per (query, slot) of a masked chunk
    indexed_entry: int  # bytes per (query, slot) of a DSA layer, masked or not

    def bytes(self, rows: int, chunk: int, prompt: int, masked: bool) -> int:
        tokens = rows * chunk
        per_token, fixed = self.experts.bytes(tokens, self.itemsize) if self.experts else (0, 0)
        masks = tokens * prompt * ((self.mask_entry if masked else 0) + self.indexed_entry)
        padded = rows * -(-chunk // RULE_CHUNK) * RULE_CHUNK
        stepped = tokens * self.stepped_rule if chunk < prompt and chunk <= RULE_CHUNK else 0  # chunks with a state
        return (tokens * (self.layer + per_token) + max(padded * self.linear_rule, stepped)
                + rows * prompt * (self.prompt_token + self.slot) + masks + fixed)

    @classmethod
    def of(cls, model: torch.nn.Module, feature_layers: int, drafter: bool):
        """The estimate for `model` as it is now (resident, packed or offloaded experts), with a drafter conditioned
        on `feature_layers` of its layers."""
        config = model.config.get_text_config()
        spec = spec_for_model(model)
        itemsize = model.dtype.itemsize
        linear = spec.linear_attention
        chunked_rule = linear.chunked_elements_per_token(config) * FP32 if linear else 0
        # the states kept (a list of them, their stack, the update's temporaries: 3.3 a token measured on Mamba2) when a
        # chunk after the first is stepped
        stepped_rule = 4 * linear.state_elements(config) * FP32 if linear else 0
        experts = _routed_experts(model, config)
        routers = experts.experts if experts else 0  # a router's scores per token, one per expert
        layer = max((_linear_outputs(decoder) for decoder in model.modules()
                     if isinstance(decoder, GradientCheckpointingLayer)), default=0)
        held = spec.held_per_token(config) if spec.held_per_token else 0  # looped Inkling 2's states across passes
        layer = (2 * layer + RESIDUAL_STREAM * config.hidden_size) * itemsize + (2 * routers + held * config.hidden_size
                                                                                 ) * FP32
        kinds = set(spec.attention_kinds(config)) & set(KEYED_KINDS)
        groups = max(view.num_attention_heads // view.num_key_value_heads for view in layer_configs(config))
        features = (3 * feature_layers + 4) * config.hidden_size * itemsize if drafter else 0
        return cls(itemsize=itemsize, layer=layer, linear_rule=chunked_rule, stepped_rule=stepped_rule, experts=experts,
                   prompt_token=features, slot=spec.expanded_per_slot(config) * itemsize,
                   mask_entry=len(kinds) * (1 + groups) * itemsize,
                   indexed_entry=spec.indexed_per_query_slot(config, itemsize))


def _linear_outputs(decoder: torch.nn.Module) -> int:
    """Output features of every linear of a decoder layer (routed experts are no linears: their 3-D weights)."""
    return sum(out for module in decoder.modules() if isinstance(out := getattr(module, "out_features", None), int))


def _routed_experts(model: torch.nn.Module, config) -> RoutedExperts | None:
    modules = experts_modules(model)
    if not modules:
        return None
    module = next(iter(modules.values()))
    offload = getattr(module, "dflash_offload", None)
    if offload is not None:
        offloaded, layer = offload
        gate_up, down = offloaded.layers[layer].on_host
    else:
        gate_up, down = expert_weights(module)
    experts, hidden, intermediate = down.shape
    return RoutedExperts(gate_up.format, experts, intermediate, hidden, routed_top_k(config),
                         grouped_mm=offload is None and gate_up.format == "dense")
