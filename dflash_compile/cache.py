"""Caches with fixed buffers and per-row lengths, for batched speculative decoding.

A row's tokens sit in consecutive slots of a [batch, heads, max_len, head_dim] buffer. A forward writes its new
keys/values at `lengths[b], lengths[b] + 1, ...` (`dflash::kv_write`) without moving `lengths`; afterwards
`dflash::kv_commit` advances each row by the number of tokens it keeps. Anything written past a row's length is
dead: masked out of attention and overwritten by the next write. That is the whole rollback for full attention,
and it needs no host sync: lengths stay on the device.

Sliding-window layers (and chunked ones, W their chunk) keep a ring of W - 1 + C slots (C: the most tokens one
step writes, the block); token slot p lives at ring slot p mod (W - 1 + C). A step's writes then never overwrite a
key that any of its queries, or any later query, still needs, and a rolled-back tail is overwritten by the tokens
that replace it: a key inside a query's window was written at most W - 1 slots before it and the block reaches at
most C - 1 slots past it. A prefill chunk, which may be longer than the ring, attends over the ring as it was
followed by the chunk's own keys, and the ring then keeps the chunk's last tokens.

`RowCache` is the storage (the drafter uses it directly for its context K/V); `TargetCache` plugs it into
transformers models through their `Cache.update` interface, with masks built here and passed in as 4-D tensors.
A DSA layer's indexer (DeepSeek-V3.2) keeps one key of its own per token (`update_indexer`): written at the same
slots, rolled back by the same lengths.

DeepSeek-V4's compressors keep their projections per token beside a layer's keys (`update_beside`: in its ring) and
their compressed entries in buffers of their own, one entry per window of `rate` tokens of a row
(`compressed_entries`), each written by the token closing its window; a query sees the entries of the windows closed
at or before it, so an entry a rolled-back token wrote is unseen until a kept token writes it again
(`compressed_attention`): no commit either.

Linear-attention layers (GatedDeltaNet) keep a conv window and a recurrent state that cannot be cut back. A
forward leaves its candidates pending; `commit_linear` then takes, per row, the conv window ending at the row's
last kept token (`dflash::conv_window_commit`) and the recurrent state after that token (`dflash::state_select`):
a verify block's forward leaves the state after each of its tokens (`linear_attention.stepwise_linear_attention`),
a prompt's the state after its last. A compiled verify step returns what it left (`pending_linear`) and
`generate` commits those outputs: the pending dicts are filled by Python side effects, which a step replayed from
a CUDA graph does not redo.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache

from .attention import row_starts
from .families import MASK_READING_KINDS, RECURRENT_KINDS, REFERENCE_KINDS, RING_KINDS
from .sampling import SequenceBiases


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[b, q, k] booleans -> [b, 1, q, k] additive mask. finfo.min, not -inf: a row with nothing visible (a padding
    query) gets a finite uniform softmax instead of NaNs that would leak through zero attention weights."""
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)[:, None]


def _static(buffer: torch.Tensor) -> torch.Tensor:
    """Buffers the compiled step mutates keep their address: CUDA graphs may then capture the step."""
    torch._dynamo.mark_static_address(buffer)
    return buffer


