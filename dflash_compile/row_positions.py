"""Attention layers that read token positions themselves, given each row's own from the target cache.

transformers' Inkling attention biases its logits by the distance from query to key (`InklingRelativeLogits`: each
query mixes a bank of bias-vs-distance profiles) and scales its full layers' queries and biases by the log of the
query's position. It takes both from the cache's one length (`get_query_offset`, `get_mask_sizes`): every row at the
same slots, keys in order from slot 0. The target cache keeps rows of their own lengths, left padding in front, and
a sliding layer's keys in a ring. Here the distances are slot differences of each query and each key the layer
attends over (`TargetCache.query_and_key_slots`: a ring slot's newest token up to the query), and the log scaling
reads each row's own positions (padding not counted, as the row alone)."""

from __future__ import annotations

import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .subclassing import subclass_once


class RowPositionedInklingAttention(torch.nn.Module):
    """An Inkling attention layer (`InklingAttention`, whose modules and forward it uses) that reads positions per row
    from a `TargetCache`; with any other cache, transformers' forward as it is."""

    eager_attention = None  # its modeling module's `eager_attention_forward` (`row_positioned_inkling_attention`)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, conv_mask=None, cache=None,
                **kwargs):
        if not hasattr(cache, "pad"):  # transformers' caches have no rows of their own
            return super().forward(hidden_states, attention_mask, conv_mask, cache, **kwargs)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)
        key = self.k_norm(self.k_sconv(self.k_proj(hidden_states), cache=cache, conv_mask=conv_mask).view(shape))
        value = self.v_sconv(self.v_proj(hidden_states), cache=cache, conv_mask=conv_mask).view(shape)
        key, value = cache.update(key.transpose(1, 2), value.transpose(1, 2), self.layer_idx)
        query_slots, key_slots = cache.query_and_key_slots(hidden_states.shape[1], self.layer_idx in cache.rows.sizes)
        mixes = self.r_proj(hidden_states).view(*hidden_states.shape[:-1], self.num_heads, -1)
        bias = self._position_bias(mixes, query_slots - key_slots)
        if not self.is_sliding and self.config.log_scaling_n_floor is not None:
            tau = self._log_scaling(cache.positions(hidden_states.shape[1]))
            query, bias = (query.float() * tau).to(query.dtype), (bias.float() * tau).to(bias.dtype)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self.eager_attention)
        out, weights = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                              sliding_window=self.sliding_window, position_bias=bias, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights

    def _position_bias(self, relative_states: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        """[b, q, heads, d_rel] mixing weights, [b, q, keys] query-to-key distances -> [b, heads, q, keys]: each
        head's profile at each distance, zero outside [0, extent) (`InklingRelativeLogits`' bias, per row)."""
        profiles = (relative_states @ self.rel_logits_proj.proj).transpose(1, 2)  # [b, heads, q, extent]
        extent = self.rel_logits_proj.rel_extent
        index = distance.clamp(0, extent - 1)[:, None].expand(*profiles.shape[:3], -1)
        outside = ((distance < 0) | (distance >= extent))[:, None]
        return profiles.gather(-1, index).masked_fill(outside, 0.0)

    def _log_scaling(self, positions: torch.Tensor) -> torch.Tensor:
        """[b, q] positions -> [b, 1, q, 1]: 1 + alpha log(max((position + 1) / floor, 1)), in fp32."""
        scaled = ((positions + 1).float() / self.config.log_scaling_n_floor).clamp(min=1.0)
        return (1.0 + self.config.log_scaling_alpha * torch.log(scaled))[:, None, :, None]


def row_positioned_inkling_attention(model: torch.nn.Module, attention: torch.nn.Module) -> None:
    """Give `attention` (an `InklingAttention`) positions per row: its class becomes a subclass of its own with
    `RowPositionedInklingAttention`'s forward in front."""
    attention.__class__ = subclass_once(_row_positioned, type(attention))


def _row_positioned(own: type) -> type:
    eager = staticmethod(sys.modules[own.__module__].eager_attention_forward)
    return type(f"RowPositioned{own.__name__}", (RowPositionedInklingAttention, own), {"eager_attention": eager})


def row_relative_distances(model: torch.nn.Module, text_model: torch.nn.Module) -> None:
    """Inkling 2's model computes its layers' query-to-key distances once a forward (`get_relative_distance`, from
    the cache's one length: [q, k]): its modeling module's function then gives them per row from a `TargetCache`
    ([b, 1, q, k], as `RowPositionedInklingAttention` computes them; its layers' bias broadcasts over rows), and
    transformers' own from any other cache."""
    modeling = sys.modules[type(text_model).__module__]
    original = modeling.get_relative_distance

    def relative_distance(inputs_embeds: torch.Tensor, cache, is_sliding: bool) -> torch.Tensor:
        if not hasattr(cache, "pad"):  # transformers' caches: rows at one length
            return original(inputs_embeds, cache, is_sliding)
        query, key = cache.query_and_key_slots(inputs_embeds.shape[1], is_sliding and bool(cache.ring_size))
        return (query - key)[:, None]

    relative_distance.per_row = True
    modeling.get_relative_distance = relative_distance


def distances_per_row(text_model: torch.nn.Module) -> bool:
    """Whether `row_relative_distances` gave this model's modeling module its per-row distances."""
    return getattr(sys.modules[type(text_model).__module__].get_relative_distance, "per_row", False)
