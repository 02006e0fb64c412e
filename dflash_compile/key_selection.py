"""Indexers that pick the keys each query attends to, as the decoder's cache and masks need them: Kolibri 1.1's
computed for every query at once (no host lists), so verify steps compile and replay from CUDA graphs; MiniMax-M3's
with its key blocks counted from each row's first real key; GLM-5-Next's pools of keys formed per row, over every
slot (`RowPooledGlm5NextIndexer`), and Qwen4-Exp's blocks likewise for every query at once (`BatchedQwen4ExpIndexer`).

transformers' `Kolibri1_1Indexer` scores keys with no weights of its own: the ReLU of the logits of the first
`index_num_heads` query heads against key head 0, both rounded to NVFP4, summed over those heads. A pool-source layer
first picks a pool for each query: the `index_pool_size // index_compression` blocks of `index_compression` keys
(counted from the query's first visible key, each block's mean key rounded to NVFP4) that score highest, the block of
its newest keys at score 0 unless complete. Every sparse layer then keeps the `index_topk` best keys of the pool, plus
the first `index_num_sink_tokens` and the last `index_num_local_tokens` visible keys. Queries seeing no more keys than
the pool (or that budget) keep every visible key. Ties go to the earlier key.

transformers loops over the rows of a batch and, within a row, over the distinct first visible keys of its queries
(`.unique().tolist()`), scoring each group's keys from that first key on. Here each row's keys are scored from the
first key any of its queries sees: the decoder's masks (causal over each row's left padding) give every query of a
row that sees a key that same first key, so the blocks, the sinks and each query's count of keys are the ones
transformers forms. The scores are summed over heads in transformers' order, and its own NVFP4 rounding and top-k
rule (ties to the lowest index) decide, so the same keys are picked."""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from .subclassing import subclass_once


