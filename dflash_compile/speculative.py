"""DFlash speculative decoding: prefill, then draft a block -> verify-commit -> repeat.

The verify-commit step is one compiled graph per (batch, block size): the target runs over
`[anchor, d1 .. d_{B-1}]`, `dflash::greedy_accept` finds each row's accepted drafts, `dflash::kv_commit` keeps
`accepted + 1` tokens per active row and so rolls the rest back, and the captured hidden states at the drafter's
target layers come out as graph outputs. Lengths and positions are device tensors; the only host sync per step is
reading the accepted lengths afterwards to assemble the output and decide when to stop.

Without a drafter the same step runs with a block of one token: plain greedy decoding on the compiled step.

On CUDA each step shape, and the drafter's calls, replay from CUDA graphs captured by `StepGraphs` (the host issues
a step in ~0.03 ms instead of torch.compile's CUDA-graph trees' ~0.5 ms of guards and input checks).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field

import torch

from .adaptive import WidthChooser
from .attention import SEEN_SLOTS, grouped_attention, unmasked_chunks, unmasked_is_causal
from .backend import dflash_backend_with
from .cache import RowCache, TargetCache
from .drafter import DFlashDrafter, context_features
from .families import KEYED_KINDS, RECURRENT_KINDS, RING_KINDS, STATELESS_KINDS, ring_window, spec_for_model
from .linear_attention import stepwise_linear_attention
from .prefill_memory import PrefillActivations
from .sampling import (DECAY, FORCE, HOLD, LengthProcessors, Sampler, SequenceBiases, begin_suppressed,
                       check_generation_config, check_ngram_size, check_repetition_penalty, eos_decayed, eos_held_back,
                       forced, processed_probs, repeated_ngrams_banned, repetition_penalized, seen_tokens,
                       sequence_biased, warpers)
from .step_graphs import StepGraphs


@dataclass
class GenerationStats:
    """Statistics of the last `generate` call. `accepted[s][b]` is row b's accepted drafts at verify step s
    (None once the row has finished)."""

    accepted: list[list[int | None]] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0
    block_size: int = 1
    widths: list[int] = field(default_factory=list)  # tokens verified at each step (adaptive width; 1 = no drafts)
    step_seconds: list[float] = field(default_factory=list)  # wall time of each step, drafting included
    prefill_chunk: int = 0  # tokens per prefill forward (`SpeculativeDecoder._prefill_chunk`)

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean accepted length: tokens committed per verify step (accepted drafts + the bonus token)."""
        committed = [a + 1 for step in self.accepted for a in step if a is not None]
        return sum(committed) / len(committed) if committed else 0.0

    @property
    def tokens_per_second(self) -> float:
        return sum(self.new_tokens) / self.seconds if self.seconds else 0.0


def _left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  read_from: int | None = None) -> torch.Tensor:
    """Each row's count of padding tokens [b] from `attention_mask` (None: none), refused unless it pads on the left
    and leaves a row at least one token. `read_from`: the pad id whose tokens the mask was read from, where no
    attention_mask was given (the refusal then says so)."""
    if attention_mask is None:
        return torch.zeros(input_ids.shape[0], dtype=torch.int64, device=input_ids.device)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {list(attention_mask.shape)} differs from input_ids "
                         f"{list(input_ids.shape)}")
    mask = attention_mask.bool()
    pad = (~mask).sum(dim=1)
    left_aligned = torch.equal(mask, torch.arange(mask.shape[1], device=mask.device)[None, :] >= pad[:, None])
    empty_row = bool((pad == mask.shape[1]).any())
    if read_from is not None and (empty_row or not left_aligned):
        raise ValueError(f"without an attention_mask, generate reads the pad token id {read_from} as padding, and "
                         "this prompt holds it after a row's first real token (or in every place of a row): pass "
                         "attention_mask (left padding)")
    if not left_aligned:
        raise ValueError("attention_mask must be left padding (zeros then ones per row); set "
                         "tokenizer.padding_side = 'left'")
    if empty_row:
        raise ValueError("a row of attention_mask is all zeros: every prompt needs at least one token")
    return pad.to(torch.int64)


def _left_aligned(chunks: list[tuple[torch.Tensor | None, torch.Tensor]]):
    """Several steps' (features [b, w, F], kept [b]) as one left-aligned (features, kept): each row's kept tokens in
    order, as if each step had been added to the drafter's context on its own."""
    if len(chunks) == 1:
        return chunks[0]
    kept = torch.stack([k for _, k in chunks]).sum(dim=0)
    if chunks[0][0] is None:  # a drafter that takes no target features
        return None, kept
    features = torch.cat([f for f, _ in chunks], dim=1)
    valid = torch.cat([torch.arange(f.shape[1], device=k.device)[None, :] < k[:, None] for f, k in chunks], dim=1)
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # valid tokens first, in order
    return features.gather(1, order[:, :, None].expand(-1, -1, features.shape[-1])), kept


