"""DeepSeek-V4's compressed attention over the target cache: each row's entries from its own windows, taken back
by position.

A DeepSeek-V4 layer attends over a sliding window of its keys plus compressed entries: one per window of `rate`
tokens (HCA: 128; CSA: 4, each entry also reading the previous window's first-half projections), a softmax-weighted
sum of the window's projections (`kv_proj`, weights from `gate_proj` plus a bias by position in the window), normed and
rotated to the window's first position. A CSA layer's queries see only the entries its indexer picks (`index_topk`
best by a lightning score against entries compressed the same way at `index_head_dim`).

transformers' compressors (`DeepseekV4HCACompressor`, `DeepseekV4CSACompressor` and its `DeepseekV4Indexer`) keep per
layer the projections of the tokens since the last whole window, the entries emitted so far and the previous window's
first halves, advanced by each forward for the whole batch: windows counted from slot 0 (a left-padded row's straddle
its padding) and nothing that a rejected draft could be taken back from (its cache layers are not croppable). Over a
`TargetCache` (`RowCompressor`):
- every token's projections are written at its slot as its keys are (`TargetCache.update_beside`: the layer's ring
  when a window fits in it), so a rolled-back tail is overwritten by the tokens that replace it;
- each new token closing one of its row's windows (row position t, (t + 1) % rate == 0, counted from the row's first
  real token) makes that window's entry from the cached projections and writes it at its index in the row's entries
  (`TargetCache.compressed_entries`);
- a query at row position t sees entries w < (t + 1) // rate only, so an entry a rolled-back token wrote stays
  unseen until a kept token closes its window and writes it again.
The entries are transformers' for the row alone: the same projections, softmax weights in the same order, norm and
rotary position w * rate. Any other cache runs transformers' forwards."""

from __future__ import annotations

import sys

import torch

from .subclassing import subclass_once