class CapturedKolibriIndexer(torch.nn.Module):
    """The forward of a Kolibri 1.1 indexer (a `Kolibri1_1Indexer`, whose attributes it reads) for a whole batch at
    once. Made by `captured_kolibri_indexer` (the class mixed into the module's own, with its NVFP4 rounding)."""

    quantize = None  # transformers' `nvfp4_fake_quantize`, set per modeling module (`captured_kolibri_indexer`)

    @torch.no_grad()
    def forward(self, query_states: torch.Tensor, key_states: torch.Tensor, attention_mask: torch.Tensor,
                index_pool: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, 1, q, k] mask of the keys each query attends to, and the [b, q, k] pool it picked them from (a new one
        on a pool-source layer, else `index_pool`), as transformers' indexer returns."""
        visible = _visible(attention_mask)
        start, lengths = _row_starts_and_lengths(visible)
        queries = self.quantize(query_states[:, : self.num_heads]).float()
        keys = key_states[:, 0]
        if self.is_pool_source:
            index_pool = self._pool(queries, keys, visible, start, lengths)
        return self._selected(queries, keys, visible, index_pool, start, lengths).unsqueeze(1), index_pool

    def _score(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[b, heads, q, d] queries against [b, n, d] keys: [b, q, n], summed over heads in transformers' order."""
        scores = queries.new_zeros(queries.shape[0], queries.shape[2], keys.shape[1])
        for head in range(queries.shape[1]):
            scores += (queries[:, head] @ keys.transpose(1, 2)).relu()
        return scores * self.head_weight

    def _pool(self, queries, keys, visible, start, lengths) -> torch.Tensor:
        """Each long query's candidate keys: the keys of its best-scoring blocks (counted from its row's first key)."""
        compression, slots = self.compression, keys.shape[1]
        blocks = -(-slots // compression)
        unseen = ~visible.any(1)  # keys no query sees count as zeros in their block's mean
        document_keys = _shifted_left(keys.masked_fill(unseen[..., None], 0.0), start, blocks * compression)
        summaries = self.quantize(document_keys.float().unflatten(1, (blocks, compression)).sum(2) / compression)
        scores = self._score(queries, summaries)
        block = torch.arange(blocks, device=keys.device)
        # a query's block of newest keys competes at 0 unless complete; blocks past its keys are never picked
        scores = torch.where(block < lengths[..., None] // compression, scores, 0.0)
        scores = scores.masked_fill(block >= (lengths[..., None] + compression - 1) // compression, float("-inf"))
        picked = _blocks_onto_slots(self.top_k_mask(scores, self.pool_size // compression), start, compression, slots)
        long = (lengths > self.pool_size)[..., None]
        return torch.where(long, picked & visible, visible)

    def _selected(self, queries, keys, visible, pool, start, lengths) -> torch.Tensor:
        """Each long query's keys: its sinks, its newest local keys and the best-scoring `topk` of its pool."""
        scores = self._score(queries, self.quantize(keys).float())
        relative = torch.arange(keys.shape[1], device=keys.device) - start[:, None, None]  # [b, 1, k]
        length = lengths[..., None]
        sinks = (relative >= 0) & (relative < self.num_sink_tokens)
        local = (relative >= length - self.num_local_tokens) & (relative < length)
        candidates = pool & ~sinks & (relative < length - self.num_local_tokens)
        chosen = self.top_k_mask(scores.masked_fill(~candidates, float("-inf")), self.topk)
        long = length > self.topk + self.num_local_tokens + self.num_sink_tokens
        return torch.where(long, (chosen | sinks | local) & visible, visible)


def _shifted_left(rows: torch.Tensor, start: torch.Tensor, length: int) -> torch.Tensor:
    """[b, n, d] -> [b, length, d]: row b's entries from `start[b]` on, zeros after its last."""
    source = torch.arange(length, device=rows.device) + start[:, None]
    shifted = rows.gather(1, source.clamp(max=rows.shape[1] - 1)[..., None].expand(-1, -1, rows.shape[-1]))
    return torch.where((source < rows.shape[1])[..., None], shifted, 0.0)


def _blocks_onto_slots(chosen: torch.Tensor, start: torch.Tensor, block_size: int, slots: int) -> torch.Tensor:
    """[b, ..., blocks] bool choices of blocks of `block_size` keys counted from row b's slot `start[b]` -> [b, ...,
    slots]: each slot its block's choice, none before the row's start."""
    relative = torch.arange(slots, device=chosen.device) - start[:, None]  # [b, slots]
    shape = (relative.shape[0],) + (1,) * (chosen.dim() - 2) + (slots,)
    block = (relative.clamp(min=0) // block_size).view(shape).expand(*chosen.shape[:-1], slots)
    return chosen.gather(-1, block) & (relative >= 0).view(shape)


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """A layer's [b, 1, q, k] mask (bool, or additive: 0 where seen) -> [b, q, k]: which keys each query sees."""
    return mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0


def _row_starts_and_lengths(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, q, k] visibility -> each row's first key any query sees [b], and each query's count of keys from there
    to its last visible one [b, q] (masked keys in between counted, so later keys keep their positions; 0 for a
    query seeing none)."""
    start = _row_starts(visible)
    end = visible.shape[-1] - visible.flip(-1).int().argmax(-1)
    return start, (end - start[:, None]) * visible.any(-1)


def _row_starts(visible: torch.Tensor) -> torch.Tensor:
    """[b, q, k] visibility -> each row's first key any query sees [b]."""
    return visible.any(1).int().argmax(-1)


def captured_kolibri_indexer(model: torch.nn.Module, indexer: torch.nn.Module) -> None:
    """Give `indexer` (a `Kolibri1_1Indexer`) the batched forward: its class becomes a subclass of its own (its
    `top_k_mask` kept) with `CapturedKolibriIndexer`'s forward and its modeling module's NVFP4 rounding."""
    indexer.__class__ = subclass_once(_captured, type(indexer))


def _captured(own: type) -> type:
    rounding = staticmethod(sys.modules[own.__module__].nvfp4_fake_quantize)
    return type(f"Captured{own.__name__}", (CapturedKolibriIndexer, own), {"quantize": rounding})


class RowAlignedIndexKeys:
    """What a MiniMax-M3 indexer reads through `cache.layers[layer].update_index(keys)`, over a `TargetCache`: its
    keys [b, 1, t, d] written at the rows' slots (`TargetCache.update_indexer`), and every slot's returned shifted
    left by the row's padding, zeros after the row's slots. transformers' indexer then counts key blocks, and the
    keys' positions, from each row's first real key, as for the row alone (it anchors them to slot 0, so a
    left-padded row's blocks would straddle its padding): the block indices it returns count from there too, and
    `picked_blocks_only` lays them back onto the slots."""

    def __init__(self, cache, layer: int):
        self.cache, self.layer = cache, layer
        self.layers = {layer: self}

    def update_index(self, keys: torch.Tensor) -> torch.Tensor:
        cached = self.cache.update_indexer(keys[:, 0], self.layer)  # [b, slots, d]
        return _shifted_left(cached, self.cache.pad, cached.shape[1])[:, None]


class RowAlignedMiniMaxM3Indexer(torch.nn.Module):
    """A MiniMax-M3 indexer (`MiniMaxM3VLIndexer`, whose forward runs) reading its keys row-aligned
    (`RowAlignedIndexKeys`) from a `TargetCache`; from any other cache, as transformers runs it."""

    def forward(self, hidden_states, position_embeddings, cache, position_ids):
        if hasattr(cache, "pad"):  # a TargetCache (the rows' left padding); transformers' caches have none
            cache = RowAlignedIndexKeys(cache, self.layer_idx)
        return super().forward(hidden_states, position_embeddings, cache, position_ids)


def row_aligned_minimax_m3_indexer(model: torch.nn.Module, indexer: torch.nn.Module) -> None:
    """Give `indexer` (a `MiniMaxM3VLIndexer`) row-aligned keys: its class becomes a subclass of its own with
    `RowAlignedMiniMaxM3Indexer`'s forward in front."""
    indexer.__class__ = subclass_once(_row_aligned, type(indexer))


def _row_aligned(own: type) -> type:
    return type(f"RowAligned{own.__name__}", (RowAlignedMiniMaxM3Indexer, own), {})


def picked_blocks_only(mask: torch.Tensor, blocks: torch.Tensor, block_size: int, heads: int) -> torch.Tensor:
    """An additive mask [b, 1, t, s] -> [b, heads, t, s] with every key outside the blocks a query's head picked
    masked out: `blocks` [b, index heads, t, k] (-1: none) count blocks of `block_size` keys from each row's first
    visible key (`RowAlignedIndexKeys`); each index head's pick serves its group of `heads // index heads` query
    heads, as transformers' `build_block_mask` expands it (there from slot 0)."""
    slots, index_heads = mask.shape[-1], blocks.shape[1]
    start = _row_starts(mask[:, 0] == 0)
    count = -(-slots // block_size)
    picked = blocks.new_zeros((*blocks.shape[:3], count + 1), dtype=torch.bool)
    picked.scatter_(-1, blocks.masked_fill(blocks < 0, count), True)  # none: the column past the last block
    kept = _blocks_onto_slots(picked, start, block_size, slots)
    return mask.masked_fill(~kept.repeat_interleave(heads // index_heads, dim=1), torch.finfo(mask.dtype).min)


class RowPooledGlm5NextIndexer(torch.nn.Module):
    """A GLM-5-Next indexer (`Glm5NextTextIndexer`, whose attributes and `append_visible_tail` it uses) over a
    `TargetCache`; over any other cache, as transformers runs it.

    transformers' indexer caches per token its key, its pool gate's score and a validity flag (the token's padding
    mask), forms pools of `index_kpool` consecutive keys from each row's first valid key (each pool's key the
    softmax-weighted sum of its keys by their gates), and lets a query pick the best `index_topk // index_kpool` of
    the complete pools whose last key it sees (causal by slots counted from the cache's one length), plus the tail
    of its newest keys not yet pooled. It drops the pools no row completes (a shape that follows the data) and reads
    the one length. Here the layer's own mask says what each query sees (each row's padding, length and block), the
    pools start at the first key any query of the row sees, and every pool of the buffer is scored, those a query may
    not pick masked out: the same pools, keys and picks (a pool past every row's keys is never picked; with more
    pools than transformers keeps, the number picked grows only where every pickable pool is picked anyway)."""

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, q_resid: torch.Tensor, attention_mask: torch.Tensor,
                cache) -> torch.Tensor:
        """The [b, t, width] int32 slots each query attends to (-1: none), as transformers' indexer returns them."""
        if not hasattr(cache, "pad"):  # transformers' own caches (their 2-D mask)
            return super().forward(hidden_states, q_resid, attention_mask, cache)
        visible = _visible(attention_mask)
        batch, tokens = hidden_states.shape[:2]
        queries = self.wq_b(q_resid).view(batch, tokens, -1, self.head_dim)
        keys = self.k_norm(self.wk(hidden_states))
        gates = F.linear(hidden_states, self.index_kpool_compress_gate)
        keys, gates = cache.update_indexer(torch.cat([keys, gates], dim=-1), self.layer_idx).split(self.head_dim, -1)
        pool_keys, pool_slots = self._pools(keys, gates, _row_starts(visible))
        scores = (queries.float() @ pool_keys.transpose(-1, -2).float().unsqueeze(1) * self.softmax_scale).relu()
        weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        index_scores = (weights.unsqueeze(-2) @ scores).squeeze(-2)  # [b, t, pools]
        return self._picked_slots(index_scores, pool_slots, visible).to(torch.int32)

    def _pools(self, keys: torch.Tensor, gates: torch.Tensor, start: torch.Tensor):
        """Every pool of `index_kpool` slots from each row's `start` [b]: its key [b, pools, d] (the softmax of its
        keys' gates plus `index_kpool_compress_ape` over the slots inside the buffer) and its slots [b, pools,
        kpool]."""
        slots, size = keys.shape[1], self.index_kpool
        pool_slots = start[:, None] + torch.arange(-(-slots // size) * size, device=keys.device)
        pool_slots = pool_slots.view(keys.shape[0], -1, size)
        inside, held = pool_slots < slots, pool_slots.clamp(max=slots - 1)
        rows = torch.arange(keys.shape[0], device=keys.device)[:, None, None]
        logits = gates[rows, held].float() + self.index_kpool_compress_ape.float()
        weights = torch.nan_to_num(logits.masked_fill(~inside[..., None], float("-inf")).softmax(dim=2))
        return (weights.to(keys.dtype) * keys[rows, held]).sum(dim=2), pool_slots

    def _picked_slots(self, index_scores: torch.Tensor, pool_slots: torch.Tensor, visible: torch.Tensor):
        """The slots of each query's best pools (among those whose last slot it sees), then of its tail, -1 padded to
        transformers' width; none for a query that sees nothing (padding)."""
        slots = visible.shape[-1]
        last = pool_slots[..., -1]  # [b, pools]
        pickable = visible.gather(-1, last.clamp(max=slots - 1)[:, None].expand(-1, visible.shape[1], -1))
        pickable &= (last < slots)[:, None]
        index_scores = index_scores.masked_fill(~pickable, torch.finfo(index_scores.dtype).min)
        best = index_scores.topk(min(self.index_topk // self.index_kpool, index_scores.shape[-1]), dim=-1).indices
        rows = torch.arange(pool_slots.shape[0], device=pool_slots.device)[:, None, None]
        picked = pool_slots[rows, best].masked_fill(~pickable.gather(-1, best)[..., None], -1).flatten(-2)
        width = self.index_topk
        if self.index_kpool_always_select_tail:
            picked = self.append_visible_tail(picked, visible, visible.any(1))
            width += self.index_kpool - 1
        picked = F.pad(picked, (0, width - picked.shape[-1]), value=-1)
        return picked.masked_fill(~visible.any(-1, keepdim=True), -1)


def row_pooled_glm5_next_indexer(model: torch.nn.Module, indexer: torch.nn.Module) -> None:
    """Give `indexer` (a `Glm5NextTextIndexer`) `RowPooledGlm5NextIndexer`'s forward: its class becomes a subclass of
    its own with that forward in front."""
    indexer.__class__ = subclass_once(_row_pooled, type(indexer))


def _row_pooled(own: type) -> type:
    return type(f"RowPooled{own.__name__}", (RowPooledGlm5NextIndexer, own), {})


class BatchedQwen4ExpIndexer(torch.nn.Module):
    """A Qwen4-Exp QSA indexer (`Qwen4ExpTextQSAIndexer`, whose attributes it uses) for every query at once over a
    `TargetCache`; over any other cache, as transformers runs it.

    transformers' indexer loops over rows and queries (`nonzero` of each query's mask): a query's visible keys, in
    blocks of `compress_ratio` from its first, each complete block's key the mean of its keys, k-normed and rotated to
    the block's first position; it attends over the `indexer_budget / compress_ratio` blocks whose keys score best
    (ReLU of each index head's product, summed over heads) and its visible keys after the complete blocks (the tail).
    Here every query of a row shares the row's first visible key (the decoder's masks: causal over each row's left
    padding), so the blocks are the row's, scored once for all its queries, and a query picks among those complete
    for it: the same keys. A block's first position is its row position (`block_rotary`: the model's rotary
    embedding, handed over by `batched_qwen4_exp_indexer`)."""

    rotate = None  # transformers' `apply_rotary_pos_emb`, set per modeling module (`batched_qwen4_exp_indexer`)

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask: torch.Tensor, cache,
                **kwargs) -> torch.Tensor:
        """[b, 1, t, slots] bool: the keys each query attends to, as transformers' indexer returns them (`kwargs`:
        transformers' own, which 5.25 passes it)."""
        if not hasattr(cache, "pad"):
            return super().forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        batch, tokens = hidden_states.shape[:2]
        queries, keys = self.index_qk_proj(hidden_states).split(
            [self.index_n_heads * self.index_head_dim, self.index_kv_heads * self.index_head_dim], dim=-1)
        cos, sin = (x[:, -tokens:] for x in position_embeddings)
        queries = self.rotate(self.q_layernorm(queries.view(batch, tokens, -1, self.index_head_dim)), cos=cos, sin=sin,
                              unsqueeze_dim=2)
        keys = cache.update_indexer(keys.view(batch, tokens, self.index_head_dim), self.layer_idx)
        visible = _visible(attention_mask)
        start, seen = _row_starts(visible), visible.sum(-1)  # [b], [b, t]
        block_keys = self._block_keys(keys, start)  # [b, blocks, d]
        scores = (queries.float() @ block_keys.float().transpose(-1, -2).unsqueeze(1)).relu()  # [b, t, heads, blocks]
        scores = scores.sum(dim=2) / math.sqrt(self.index_head_dim)
        complete = seen // self.compress_ratio  # [b, t]: the blocks complete for each query
        blocks = torch.arange(block_keys.shape[1], device=keys.device)
        pickable = blocks < complete[..., None]
        best = scores.masked_fill(~pickable, float("-inf")).topk(min(self.block_topk, blocks.numel()), dim=-1).indices
        chosen = torch.zeros_like(pickable).scatter(-1, best, True) & pickable
        relative = torch.arange(visible.shape[-1], device=keys.device) - start[:, None, None]  # [b, 1, slots]
        tail = relative >= (complete * self.compress_ratio)[..., None]
        return ((_blocks_onto_slots(chosen, start, self.compress_ratio, visible.shape[-1]) | tail) & visible)[:, None]

    def _block_keys(self, keys: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Every block of `compress_ratio` slots from each row's `start` [b]: the mean of its keys, k-normed, rotated
        to its first row position [b, blocks, d] (blocks past the buffer's end never complete: any key)."""
        ratio = self.compress_ratio
        blocks = -(-keys.shape[1] // ratio)
        slots = (start[:, None] + torch.arange(blocks * ratio, device=keys.device)).clamp(max=keys.shape[1] - 1)
        grouped = keys.gather(1, slots[..., None].expand(-1, -1, keys.shape[-1])).view(keys.shape[0], blocks, ratio, -1)
        pooled = self.k_layernorm(grouped.float().mean(dim=2).to(keys.dtype))
        positions = (torch.arange(blocks, device=keys.device) * ratio).expand(3, keys.shape[0], -1)
        cos, sin = self.block_rotary(pooled, positions)
        return self.rotate(pooled.unsqueeze(1), cos=cos, sin=sin).squeeze(1)


def batched_qwen4_exp_indexer(model: torch.nn.Module, indexer: torch.nn.Module) -> None:
    """Give `indexer` (a `Qwen4ExpTextQSAIndexer`) `BatchedQwen4ExpIndexer`'s forward, and the model's rotary embedding
    for its blocks (kept out of the module tree: the model holds it)."""
    indexer.__class__ = subclass_once(_batched, type(indexer))
    rotary = next(module for module in model.modules() if type(module).__name__ == "Qwen4ExpTextRotaryEmbedding")
    indexer.__dict__["block_rotary"] = rotary


def _batched(own: type) -> type:
    rotate = staticmethod(sys.modules[own.__module__].apply_rotary_pos_emb)
    return type(f"Batched{own.__name__}", (BatchedQwen4ExpIndexer, own), {"rotate": rotate})


class _NoPositionHistory:
    """A cache layer's `indexer_position_ids` that keeps nothing: Qwen4-Exp's model appends each forward's positions
    to the first indexed layer's history, for transformers' indexers to rotate blocks by; `BatchedQwen4ExpIndexer`
    rotates them by their row positions and needs none, and without the history the rotary embeddings the model hands
    its layers are the forward's own tokens' (what its attention takes them as)."""

    @property
    def indexer_position_ids(self) -> None:
        return None

    @indexer_position_ids.setter
    def indexer_position_ids(self, positions: torch.Tensor) -> None:
        pass


def _without_position_history(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """The forward pre-hook of a Qwen4-Exp text model: a `TargetCache` gets layers that keep no position history."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if hasattr(cache, "pad") and not cache.layers:
        cache.layers = [_NoPositionHistory()] * len(model.config.layer_types)


def keeps_no_position_history(text_model: torch.nn.Module) -> bool:
    """Whether `no_position_history` hooked `text_model` already."""
    return _without_position_history in text_model._forward_pre_hooks.values()


def no_position_history(model: torch.nn.Module, text_model: torch.nn.Module) -> None:
    """Hook `text_model` (a `Qwen4ExpTextModel`) so that a `TargetCache` keeps no position history
    (`_NoPositionHistory`)."""
    text_model.register_forward_pre_hook(_without_position_history, with_kwargs=True)