def _min_tokens(min_new_tokens: int | None, min_length: int | None, prompt: int) -> int:
    """New tokens before which a row's EOS is held back, as generate takes its two settings: `min_new_tokens`, else
    `min_length` counting the (padded) prompt (generate replaces min_length by min_new_tokens where both are set)."""
    for name, value in (("min_new_tokens", min_new_tokens), ("min_length", min_length)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return min_new_tokens if min_new_tokens is not None else max((min_length or 0) - prompt, 0)


def _new_tokens(max_new_tokens: int | None, max_length: int | None, prompt: int, max_positions: int | None) -> int:
    """How many new tokens generate gives a row: `max_new_tokens` where set, else `max_length` less the (padded)
    prompt, else transformers' default of 20 (fewer where the model's positions end first)."""
    if max_new_tokens is not None:
        return max_new_tokens
    if max_length is not None:
        if max_length <= prompt:
            raise ValueError(f"max_length {max_length} leaves no new token after a prompt of {prompt} tokens; set "
                             "max_new_tokens")
        return max_length - prompt
    return min(DEFAULT_NEW_TOKENS, max_positions - prompt) if max_positions else DEFAULT_NEW_TOKENS


def _id_list(setting) -> list[int]:
    """A generate setting of one token id or several (eos_token_id, forced_eos_token_id, ...), in the order given."""
    if setting is None:
        return []
    return [int(t) for t in (setting if isinstance(setting, (list, tuple, set)) else [setting])]


def _token_ids(setting) -> set[int]:
    """A generate setting of one token id or several as a set."""
    return set(_id_list(setting))


def _pads_the_prompt(input_ids: torch.Tensor, pad_token_id, eos: set[int]) -> bool:
    """Whether generate, given no attention_mask, reads the pad id's tokens as padding: the pad id is set, is no EOS
    id and occurs in the prompt (the verify steps then take them as left padding, `_left_padding`)."""
    return pad_token_id is not None and int(pad_token_id) not in eos and bool((input_ids == pad_token_id).any())


def _first_id(eos_token_id) -> int:
    """generate's pad id where none is set: the first EOS id in the order given (0 without one: no row finishes)."""
    ids = _id_list(eos_token_id)
    return ids[0] if ids else 0


def _forced_ids(forced_eos_token_id, forced_bos_token_id, suppress_tokens,
                vocabulary: int) -> tuple[set[int], int | None]:
    """generate's forced EOS ids and forced BOS id, refused outside [0, vocabulary), or where `suppress_tokens`
    (which generate applies after them) bans them: no token would be left to choose."""
    forced_eos = _token_ids(forced_eos_token_id)
    forced = forced_eos | _token_ids(forced_bos_token_id)
    if any(not 0 <= t < vocabulary for t in forced):
        raise ValueError(f"forced_eos_token_id / forced_bos_token_id must be token ids in [0, {vocabulary}), got "
                         f"{forced_eos_token_id!r} / {forced_bos_token_id!r}")
    if clash := sorted(forced & set(suppress_tokens or ())):
        raise ValueError(f"token(s) {clash} are forced (forced_eos_token_id / forced_bos_token_id) and also in "
                         "suppress_tokens: model.generate would leave no token to choose there; drop one of them")
    return forced_eos, None if forced_bos_token_id is None else int(forced_bos_token_id)


def _length_penalty(setting) -> tuple[int, float] | None:
    """generate's exponential_decay_length_penalty: (start index, decay factor), or None."""
    if setting is None:
        return None
    if not (isinstance(setting, (tuple, list)) and len(setting) == 2 and isinstance(setting[0], int)
            and isinstance(setting[1], (int, float))):
        raise ValueError(f"exponential_decay_length_penalty must be (start_index: int, decay_factor: float), got "
                         f"{setting!r}")
    return setting[0], float(setting[1])


DEFAULT_NEW_TOKENS = 20  # transformers' generate without max_new_tokens or max_length
STEP_GRAPHS = 64  # compiled verify steps kept per decoder code object before Dynamo falls back to eager
DRAFTER_BACKEND = "inductor"  # the drafter's calls: Inductor alone (no experts to rewrite)
SMALLEST_CACHE = 16
# Tokens per masked prefill forward of a model with sliding-window layers (a left-padded batch shorter than
# ROWS_WITHOUT_MASKS; others, and prompts that go unmasked, take the prompt in one unless `prefill_chunk` is given): a
# masked chunk attends densely over its ring and its own keys, and every chunk reads every expert again. H200,
# 24-layer gpt-oss-20b, MXFP4 experts, sinks by SDPA (session 36, bench/prefill.py): a 2048-token prompt 150 ms in
# chunks of 1024 against 76 in one; 4096 tokens 179 / 152 / 162 ms in chunks of 1024 / 2048 / 4096 (fused experts),
# 8192 tokens 533 / 320 / 289 / 302 ms in chunks of 1024 / 2048 / 4096 / 8192 (4096: experts dequantized for cuBLAS,
# `kernels.moe`'s DEQUANTIZE_PAIRS); transformers' one forward 192 / 588 / 1929 ms. Unmasked (session 38): 8192 tokens
# 293.7 / 216.2 / 180.0 ms in chunks of 2048 / 4096 / 8192, 12288 tokens 350.3 / 264.4 in chunks of 4096 / 12288.
PREFILL_CHUNK = 4096
# The shortest chunk `_prefill_chunk` halves a prompt's chunks down to when the device's free memory cannot hold the
# prefill's activations; a prompt that does not fit even so is refused rather than run in a great many forwards,
# each of which reads every expert.
SMALLEST_PREFILL_CHUNK = 64
# A left-padded prompt at least this long attends row by row without masks (`attention.row_starts`: each row's
# fused causal kernels from its first real token) rather than batched under a [b, 1, t, slots] mask: per row and
# layer a handful of launches against the masked path's dense t x slots term. H200, 4 rows, 8 layers, rows / masks
# (`bench/prefill.py --batch 4 --masks rows explicit`, session 39): gpt-oss-20b (MXFP4) at 256 / 512 / 1024 / 2048
# tokens 42.9 / 34.3 / 36.9 / 58.7 ms against 24.5 / 24.0 / 35.5 / 62.4; Qwen3-30B-A3B (bf16) at 256 / 1024 / 2048
# 16.0 / 25.2 / 38.8 against 13.7 / 24.5 / 43.3.
ROWS_WITHOUT_MASKS = 2048


def cache_capacity(tokens: int) -> int:
    """Slots of a generation's caches: the next power of two >= tokens, at least SMALLEST_CACHE. The compiled step's
    shapes follow it, so generations whose prompt + max_new_tokens fall in one bucket share one graph (exact sizes
    made Dynamo compile a new step for every new length, and fall back to eager after 8)."""
    return max(SMALLEST_CACHE, 1 << (tokens - 1).bit_length())


@contextlib.contextmanager
def generation_context(model):
    """What `generate` runs the target in: inference mode (no autograd dispatch: 14% faster eager steps on a CPU),
    its attention on the cache's keys and values as they are (`grouped_attention`) and its linear-attention layers
    verifying token by token (`stepwise_linear_attention`). Benchmarks of single steps run them in it too."""
    with torch.inference_mode(), grouped_attention(model), stepwise_linear_attention(model):
        yield


def _in_inference_mode(generate):
    """`generate` run in `generation_context`, its result returned as an ordinary tensor, which the caller may
    modify in place."""

    @functools.wraps(generate)
    def run(self, *args, **kwargs) -> torch.Tensor:
        with generation_context(self.model):
            tokens = generate(self, *args, **kwargs)
        return tokens.clone()

    return run


def default_mode(model) -> str:
    """torch.compile's mode for the verify step when none is given: "reduce-overhead" (CUDA graphs; around the
    offload ops for offloaded experts) for a model on CUDA, where a step launched op by op from Python is bound by
    launch overhead (H200, docs/benchmarks.md: gpt-oss-20b decode steps 34.3 ms without graphs, 6.67 ms with;
    Qwen3-30B-A3B with 25% of its experts resident 65.5 -> 83.7 decode tokens/s), "default" elsewhere."""
    return "reduce-overhead" if _on_cuda(model) else "default"


def _on_cuda(model) -> bool:
    return next(model.parameters()).device.type == "cuda"


def device_free_bytes(device) -> int | None:
    """Bytes a new allocation on `device` can take: the driver's free memory and the blocks torch's caching
    allocator holds unused. None off CUDA (host memory is not budgeted)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class SpeculativeDecoder:
    def __init__(self, model, drafter: DFlashDrafter | None, layer_ids: tuple[int, ...], compile: bool = True,
                 mode: str | None = None, prefill_chunk: int | None = None, adaptive: bool | WidthChooser = True,
                 fused_experts: bool = True):
        self.model = model
        self.drafter = drafter
        self.layer_ids = layer_ids
        self.block_size = drafter.config.block_size if drafter is not None else 1
        # how many drafts each step verifies, from measured step times and acceptance (dflash_compile.adaptive)
        self.chooser = None
        if isinstance(adaptive, WidthChooser):
            if adaptive.block_size != self.block_size:
                raise ValueError(f"the WidthChooser is for block size {adaptive.block_size}, the drafter's is "
                                 f"{self.block_size}")
            self.chooser = adaptive
        elif adaptive and self.block_size > 1:  # offloaded experts make step times vary by themselves: their mean
            offloaded = hasattr(model, "dflash_offload")
            self.chooser = WidthChooser(self.block_size, timing="mean" if offloaded else "median")
        config = model.config.get_text_config()
        self.hidden_size = config.hidden_size  # a residual stream's width (`context_features`)
        spec = spec_for_model(model)
        kinds = spec.attention_kinds(config)
        self.attention_kinds = kinds
        self.cached_per_token = [spec.cached_per_token(config, kind, layer) for layer, kind in enumerate(kinds)]
        self.compressed_entries = [entries for layer in range(len(kinds))
                                   for entries in spec.compressed_entries(config, layer)]  # (rate, width) each
        self.prefill_chunk = prefill_chunk
        self.prefill_activations: PrefillActivations | None = None  # made by the first prefill planned on CUDA
        # one mask per kind of layer that attends or keeps a state (`TargetCache.masks`)
        self.windows = {kind: ring_window(config, kind) for kind in dict.fromkeys(kinds) if kind not in STATELESS_KINDS}
        self.ring_layers = [i for i, kind in enumerate(kinds) if kind in RING_KINDS and self.windows.get(kind)]
        self.per_kind_masks = getattr(config, "layer_types", None) is not None  # the model takes {kind: mask}
        self.mask_names = spec.model_masks or {}  # the model's names for our masks (`FamilySpec.model_masks`)
        # masks the model takes beside its layers' kinds' (ZAYA1's convolution's padding mask)
        self.windows.update({kind: None for kind in self.mask_names if kind not in self.windows
                             and kind in RECURRENT_KINDS})
        self.use_cache = spec.use_cache
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.verify_step = self._verify_step
        self.backend = dflash_backend_with(fused_experts=fused_experts)
        self.mode = default_mode(model) if mode is None else mode
        self.draft_logits = getattr(drafter, "draft_logits", None)  # a DFlash drafter's forward (not an oracle's)
        self.context_step = None  # the drafter's add_context for at most a block of tokens, compiled
        if compile:  # one graph per (batch, verify width, cache capacity, model): more than Dynamo's default 8
            graphed = self.mode == "reduce-overhead" and self._captures_steps()
            self.verify_step = self._compiled(self._verify_step, self.backend, "default" if graphed else self.mode)
            if graphed:  # CUDA graphs of our own: no guards or input checks on each step's host path
                self.verify_step = StepGraphs(self.verify_step, self._step_state)
            if self.draft_logits is not None:
                self.draft_logits = self._compiled(drafter.draft_logits, DRAFTER_BACKEND, "default")
                self.context_step = self._compiled(drafter.add_context, DRAFTER_BACKEND, "default")
                if graphed:  # the drafter reads nothing but its arguments, its weights and its training flag
                    self.draft_logits = StepGraphs(self.draft_logits, lambda: drafter.training)
                    self.context_step = StepGraphs(self.context_step, lambda: drafter.training)
        self.last_stats = GenerationStats(block_size=self.block_size)
        self.sampler: Sampler | None = None  # the running generate call's sampling settings
        self.repetition_penalty: float | None = None  # and its repetition penalty (None: none)
        self.lengths = LengthProcessors()  # and its processors that count each row's tokens
        self.bias_shape: tuple | None = None  # and its sequence biases' shape (`TargetCache.sequence_biases`), if any
        self.ngram_size = 0  # and its no_repeat_ngram_size (0: none; `TargetCache.history`)
        self.target_cache: TargetCache | None = None  # kept between generate calls (see `_cache`)
        self.drafter_cache: RowCache | None = None  # likewise (`_drafter_cache`)

    def _captures_steps(self) -> bool:
        """Whether "reduce-overhead" steps replay from CUDA graphs of our own (`StepGraphs`): on CUDA, where every
        step keeps its buffers. Offloaded experts take host-side ops that must leave the graph: they keep
        torch.compile's CUDA-graph trees, which partition the graph and check its inputs on every call.
        Linear-attention steps return the states they leave (`TargetCache.pending_linear`): a replay, which redoes
        none of the step's Python side effects, still gets them committed."""
        return _on_cuda(self.model) and not hasattr(self.model, "dflash_offload")

    def _step_state(self) -> tuple:
        """What the compiled verify step reads besides its arguments, part of `StepGraphs`' keys: the target's
        attention implementation (`grouped_attention` switches it), its training flag and the running generation's
        sampling warpers."""
        chain = self.sampler.chain if self.sampler else ()
        warpers = tuple((type(w).__name__, repr(vars(w))) for w in chain)
        return (self.model.config._attn_implementation, self.model.training, warpers, self.repetition_penalty,
                self.lengths, self.bias_shape, self.ngram_size)

    @property
    def hidden_states_read(self) -> list[int]:
        """The hidden states a forward reads (transformers' index: i + 1 is layer i's output): the drafter's layers'
        outputs. Only these are kept, not every layer's until the forward ends (a long prompt's prefill: prompt x
        hidden a layer)."""
        return sorted(i + 1 for i in self.layer_ids)

    def _target_forward(self, ids: torch.Tensor, cache: TargetCache, causal_prompt: bool = False,
                        causal_chunks: bool = False, pads: list[int] | None = None, logits_to_keep: int = 0):
        """The target over `ids`: logits of its last `logits_to_keep` positions (0: all) and drafter features. The
        flags and `pads` as `TargetCache.masks` takes them."""
        width = ids.shape[1]
        masks = cache.masks(width, self.windows, causal_prompt, causal_chunks, pads)
        out = self.model(
            input_ids=ids,
            position_ids=cache.positions(width),
            attention_mask=({self.mask_names.get(kind, kind): mask for kind, mask in masks.items()}
                            if self.per_kind_masks else next(iter(masks.values()))),
            cache=cache,
            use_cache=self.use_cache,
            output_hidden_states=self.hidden_states_read or False,
            logits_to_keep=logits_to_keep,
            **{SEEN_SLOTS: cache.seen_slots(width)},
        )
        features = context_features(out.hidden_states, self.layer_ids, self.hidden_size) if self.layer_ids else None
        return out.logits, features

    def _ring(self, max_len: int) -> int:
        """Slots of a ring layer's ring (sliding, chunked): window - 1 + (the most tokens one step writes); 0, none,
        when that is no shorter than the whole sequence (it would save nothing)."""
        windows = [window or 0 for kind, window in self.windows.items() if kind in RING_KINDS]
        ring = max(windows) - 1 + self.block_size if self.ring_layers else 0
        return ring if 0 < ring < max_len else 0

    def _new_cache(self, batch: int, max_len: int, dtype, device) -> TargetCache:
        ring = self._ring(max_len)
        return TargetCache(batch, max_len, dtype, device, self.ring_layers if ring else (), ring)

    def _cache_bytes(self, batch: int, max_len: int, dtype: torch.dtype) -> int:
        """Device bytes of the keys and values of new target and drafter caches (`_new_cache`, the drafter's
        `new_cache`): every slot of a full-attention layer, a ring layer's ring, compressed entries for every slot.
        Linear-attention states are a few MiB at most and left out."""
        ring = self._ring(max_len)
        target = sum((ring or max_len if kind in RING_KINDS and self.windows[kind] else max_len) * per_token
                     for kind, per_token in zip(self.attention_kinds, self.cached_per_token) if kind in KEYED_KINDS)
        target += sum((max_len // rate + 1) * width for rate, width in self.compressed_entries)  # a spare row each
        drafter = getattr(self.drafter, "cache_elements_per_slot", 0)  # an oracle drafter caches nothing
        elements = target + max_len * drafter
        return batch * elements * dtype.itemsize

    def _check_memory(self, prompt: int, max_new_tokens: int, batch: int, max_len: int, dtype, device) -> int | None:
        """Refuse a generation whose new caches cannot fit in the device's free memory, before anything is
        allocated: a long prompt otherwise runs out of memory in the middle of its prefill. The caches being
        replaced, and the allocator's cached blocks, count as free. Returns the bytes left beside the caches for the
        prefill's activations (`_prefill_chunk`); None off CUDA (host memory is not budgeted)."""
        free = device_free_bytes(device)
        if free is None:
            return None
        old = [c for c in (self.target_cache, self.drafter_cache)
               if c is not None and c.shape != (batch, max_len, dtype, device)]
        if self.target_cache is not None and not old:
            return free  # the previous generation's caches are reused
        free += sum(cache.nbytes for cache in old)
        needed = self._cache_bytes(batch, max_len, dtype)
        if needed > free:
            raise ValueError(
                f"a prompt of {prompt} tokens + max_new_tokens {max_new_tokens} in {batch} row(s) needs "
                f"{needed / 2**30:.2f} GiB of key/value cache ({max_len} slots a row) but {free / 2**30:.2f} GiB "
                f"of {device} is free: shorten the prompt, generate fewer tokens or run fewer rows at once"
                f"{self._smaller_budget()}")
        return free - needed

    def _smaller_budget(self) -> str:
        return ", or a smaller gpu_memory budget for the experts" if hasattr(self.model, "dflash_offload") else ""

    def _prefill_attention(self, prompt: int, padded: bool) -> tuple[bool, bool]:
        """(whether the prompt takes no masks, whether every chunk of it does): see `_prefill`. Inside
        `generation_context` (`unmasked_is_causal` reads the attention `grouped_attention` sets)."""
        causal_prompt = unmasked_is_causal(self.model) and (not padded or prompt >= ROWS_WITHOUT_MASKS)
        return causal_prompt, causal_prompt and unmasked_chunks(self.model)

    def _prefill_chunk(self, prompt: int, batch: int, padded: bool, max_len: int, room: int | None, device) -> int:
        """Tokens per prefill forward: `prefill_chunk`, else the whole prompt (PREFILL_CHUNK for a masked prompt on
        sliding layers: see `_prefill`); halved while the prefill's activations (`PrefillActivations`, an upper
        bound) would not fit in `room`, the device's free bytes beside the caches. Refuses the prompt, before
        anything is allocated, when even SMALLEST_PREFILL_CHUNK does not fit."""
        causal_prompt, causal_chunks = self._prefill_attention(prompt, padded)
        chunk = min(prompt, self.prefill_chunk or (PREFILL_CHUNK if self._ring(max_len) and not causal_chunks
                                                   else prompt))
        if room is None:
            return chunk
        if self.prefill_activations is None:
            self.prefill_activations = PrefillActivations.of(self.model, len(self.layer_ids), self.drafter is not None)
        needed = lambda tokens: self.prefill_activations.bytes(batch, tokens, prompt, not causal_prompt)  # noqa: E731
        while needed(chunk) > room and chunk > SMALLEST_PREFILL_CHUNK:
            chunk = max(SMALLEST_PREFILL_CHUNK, 1 << (chunk - 1).bit_length() - 1)
        if needed(chunk) > room:
            raise ValueError(
                f"a prompt of {prompt} tokens in {batch} row(s) needs about {needed(chunk) / 2**30:.2f} GiB of "
                f"activations to prefill, in chunks of {chunk} tokens, but {room / 2**30:.2f} GiB of {device} is "
                f"free beside the caches: shorten the prompt or run fewer rows at once{self._smaller_budget()}")
        return chunk

    def _cache(self, batch: int, max_len: int, dtype, device, pad: torch.Tensor,
               prompt: int | None = None) -> TargetCache:
        """The generation's target cache: the previous generation's, reset in place, when its shape is the same
        (its buffers keep their addresses, so CUDA graphs of the step replay rather than record again); else a
        new one, which the decoder then keeps until a generation needs another shape. `prompt`: the prompt's width
        (`TargetCache.reset`)."""
        cache = self.target_cache
        if cache is None or cache.shape != (batch, max_len, dtype, device):
            cache = self.target_cache = self._new_cache(batch, max_len, dtype, device)
            self._clear_graphs(self.verify_step)  # their graphs write the old cache's buffers
        cache.reset(pad, prompt)
        return cache

    def _drafter_cache(self, batch: int, max_len: int, dtype, device) -> RowCache:
        """The generation's drafter cache: the previous generation's, emptied in place, when its shape is the same
        (as `_cache`: the drafter's graphs keep replaying); else a new one."""
        cache = self.drafter_cache
        if cache is None or cache.shape != (batch, max_len, dtype, device):
            cache = self.drafter_cache = self.drafter.new_cache(batch, max_len, dtype, device)
            self._clear_graphs(self.draft_logits, self.context_step)
        cache.reset()
        return cache

    @staticmethod
    def _clear_graphs(*steps) -> None:
        for step in steps:
            if isinstance(step, StepGraphs):
                step.clear()

    def _prefill(self, input_ids: torch.Tensor, cache: TargetCache, padded: bool = True, chunk: int | None = None):
        """The prompt through the target: in one forward, or in chunks of `chunk` tokens (by default, as
        `_prefill_chunk` picks without a memory budget: `prefill_chunk`, or for models with sliding layers
        PREFILL_CHUNK when the chunks take masks: a masked chunk's sliding layers attend densely over it), each
        attending over the slots filled so far only (`TargetCache.visible`; a sliding layer over its ring and the
        chunk's own keys).
        On SDPA or sink attention a prompt takes no mask where it can (`TargetCache.masks`): SDPA's causal flag and
        its flash kernels, sinks by `causal_sink_attention`, and no [b, 1, P, P] mask; a left-padded batch of at
        least ROWS_WITHOUT_MASKS tokens likewise row by row from each row's first real token (`row_starts`).
        Returns the last position's logits and the captured features of every prompt position."""
        batch, prompt = input_ids.shape
        causal_prompt, causal_chunks = self._prefill_attention(prompt, padded)
        pads = cache.pad.tolist() if causal_prompt and padded else None
        chunk = chunk or self._prefill_chunk(prompt, batch, padded, cache.rows.max_len, None, input_ids.device)
        features = []
        for start in range(0, prompt, chunk):
            ids = input_ids[:, start: start + chunk]
            cache.visible = start + ids.shape[1]  # every row's length is `start` (padding included)
            try:
                # the last position's logits only: a whole prompt's take prompt x vocabulary (1.2 GB of bf16 for a
                # 4096-token Qwen3 prompt) and the lm_head's largest GEMM
                logits, chunk_features = self._target_forward(ids, cache, causal_prompt, causal_chunks, pads,
                                                              logits_to_keep=1)
            finally:
                cache.visible = None
            kept = torch.full((ids.shape[0],), ids.shape[1], device=ids.device)
            cache.rows.commit(kept)
            cache.commit_linear(kept, ids.shape[1])
            features.append(chunk_features)
        return logits[:, -1], torch.cat(features, dim=1) if self.layer_ids else None

    def _verify_step(self, block: torch.Tensor, cache: TargetCache, active: torch.Tensor, draft_probs=None,
                     uniforms=None):
        """Target over the block, acceptance (greedy, or rejection sampling when `uniforms` are given), commit of
        the rows' keys and values. Returns the accepted counts, the tokens, the drafter's features and the
        linear-attention states the block left (`TargetCache.pending_linear`, which `commit_linear` takes)."""
        logits, features = self._target_forward(block, cache)
        logits = self._processed(logits, cache, block)
        if uniforms is None:
            accepted, tokens = torch.ops.dflash.greedy_accept(block, logits)
        else:
            probs = processed_probs(logits, self.sampler.chain)
            one_hot = draft_probs is None  # argmax or otherwise deterministic drafts
            accepted, tokens = torch.ops.dflash.sampled_accept(
                block, probs, probs[:, :-1] if one_hot else draft_probs, uniforms, one_hot)
        cache.rows.commit((accepted + 1) * active)
        if self.repetition_penalty:  # the anchor and the accepted drafts join the row's tokens
            kept = torch.arange(block.shape[1], device=block.device)[None, :] <= accepted[:, None]
            cache.tokens_seen.scatter_(1, block.masked_fill(~kept, cache.tokens_seen.shape[1] - 1), True)
        if self.lengths.count:
            cache.countdowns.sub_(((accepted + 1) * active)[:, None])
        if self.bias_shape or self.ngram_size:  # the block goes in after each row's history; its kept part counts
            cache.history.scatter_(1, cache.history_lengths[:, None] + torch.arange(block.shape[1],
                                                                                   device=block.device), block)
            cache.history_lengths.add_((accepted + 1) * active)
        return accepted, tokens, features, cache.pending_linear()

    def _processed(self, logits: torch.Tensor, cache: TargetCache, block: torch.Tensor | None) -> torch.Tensor:
        """Logits [b, w, V] with the running call's sequence biases, repetition penalty, minimum length, banned
        repeated n-grams, forced BOS and EOS and length penalty, as generate's processors apply them before its
        warpers: over a verify `block`, or (None) the prefill's position after the prompt. Sequence biases come
        first, as in generate; its bad words and suppressed tokens, which come later there, join them: -inf, which
        no other processor moves but a forced token (`generate` refuses a forced token that is also suppressed)."""
        lengths = self.lengths
        if self.bias_shape:
            logits = sequence_biased(logits, cache.history, cache.history_lengths, block, cache.sequence_biases)
        if self.repetition_penalty:
            logits = repetition_penalized(logits, cache.tokens_seen, block, self.repetition_penalty)
        if lengths.holds_eos:
            logits = eos_held_back(logits, cache.countdowns[:, HOLD], cache.eos_ids)
        if self.ngram_size:
            logits = repeated_ngrams_banned(logits, cache.history, cache.history_lengths, block, self.ngram_size)
        if lengths.forced_bos is not None and block is None:  # the first new token
            bos = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            bos[lengths.forced_bos] = True
            logits = forced(logits, torch.zeros_like(cache.pad), bos)
        if lengths.forces_eos:
            logits = forced(logits, cache.countdowns[:, FORCE], cache.forced_eos_ids)
        if lengths.decay is not None:
            logits = eos_decayed(logits, cache.countdowns[:, DECAY], cache.eos_ids, lengths.decay)
        return logits

    def _draft(self, anchor: torch.Tensor, drafter_cache: RowCache, width: int, pending: list):
        """[b, width] = [anchor, d1 .. d_{width-1}]: the first of the drafter's proposals, and the distribution q
        they were drawn from (None for deterministic drafts). Width 1 runs no drafter and leaves the committed
        tokens' features in `pending`; the next drafting step adds them to the drafter's context in one call."""
        if self.drafter is None:
            return anchor[:, None], None
        if width == 1:
            if pending and pending[-1][0] is not None:  # the last step's features are its graph's output buffer,
                features, kept = pending[-1]  # which the step about to run overwrites under CUDA graphs: keep a copy
                pending[-1] = (features.clone(), kept)  # (the earlier ones were copied at their own next step)
            return anchor[:, None], None
        if pending:
            self._add_context(drafter_cache, *_left_aligned(pending))
            pending.clear()
        embed, lm_head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        drafts, q = self.drafter.propose(anchor, drafter_cache, embed, lm_head, self.sampler,
                                         draft_logits=self.draft_logits)
        return torch.cat([anchor[:, None], drafts[:, : width - 1]], dim=1), None if q is None else q[:, : width - 1]

    def _add_context(self, cache: RowCache, features: torch.Tensor | None, kept: torch.Tensor) -> None:
        """The drafter's add_context. Up to a block of tokens (what steps add) goes through the compiled one, padded
        to the block so that one graph serves: the padding is written past the kept tokens and never committed, as a
        verify block's rejected tokens are. Longer contexts (the prompt's) run eagerly rather than compiling one
        graph per length, and so does a cache's first (it allocates the buffers)."""
        if (self.context_step is None or features is None or features.shape[1] > self.block_size
                or not cache.keys):
            return self.drafter.add_context(cache, features, kept)
        padding = self.block_size - features.shape[1]
        return self.context_step(cache, torch.nn.functional.pad(features, (0, 0, 0, padding)), kept)

    @staticmethod
    def _compiled(function, backend, mode: str):
        """`function` compiled whole, one graph per input shapes."""
        return torch._dynamo.config.patch(recompile_limit=STEP_GRAPHS)(torch.compile(
            function, backend=backend, fullgraph=True, dynamic=False, mode=mode))

    def _check_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Token ids the embedding can read: [batch, length] integers in [0, vocabulary), at least one a row, on the
        embedding's device, as the mask is."""
        embedding = self.model.get_input_embeddings()
        device = embedding.weight.device
        for name, tensor in (("input_ids", input_ids), ("attention_mask", attention_mask)):
            if tensor is not None and tensor.device != device:
                raise ValueError(f"{name} is on {tensor.device} but the model's embeddings are on {device}: move it "
                                 f"there ({name}.to({str(device)!r}))")
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {list(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}; a tokenizer's "
                             "return_tensors='pt' gives them")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids has no tokens: every prompt needs at least one")
        vocabulary = embedding.num_embeddings
        low, high = (bound.item() for bound in torch.aminmax(input_ids))
        if low < 0 or high >= vocabulary:
            raise ValueError(f"token id {low if low < 0 else high} is outside the model's vocabulary of {vocabulary}: "
                             "was the prompt tokenized for another model?")

    def _check_lengths(self, prompt: int, max_new_tokens: int) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if self.max_positions and prompt + max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt of {prompt} tokens + max_new_tokens {max_new_tokens} exceeds the model's "
                f"max_position_embeddings {self.max_positions}; shorten the prompt or generate fewer tokens"
            )

    def _sampler(self, do_sample, settings: dict, generator, argmax_drafts) -> Sampler | None:
        """None for greedy; otherwise the warpers' `settings` (None: unset), each defaulting to the model's
        generation_config like generate."""
        if not do_sample:
            return None
        config = self.model.generation_config
        defaults = config._get_default_generation_params()  # what generate falls back to (top_k 50, ...)

        def setting(name, value):
            for candidate in (value, getattr(config, name, None), defaults.get(name)):
                if candidate is not None:
                    return candidate
            return None

        chain = warpers(**{name: setting(name, value) for name, value in settings.items()})
        return Sampler(chain, generator, argmax_drafts)

    @_in_inference_mode
    def generate(self, input_ids, attention_mask=None, max_new_tokens: int | None = None, eos_token_id=None,
                 pad_token_id=None, do_sample: bool = False, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, generator: torch.Generator | None = None,
                 argmax_drafts: bool = False, streamer=None, repetition_penalty: float | None = None,
                 min_new_tokens: int | None = None, min_length: int | None = None, min_p: float | None = None,
                 epsilon_cutoff: float | None = None, suppress_tokens: list[int] | None = None,
                 begin_suppress_tokens: list[int] | None = None, bad_words_ids: list[list[int]] | None = None,
                 no_repeat_ngram_size: int | None = None, sequence_bias=None, top_h: float | None = None,
                 typical_p: float | None = None, eta_cutoff: float | None = None, forced_bos_token_id=None,
                 forced_eos_token_id=None, exponential_decay_length_penalty=None,
                 max_length: int | None = None) -> torch.Tensor:
        """Greedy: the same tensor as `model.generate(..., do_sample=False)`, as many new tokens as generate gives:
        `max_new_tokens`, else `max_length` counting the (padded) prompt, each the argument else the
        generation_config's, else 20. Sampled (`do_sample=True`): tokens
        distributed exactly as the target's own sampling with the same temperature / top-h / top-k / top-p / min-p /
        typical-p / epsilon and eta cutoffs. Either with
        transformers' `repetition_penalty` (default: the generation_config's), applied to every verified position
        over the row's prompt and tokens so far, its `min_new_tokens` / `min_length` (likewise): a row's EOS
        ids are held back at every position before its minimum, its `sequence_bias`, `bad_words_ids` and
        `suppress_tokens` (likewise) at every position, `begin_suppress_tokens` at the first new token, and its
        `no_repeat_ngram_size` (likewise); the last and the sequences of several tokens over each row's left-padded
        prompt and tokens; its `forced_eos_token_id` as each row's last token (at max_new_tokens),
        `forced_bos_token_id` as the first after a one-token prompt, and `exponential_decay_length_penalty` growing
        each row's EOS logits past its start (likewise).
        `streamer` (transformers' TextStreamer interface, batch 1) gets the prompt, then each step's new tokens."""
        self._check_ids(input_ids, attention_mask)
        check_generation_config(self.model.generation_config)
        if streamer is not None and input_ids.shape[0] != 1:
            raise ValueError(f"a streamer takes one row, got a batch of {input_ids.shape[0]}; stream one prompt")
        sampler = self._sampler(do_sample, dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                                epsilon_cutoff=epsilon_cutoff, top_h=top_h, typical_p=typical_p,
                                                eta_cutoff=eta_cutoff), generator, argmax_drafts)
        generation_config = self.model.generation_config
        given = dict(repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens, min_length=min_length,
                     sequence_bias=sequence_bias, bad_words_ids=bad_words_ids, suppress_tokens=suppress_tokens,
                     begin_suppress_tokens=begin_suppress_tokens, no_repeat_ngram_size=no_repeat_ngram_size,
                     eos_token_id=eos_token_id, pad_token_id=pad_token_id, forced_bos_token_id=forced_bos_token_id,
                     forced_eos_token_id=forced_eos_token_id,
                     exponential_decay_length_penalty=exponential_decay_length_penalty,
                     max_new_tokens=max_new_tokens, max_length=max_length)
        # each processor's setting as generate takes it: the argument, else the generation_config's
        setting = {name: getattr(generation_config, name) if value is None else value for name, value in given.items()}
        penalty = setting["repetition_penalty"]
        penalty = None if penalty == 1.0 else penalty  # None too: as generate, which then adds no processor
        if penalty is not None:
            check_repetition_penalty(penalty)
        eos = _token_ids(setting["eos_token_id"])
        min_tokens = _min_tokens(setting["min_new_tokens"], setting["min_length"], input_ids.shape[1])
        vocabulary = self.model.get_output_embeddings().weight.shape[0]
        forced_eos, forced_bos = _forced_ids(setting["forced_eos_token_id"], setting["forced_bos_token_id"],
                                             setting["suppress_tokens"], vocabulary)
        decay = _length_penalty(setting["exponential_decay_length_penalty"])
        biases = SequenceBiases.of(vocabulary, setting["sequence_bias"],
                                   setting["bad_words_ids"], setting["suppress_tokens"], eos)
        banned_first = begin_suppressed(setting["begin_suppress_tokens"])
        ngram_size = check_ngram_size(setting["no_repeat_ngram_size"])
        pad_token_id = setting["pad_token_id"]
        inferred = attention_mask is None and _pads_the_prompt(input_ids, pad_token_id, eos)
        if inferred:
            attention_mask = (input_ids != pad_token_id).long()
        if pad_token_id is None:
            pad_token_id = _first_id(setting["eos_token_id"])
        batch, prompt = input_ids.shape
        max_new_tokens = _new_tokens(setting["max_new_tokens"], setting["max_length"], prompt, self.max_positions)
        self._check_lengths(prompt, max_new_tokens)
        pad = _left_padding(input_ids, attention_mask, read_from=int(pad_token_id) if inferred else None)
        device, dtype = input_ids.device, self.model.dtype
        max_len = cache_capacity(prompt + max_new_tokens + self.block_size)
        room = self._check_memory(prompt, max_new_tokens, batch, max_len, dtype, device)
        chunk = self._prefill_chunk(prompt, batch, bool(pad.any()), max_len, room, device)

        self.sampler = sampler
        self.repetition_penalty = penalty
        self.lengths = LengthProcessors(  # without an EOS generate adds no minimum length or length penalty either
            holds_eos=bool(eos) and min_tokens > 0, forces_eos=bool(forced_eos),
            decay=decay[1] if decay and eos else None, forced_bos=forced_bos if prompt == 1 else None)
        self.bias_shape = None if biases is None else tuple(biases.prefixes.shape)
        self.ngram_size = ngram_size
        if streamer is not None:
            streamer.put(input_ids.cpu())
        start = time.perf_counter()
        cache = self._cache(batch, max_len, dtype, device, pad, prompt)
        logits, features = self._prefill(input_ids, cache, padded=bool(pad.any()), chunk=chunk)
        if self.repetition_penalty:
            seen_tokens(input_ids, pad, logits.shape[-1], cache.seen_buffer(logits.shape[-1]))
        if self.lengths.count:  # the anchor is each row's first new token (columns `sampling.COUNTDOWNS`)
            cache.countdowns_buffer().copy_(torch.tensor([min_tokens, max_new_tokens - 1, decay[0] if decay else 0]))
            cache.ids_buffer("eos_ids", logits.shape[-1], eos)
            cache.ids_buffer("forced_eos_ids", logits.shape[-1], forced_eos)
        if self.bias_shape or self.ngram_size:
            cache.fill_history(input_ids, max_len)
        if self.bias_shape:
            cache.keep_biases(biases)
        logits = self._processed(logits[:, None], cache, None)[:, 0]
        if banned_first:  # generate's begin_suppress_tokens: the first new token only
            logits[:, banned_first] = float("-inf")
        if self.lengths.count:
            cache.countdowns.sub_(1)
        anchor = sampler.draw(processed_probs(logits, sampler.chain)) if sampler else logits.argmax(dim=-1)

        drafter_cache = None
        pending = []  # (features, kept tokens per row) not yet in the drafter's context: the first drafting step
        if self.drafter is not None:  # adds them, so a generation that never drafts never runs the drafter
            drafter_cache = self._drafter_cache(batch, max_len, dtype, device)
            context = None
            if features is not None:  # each row's real prompt tokens, left-aligned
                index = (pad[:, None] + torch.arange(prompt, device=device)).clamp(max=prompt - 1)
                context = features.gather(1, index[:, :, None].expand(-1, -1, features.shape[-1]))
            pending.append((context, prompt - pad))

        outputs = [[int(t)] for t in anchor.tolist()]
        if streamer is not None:
            streamer.put(anchor.cpu())
        done = [len(row) >= max_new_tokens or row[-1] in eos for row in outputs]
        stats = GenerationStats(block_size=self.block_size, prefill_chunk=chunk)
        while not all(done):
            step_start = time.perf_counter()
            width = self.chooser.choose() if self.chooser else self.block_size
            stats.widths.append(width)
            active = torch.tensor([not d for d in done], device=device, dtype=torch.int64)
            block, draft_probs = self._draft(anchor, drafter_cache, width, pending)
            uniforms = sampler.uniforms(block.shape, device) if sampler else None
            accepted, target, features, linear = self.verify_step(block, cache, active, draft_probs, uniforms)
            accepted_list = accepted.tolist()  # the step's one host sync
            cache.commit_linear((accepted + 1) * active, block.shape[1], linear)
            stats.accepted.append([None if done[b] else a for b, a in enumerate(accepted_list)])
            committed = target.tolist()
            for b, a in enumerate(accepted_list):
                if done[b]:
                    continue
                before = len(outputs[b])
                for token in committed[b][: a + 1]:
                    outputs[b].append(token)
                    if token in eos or len(outputs[b]) >= max_new_tokens:
                        done[b] = True
                        break
                if streamer is not None:
                    streamer.put(torch.tensor(outputs[b][before:]))
            anchor = target.gather(1, accepted[:, None]).squeeze(1)
            if self.drafter is not None:
                pending.append((features, (accepted + 1) * active))
            stats.step_seconds.append(time.perf_counter() - step_start)
            if self.chooser:
                rows = [a for b, a in enumerate(accepted_list) if stats.accepted[-1][b] is not None]
                self.chooser.observe(width, rows, stats.step_seconds[-1])

        if streamer is not None:
            streamer.end()
        stats.seconds = time.perf_counter() - start
        stats.new_tokens = [len(row) for row in outputs]
        self.last_stats = stats
        width = max(stats.new_tokens)
        generated = torch.full((batch, width), pad_token_id, dtype=input_ids.dtype, device=device)
        for b, row in enumerate(outputs):
            generated[b, : len(row)] = torch.tensor(row, dtype=input_ids.dtype)
        return torch.cat([input_ids, generated], dim=1)