class RowCache:
    """Per-layer key/value buffers with one committed length per row."""

    def __init__(self, batch: int, max_len: int, dtype: torch.dtype, device, sizes: dict[int, int] | None = None):
        self.batch, self.max_len, self.dtype = batch, max_len, dtype
        self.sizes = sizes or {}  # layer -> ring size, for layers that keep fewer than max_len slots
        self.lengths = _static(torch.zeros(batch, dtype=torch.int64, device=device))
        self.keys: dict[int | str, torch.Tensor] = {}  # by layer; a DSA indexer's keys by name (`write_keys`)
        self.values: dict[int, torch.Tensor] = {}

    @property
    def shape(self) -> tuple:
        """(batch, max_len, dtype, device): what a generation needs to reuse this cache."""
        return self.batch, self.max_len, self.dtype, self.lengths.device

    def _buffer(self, store: dict, layer: int, like: torch.Tensor) -> torch.Tensor:
        if layer not in store:
            shape = (self.batch, like.shape[1], self.sizes.get(layer, self.max_len), like.shape[3])
            store[layer] = _static(torch.zeros(shape, dtype=like.dtype, device=like.device))
        return store[layer]

    def buffers(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value buffers, made on its first keys and values."""
        return self._buffer(self.keys, layer, key), self._buffer(self.values, layer, value)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, offset: int = 0) -> None:
        """Write [b, heads, n, d] keys/values at each row's length + offset (not committed)."""
        lengths = self.lengths + offset if offset else self.lengths
        torch.ops.dflash.kv_write(*self.buffers(layer, key, value), key, value, lengths)

    def write_keys(self, name: str, key: torch.Tensor) -> torch.Tensor:
        """Write [b, heads, n, d] keys without values (a DSA indexer's) under `name` at each row's length; all the
        buffer's keys returned."""
        keys = self._buffer(self.keys, name, key)
        torch.ops.dflash.kv_write(keys, None, key, None, self.lengths)
        return keys

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer], self.values[layer]

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers made so far."""
        return sum(t.nbytes for t in (*self.keys.values(), *self.values.values()))

    def commit(self, counts: torch.Tensor) -> None:
        torch.ops.dflash.kv_commit(self.lengths, counts)

    def reset(self) -> None:
        """Empty every row, in place: the buffers keep their addresses (and stale slots past the lengths)."""
        self.lengths.zero_()


class TargetCache(Cache):
    """The target model's cache during speculative decoding: a RowCache behind transformers' Cache interface.

    `pad` holds each row's left-padding width: slots before it are never attended to.
    """

    def __init__(self, batch: int, max_len: int, dtype: torch.dtype, device, ring_layers=(), ring_size: int = 0):
        super().__init__(layers=[])
        self.ring_size = ring_size
        self.rows = RowCache(batch, max_len, dtype, device, {layer: ring_size for layer in ring_layers})
        self.pad = _static(torch.zeros(batch, dtype=torch.int64, device=device))
        # the slot after the prompt's last (every row's: prompts are left-padded to one width); a reference sliding
        # layer sees every key before it (`masks`)
        self.prompt_end = _static(torch.full((1,), max_len, dtype=torch.int64, device=device))
        # committed linear-attention states: conv windows per (layer, state index: Inkling's layers keep four)
        self.conv: dict[tuple[int, int], torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.pending_conv: dict[tuple[int, int], torch.Tensor] = {}  # what the last forward would leave
        self.pending_recurrent: dict[int, torch.Tensor] = {}
        self.conv_width: dict[tuple[int, int], int] = {}
        # DeepSeek-V4's compressed entries by name (`compressed_attention`): [b, max_len // rate + 1, d] each
        self.compressed: dict[str, torch.Tensor] = {}
        self.spare: dict[tuple, torch.Tensor] = {}  # a previous generation's states, reused by `reset`
        # Set during the prefill (eager; the host knows that no row has more slots filled): a forward attends over
        # the first `visible` slots of each full-length buffer, as transformers' own cache grows, and over a ring
        # followed by its own keys (`_prefill_ring`). None (the compiled steps, whose shapes must not follow the
        # lengths): every slot.
        self.visible: int | None = None
        self.tokens_seen: torch.Tensor | None = None  # [b, vocabulary + 1] bool, for a repetition penalty
        # [b, 3] countdowns in new tokens (columns `sampling.COUNTDOWNS`): before each row's EOS may come (a minimum
        # length), to its forced EOS (its last token), and to where its EOS logit starts to grow (a length penalty)
        self.countdowns: torch.Tensor | None = None
        self.eos_ids: torch.Tensor | None = None  # [vocabulary] bool: which ids are EOS, for the first and third
        self.forced_eos_ids: torch.Tensor | None = None  # [vocabulary] bool: which ids a forced EOS allows
        # [b, capacity] each row's padded prompt and tokens, and [b] how much of it is filled: for n-gram bans and
        # sequence biases
        self.history: torch.Tensor | None = None
        self.history_lengths: torch.Tensor | None = None
        # the running call's sequence biases (`sampling.SequenceBiases`), in the static buffers `bias_tokens`, ...
        self.sequence_biases: SequenceBiases | None = None
        self.bias_tokens = self.bias_prefixes = self.bias_last = self.bias_values = None

    def _kept(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The generation-state buffer `name`: made on first use (or for another shape) and kept, its address
        fixed, so that the verify steps' CUDA graphs replay on it."""
        buffer = getattr(self, name)
        if buffer is None or buffer.shape != shape:
            buffer = _static(torch.zeros(shape, dtype=dtype, device=self.pad.device))
            setattr(self, name, buffer)
        return buffer

    def ids_buffer(self, name: str, vocabulary: int, ids: set[int]) -> torch.Tensor:
        """The [vocabulary] bool buffer `name` (`eos_ids`, `forced_eos_ids`) set to `ids` (ids past the vocabulary,
        e.g. -1 for none, can never be drawn: left out)."""
        buffer = self._kept(name, (vocabulary,), torch.bool)
        buffer.zero_()[[t for t in sorted(ids) if 0 <= t < vocabulary]] = True
        return buffer

    def fill_history(self, ids: torch.Tensor, capacity: int) -> None:
        """`history` set to the prompt `ids` [b, P] as given (left padding too, as generate's input_ids), and its
        `history_lengths` to P (`sampling.repeated_ngrams_banned`, `sampling.sequence_biased`)."""
        self._kept("history", (self.rows.batch, capacity), torch.int64)[:, : ids.shape[1]] = ids
        self._kept("history_lengths", (self.rows.batch,), torch.int64).fill_(ids.shape[1])

    def keep_biases(self, biases: SequenceBiases) -> None:
        """`sequence_biases` set to `biases`, copied into kept buffers (`bias_tokens`, ...)."""
        values = {field.name: getattr(biases, field.name) for field in dataclasses.fields(biases)}
        self.sequence_biases = SequenceBiases(**{
            name: self._kept(f"bias_{name}", value.shape, value.dtype).copy_(value) for name, value in values.items()})

    def countdowns_buffer(self) -> torch.Tensor:
        """`countdowns` [b, 3]: what the length processors count down to (`sampling.COUNTDOWNS`)."""
        return self._kept("countdowns", (self.rows.batch, 3), torch.int64)

    def seen_buffer(self, vocabulary: int) -> torch.Tensor:
        """Which tokens each row has held (`sampling.seen_tokens`; the last column counts nothing)."""
        return self._kept("tokens_seen", (self.rows.batch, vocabulary + 1), torch.bool)

    def reset(self, pad: torch.Tensor, prompt: int | None = None) -> None:
        """Ready for a new generation on the same buffers (a compiled step captured in CUDA graphs then replays on
        them instead of being recorded again): nothing committed, `pad` the rows' left padding, `prompt` the prompt's
        width (None: every slot counts as the prompt's). Keys and values past the lengths are dead already;
        linear-attention states are set aside, zeroed and reused at the next commit."""
        self.rows.lengths.zero_()
        self.pad.copy_(pad)
        self.prompt_end.fill_(self.rows.max_len if prompt is None else prompt)
        self.spare.update({("conv", key): state for key, state in self.conv.items()})
        self.spare.update({("recurrent", layer): state for layer, state in self.recurrent.items()})
        self.conv, self.recurrent, self.pending_conv, self.pending_recurrent = {}, {}, {}, {}

    def _zero_state(self, kind: str, key, like: torch.Tensor, shape) -> torch.Tensor:
        """A zeroed static state buffer: the previous generation's when it has the shape, else a new one."""
        spare = self.spare.pop((kind, key), None)
        if spare is not None and spare.shape == shape and spare.dtype == like.dtype:
            return spare.zero_()
        return _static(like.new_zeros(shape))

    @property
    def lengths(self) -> torch.Tensor:
        return self.rows.lengths

    @property
    def shape(self) -> tuple:
        """Its rows' (batch, max_len, dtype, device): what a generation needs to reuse this cache."""
        return self.rows.shape

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers made so far: keys and values, linear-attention states (spares included), compressed
        entries."""
        states = (*self.conv.values(), *self.recurrent.values(), *self.spare.values(), *self.compressed.values())
        return self.rows.nbytes + sum(t.nbytes for t in states)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        ring = self.rows.sizes.get(layer_idx)
        if ring and self.visible is not None:
            return self._prefill_ring(key_states, value_states, layer_idx, ring)
        self.rows.write(layer_idx, key_states, value_states)
        keys, values = self.rows.kv(layer_idx)
        if self.visible is None:
            return keys, values
        return keys[:, :, :self.visible], values[:, :, :self.visible]

    def _prefill_ring(self, key_states, value_states, layer_idx: int, ring: int):
        """A prefill chunk on a sliding layer's ring, which may have fewer slots than the chunk has tokens: the
        queries attend over the tokens the ring holds from before the chunk, in order (the last min(start, ring)),
        followed by the chunk's own keys (`masks` says which of them each query sees), and the ring then keeps the
        chunk's last `ring` tokens. Every row's length is the chunk's start (`visible`: padding included)."""
        tokens = key_states.shape[2]
        start = self.visible - tokens
        held = torch.arange(start - min(start, ring), start, device=key_states.device) % ring  # slot of each token
        old_keys, old_values = (buffer.index_select(2, held)
                                for buffer in self.rows.buffers(layer_idx, key_states, value_states))
        keys, values = torch.cat([old_keys, key_states], dim=2), torch.cat([old_values, value_states], dim=2)
        skipped = max(tokens - ring, 0)
        self.rows.write(layer_idx, key_states[:, :, skipped:], value_states[:, :, skipped:], offset=skipped)
        return keys, values

    def update_beside(self, name: str, layer: int, key_states, value_states, ring: bool = True):
        """`update` for tensors a layer keeps per token beside its keys and values, under `name` (DeepSeek-V4's
        compressors' projections): in the layer's ring where it has one and `ring` allows (its keys' window holds
        what the tensors' readers need), else at every slot."""
        if ring and layer in self.rows.sizes:
            self.rows.sizes[name] = self.rows.sizes[layer]
        return self.update(key_states, value_states, name)

    def held_slots(self, slots: torch.Tensor, name: str, width: int) -> torch.Tensor:
        """Where the tensors `update` returned for `name` in a forward over `width` tokens hold the tokens of
        `slots`: a ring's slot modulo its size, or in a prefill chunk after the ring's older tokens in order
        (`_prefill_ring`); the slot itself in a buffer of every slot."""
        ring = self.rows.sizes.get(name)
        if not ring:
            return slots
        if self.visible is None:
            return slots.remainder(ring)
        start = self.visible - width
        return slots - (start - min(start, ring))

    def compressed_entries(self, name: str, rate: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer of `name`'s compressed entries, one per `rate` slots, and a spare last row (where windows not
        closed are written): [b, max_len // rate + 1, d], made on first use like `like` [..., d]."""
        if name not in self.compressed:
            shape = (self.rows.batch, self.rows.max_len // rate + 1, like.shape[-1])
            self.compressed[name] = _static(like.new_zeros(shape))
        return self.compressed[name]

    def update_indexer(self, indexer_keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """transformers' DSA indexer cache (DeepSeek-V3.2, GLM-MoE-DSA): a forward's indexer keys [b, tokens, d]
        written at the rows' slots as the layer's keys are; every slot's returned [b, slots, d] (the first `visible`
        in a prefill), the layer's mask saying which a query sees."""
        keys = self.rows.write_keys(f"indexer {layer_idx}", indexer_keys[:, None])[:, 0]
        return keys if self.visible is None else keys[:, :self.visible]

    # transformers' linear-attention cache interface (Qwen3.5 GatedDeltaNet)
    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.conv.get((layer_idx, state_idx))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.recurrent.get(layer_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers >= 5.25 counts a one-token in-place conv update here; `lengths` count tokens already."""

    def update_conv_state(self, conv_input, layer_idx: int, conv_kernel_size: int | None = None,
                          state_idx: int = 0, **kwargs):
        """The conv input with the committed window in front; kept pending until `commit_linear`."""
        key = (layer_idx, state_idx)
        old = self.conv.get(key)
        if old is None:  # prefill: left-pad to the kernel width
            width = conv_kernel_size or conv_input.shape[-1]
            self.conv_width[key] = width
            full = torch.nn.functional.pad(conv_input, (max(width - conv_input.shape[-1], 0), 0))
        else:
            full = torch.cat([old, conv_input], dim=-1)
        self.pending_conv[key] = full
        return full

    def update_recurrent_state(self, state, layer_idx: int, **kwargs):
        self.pending_recurrent[layer_idx] = state
        return state

    # MiniMax's lightning attention reads and writes its state by these
    def get_linear_cache(self, layer_idx: int):
        return self.get_recurrent_state(layer_idx)

    def set_linear_cache(self, layer_idx: int, state) -> None:
        self.update_recurrent_state(state, layer_idx)

    def pending_linear(self) -> tuple[dict[tuple[int, int], torch.Tensor], dict[int, torch.Tensor]]:
        """What the last forward left for `commit_linear`: its conv inputs per (layer, state index) and recurrent
        states per layer."""
        return dict(self.pending_conv), dict(self.pending_recurrent)

    def commit_linear(self, kept: torch.Tensor, width: int, pending: tuple[dict, dict] | None = None) -> None:
        """Commit linear-attention states after a forward over `width` tokens of which row b keeps kept[b]: a
        pending state per token ([b, width, ...]) gives each row its state after its last kept token; a single
        pending state (a prompt's, or one token's) is the state after all `width` tokens, kept whole or not at all.
        `pending`: that forward's `pending_linear()` as a compiled step returned it (default: what is pending)."""
        pending_conv, pending_recurrent = pending if pending is not None else self.pending_linear()
        for key, full in pending_conv.items():
            if key not in self.conv:
                self.conv[key] = self._zero_state("conv", key, full, (*full.shape[:-1], self.conv_width[key]))
            end = full.shape[-1] - width + kept
            torch.ops.dflash.conv_window_commit(self.conv[key], full, end)
        for layer, state in pending_recurrent.items():
            if layer in self.recurrent and state.dim() > self.recurrent[layer].dim():  # [b, width, *the state's]
                state = state[torch.arange(len(kept), device=kept.device), (kept - 1).clamp(min=0)]
            if layer not in self.recurrent:
                self.recurrent[layer] = self._zero_state("recurrent", layer, state, state.shape)
            torch.ops.dflash.state_select(self.recurrent[layer], state, kept > 0)
        self.pending_conv, self.pending_recurrent = {}, {}

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        """The longest row's length (a 0-d device tensor). Exact for rows of one length (one row, a prompt); Llama
        4's NoPE layers, the one family that reads it (its query temperature), read each row's `lengths` instead
        (`families._temper_llama4_queries`). The models take position_ids from `positions`."""
        return self.lengths.max()

    def positions(self, width: int) -> torch.Tensor:
        """Position ids [b, width] of the next `width` tokens: slot minus left padding, at least 0. A padding slot's
        query and key are masked, but not its position's arithmetic: Mistral 4 scales queries by log(1 + floor(
        position / n)), infinite at -1, and an infinite query makes a NaN key for the next layer's cache, which poisons
        every softmax of its row (transformers gives padding position 1)."""
        slots = self.lengths[:, None] + torch.arange(width, device=self.lengths.device)
        return (slots - self.pad[:, None]).clamp_min(0)

    def seen_slots(self, width: int) -> torch.Tensor | None:
        """A compiled step's bound on the slots its `width` new tokens see, for `dflash::decode_attention` to read no
        further: every row's keys lie before its length plus the new tokens (a ring's too, until it wraps; past
        that the kernel reads the whole ring). On the device, so one step graph serves every length. None in the
        prefill, whose forwards see `visible` slots already, or where the layers append compressed entries to the
        keys (DeepSeek-V4's: past the slots)."""
        return self.lengths.max() + width if self.visible is None and not self.compressed else None

    def query_and_key_slots(self, width: int, ring: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots of the next `width` tokens [b, width, 1], and those of the keys a layer's forward over them
        attends over [b or 1, width or 1, keys]: every slot of a full layer's buffer (the first `visible` in a
        prefill); a ring layer's ring, its slot j holding the newest token slot = j (mod ring) up to each query, or in
        a prefill chunk the ring's tokens in order, then the chunk's own (`_prefill_ring`)."""
        device = self.lengths.device
        query = (self.lengths[:, None] + torch.arange(width, device=device))[:, :, None]
        if ring and self.visible is None:
            ring_slots = torch.arange(self.ring_size, device=device)[None, None, :]
            return query, query - (query - ring_slots).remainder(self.ring_size)
        if ring:
            return query, torch.arange(self._first_ring_key(width), self.visible, device=device)[None, None, :]
        return query, torch.arange(self.visible or self.rows.max_len, device=device)[None, None, :]

    def _first_ring_key(self, width: int) -> int:
        """The slot of the first key a ring layer's prefill chunk of `width` tokens sees: what the ring holds of the
        tokens before the chunk."""
        return max(self.visible - width - self.ring_size, 0)

    def masks(self, width: int, windows: dict[str, int | None], causal_prompt: bool = False,
              causal_chunks: bool = False, pads: list[int] | None = None) -> dict[str, torch.Tensor | None]:
        """Masks for the next `width` tokens, one per attention kind: additive [b, 1, width, slots], causal over the
        row's own tokens (and inside the window, over the ring, for sliding kinds; inside the query's chunk of the row's
        tokens for chunked ones, `windows` giving the chunk); a 2-D padding mask of the new tokens for linear attention.
        `causal_prompt`: the attention reads a missing mask as causal over the last of its keys
        (`attention.unmasked_is_causal`); then a prompt's first chunk gets None for every kind whose mask would be plain
        causal over the chunk's own keys (all but a window shorter than the chunk, or a ring). With `causal_chunks`
        (`attention.unmasked_chunks`: the attention keeps to a window itself, and sees the keys before the chunk's own,
        every one a real earlier token: a ring's in order, `_prefill_ring`) every attention kind gets None in every
        chunk. With `pads` (the rows' left padding, on the host) such a kind gets `attention.row_starts` instead: each
        row's first real key among the keys the layer sees. A DSA layer ("indexed_attention") always gets its mask."""
        first_chunk = causal_prompt and self.visible == width
        every_chunk = causal_chunks and self.visible is not None
        pad = self.pad[:, None, None]
        masks = {}
        for kind, window in windows.items():
            ring_keys = bool(window and self.ring_size) and kind in RING_KINDS  # a sliding layer's keys: its ring
            if kind in REFERENCE_KINDS and self.visible is not None:  # a prefill: prompt keys, every one seen
                window = None
            query, key = self.query_and_key_slots(width, ring_keys)
            first_key = self._first_ring_key(width) if ring_keys and self.visible is not None else 0
            if kind not in MASK_READING_KINDS and (
                    every_chunk or (first_chunk and not (window and (self.ring_size or width > window)))):
                if pads is None:
                    masks[kind] = None
                    continue
                if kind not in RECURRENT_KINDS:
                    masks[kind] = row_starts([max(p - first_key, 0) for p in pads])
                    continue
            if kind in RECURRENT_KINDS:
                masks[kind] = query[:, :, 0] >= self.pad[:, None]
                continue
            ok = (key <= query) & (key >= pad)
            if kind == "chunked_attention" and window:  # its own chunk of the row's tokens, as transformers' masks
                ok &= (query - pad) // window == (key - pad) // window
            elif window and kind in REFERENCE_KINDS:  # the window past the prompt
                ok &= (query - key < window) | (key < self.prompt_end)
            elif window:
                ok &= query - key < window
            masks[kind] = additive_mask(ok, self.rows.dtype)
        return masks