class RowCompressor(torch.nn.Module):
    """The per-row forward of a DeepSeek-V4 compressor or indexer (whose modules it uses: `kv_proj`, `gate_proj`,
    `position_bias`, `kv_norm`, `rotary_emb`), made by `row_compressor`. `overlap`: the CSA's entries read the
    previous window's first halves too; `window`: the model's sliding window (set by `row_compressor`)."""

    overlap = False
    entries_name = "compressor"  # its entries' and projections' name in the cache, with the layer's index
    window = 0
    rotate = None  # its modeling module's `apply_rotary_pos_emb`

    def forward(self, hidden_states, q_residual, position_ids, cache=None, layer_idx: int = 0, **kwargs):
        if not hasattr(cache, "pad"):  # transformers' caches: the batch's one buffer
            return super().forward(hidden_states, q_residual, position_ids, cache, layer_idx, **kwargs)
        entries = self.row_entries(hidden_states, cache, layer_idx)
        return self.attend(entries, hidden_states, q_residual, position_ids, cache, layer_idx)

    def attend(self, entries, hidden_states, q_residual, position_ids, cache, layer_idx):
        """An HCA layer's entries [b, 1, n, d] and their additive bias [b, 1, t, n]: each query sees the entries of
        its row's windows that closed at or before it."""
        seen = _closed(entries.shape[1], position_ids, self.compress_rate)
        bias = torch.zeros((), dtype=entries.dtype, device=entries.device)
        return entries[:, None], torch.where(seen, bias, torch.finfo(entries.dtype).min)[:, None]

    def row_entries(self, hidden_states: torch.Tensor, cache, layer_idx: int) -> torch.Tensor:
        """The entries [b, n, d] of each row's closed windows after this forward (n: the most any row can have), the
        windows this forward's tokens close made and written (`TargetCache.compressed_entries`)."""
        rate, width = self.compress_rate, hidden_states.shape[1]
        name = f"{self.entries_name} {layer_idx}"
        span = 2 * rate if self.overlap else rate
        kv, gate = cache.update_beside(name, layer_idx, self.kv_proj(hidden_states)[:, None],
                                       self.gate_proj(hidden_states)[:, None], ring=span <= self.window)
        closing, entry, closes = _closing_tokens(cache, width, rate)
        window_slots = closing[..., None] - span + 1 + torch.arange(span, device=closing.device)
        index = cache.held_slots(window_slots, name, width).clamp(0, kv.shape[2] - 1)
        made = self._compress(_gathered(kv[:, 0], index), _gathered(gate[:, 0], index), entry)
        entries = cache.compressed_entries(name, rate, made)
        spill = entries.shape[1] - 1  # windows not closed write the spare last row
        entries.scatter_(1, torch.where(closes, entry, spill)[..., None].expand_as(made), made)
        count = spill if cache.visible is None else min(spill, cache.visible // rate)
        return entries[:, :count]

    def _compress(self, kv: torch.Tensor, gate: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        """Windows' projections [b, k, span, D] -> their entries [b, k, d], as transformers' compressor makes them:
        softmax over the window (fp32) of the gate plus the bias by position, the weighted sum, the norm, rotary
        position entry * rate. CSA: the previous window's first halves then this one's second halves (none before
        entry 0)."""
        if self.overlap:
            d, rate = self.head_dim, self.compress_rate
            gate = gate + self.position_bias.repeat(2, 1)
            kv = torch.cat([kv[:, :, :rate, :d], kv[:, :, rate:, d:]], dim=2)
            gate = torch.cat([gate[:, :, :rate, :d], gate[:, :, rate:, d:]], dim=2)
            no_earlier = (entry == 0)[..., None, None] & (torch.arange(2 * rate, device=kv.device) < rate)[:, None]
            kv, gate = kv.masked_fill(no_earlier, 0.0), gate.masked_fill(no_earlier, float("-inf"))
        else:
            gate = gate + self.position_bias
        compressed = self.kv_norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        cos, sin = self.rotary_emb(compressed, position_ids=entry.clamp(min=0) * self.compress_rate,
                                   layer_type=self.rope_layer_type)
        return self.rotate(compressed.unsqueeze(1), cos, sin).squeeze(1)


class RowCSACompressor(RowCompressor):
    """A CSA compressor's per-row forward: its entries, each query seeing those its indexer picked (a
    `RowIndexer`)."""

    overlap = True

    def attend(self, entries, hidden_states, q_residual, position_ids, cache, layer_idx):
        picks = self.indexer(hidden_states, q_residual, position_ids, cache, layer_idx)  # [b, t, k], -1: none
        count = entries.shape[1]
        bias = entries.new_full((*picks.shape[:2], count + 1), torch.finfo(entries.dtype).min)
        bias.scatter_(-1, picks.masked_fill(picks < 0, count), 0.0)
        return entries[:, None], bias[..., :count][:, None]


class RowIndexer(RowCompressor):
    """A CSA indexer's per-row forward: the `index_topk` entries of its own (compressed as the CSA's) that score best
    against each query, among those the query sees; [b, t, k] entry indices, -1 where fewer are seen."""

    overlap = True
    entries_name = "indexer"

    def attend(self, entries, hidden_states, q_residual, position_ids, cache, layer_idx):
        cos, sin = self.rotary_emb(hidden_states, position_ids=position_ids, layer_type=self.rope_layer_type)
        batch, width = hidden_states.shape[:2]
        query = self.q_b_proj(q_residual).view(batch, width, -1, self.head_dim).transpose(1, 2)
        query = self.rotate(query, cos, sin).transpose(1, 2)
        seen = _closed(entries.shape[1], position_ids, self.compress_rate)
        scores = self.scorer(query, entries, hidden_states).masked_fill(~seen, float("-inf"))
        picks = scores.topk(min(self.index_topk, entries.shape[1]), dim=-1).indices
        return picks.masked_fill(~seen.gather(-1, picks), -1)


def _closed(count: int, position_ids: torch.Tensor, rate: int) -> torch.Tensor:
    """[b, t, count] whether each query (row positions [b, t]) sees each entry: its window closed at or before it."""
    return torch.arange(count, device=position_ids.device) < ((position_ids + 1) // rate)[..., None]


def _closing_tokens(cache, width: int, rate: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new tokens of each row that could close a window of `rate` of its tokens: their slots [b, k], their
    windows' entry index, and whether they do (a real token of the forward, its row's `rate`-th, 2 * `rate`-th,
    ...). k = ceil(width / rate): one forward's most."""
    start = cache.lengths - cache.pad  # the row position of each row's first new token
    offsets = (rate - 1 - start).remainder(rate)[:, None] + rate * torch.arange(-(-width // rate),
                                                                                 device=start.device)
    positions = start[:, None] + offsets
    return cache.lengths[:, None] + offsets, (positions + 1) // rate - 1, (offsets < width) & (positions >= rate - 1)


def _gathered(projections: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[b, slots, D] projections at [b, k, span] indices -> [b, k, span, D]."""
    flat = index.reshape(index.shape[0], -1, 1).expand(-1, -1, projections.shape[-1])
    return projections.gather(1, flat).view(*index.shape, -1)


_ROW_CLASSES = {"DeepseekV4HCACompressor": RowCompressor, "DeepseekV4CSACompressor": RowCSACompressor,
                "DeepseekV4Indexer": RowIndexer}


def row_compressor(model: torch.nn.Module, compressor: torch.nn.Module) -> None:
    """Give `compressor` (a DeepSeek-V4 HCA / CSA compressor or CSA indexer) its per-row forward over a
    `TargetCache`: its class becomes a subclass of its own with `RowCompressor`'s (or the CSA's, the indexer's)
    in front, and it learns the model's sliding window."""
    compressor.__class__ = subclass_once(_row, type(compressor))
    compressor.window = model.config.get_text_config().sliding_window


def _row(own: type) -> type:
    rotate = staticmethod(sys.modules[own.__module__].apply_rotary_pos_emb)
    return type(f"Row{own.__name__}", (_ROW_CLASSES[own.__name__], own), {"rotate": rotate})
