"""Grouped-query attention over the cache's keys and values as they are, for the target's forwards.

transformers' SDPA and gpt-oss's eager attention repeat every key/value head for the query heads of its group
(`repeat_kv`) before attending, whenever a mask is given, which our forwards always give: each layer of each step
copies its whole cache, every slot of its capacity, `num_key_value_groups` times over (gpt-oss-20b and
Qwen3-30B-A3B: 8), two kernels a layer on a GPU. Here the group's query heads are folded into the query length
instead, [b, heads, t, d] -> [b, kv heads, groups * t, d], so the queries of one group attend to their one
key/value head directly; the result is unfolded back. The same products and sums per query, without the copies.

`grouped_attention(model)` makes the model's attention layers use this while the decoder runs them, for the
implementations it reproduces: "sdpa" (torch's scaled_dot_product_attention, folded) and, for families whose
attention has sinks (`FamilySpec.attention_sinks`: gpt-oss, which runs "eager"), the sink softmax of gpt-oss's
eager attention (one learned logit per head joins each query's softmax and is dropped after it), also by SDPA:
on a 2-core CPU 4-12x faster than that eager math in bf16 for 1-256 new tokens (docs/benchmarks.md). A prompt
without left padding comes without a mask (`unmasked_is_causal`): SDPA by its causal flag, and sinks, in every
prefill chunk (`unmasked_chunks`), by flash attention's causal flag with each row's log-sum-exp, the sink's share of
the softmax applied after (sliding layers by blocks of their window), 2.2x faster than the sink as a key slot under
a mask at 4096 tokens on the H200.
Other implementations (flash, flex, a family's own eager) run as the user chose.

Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash: `FamilySpec.latent_attention`) caches one compressed latent
and one rotary key per token, and transformers expands the whole cache through kv_b_proj into every head's keys and
values at every forward (GLM-4.7-Flash at 8192 slots: 75 GFLOP a layer a step). While `grouped_attention` runs such
a model its layers hand over the latents as cached, and decode and verify steps attend in the latent space
(`absorbed_attention`: kv_b_proj folded into the queries and the output instead); a long prefill expands.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .families import spec_for_model
from .key_selection import picked_blocks_only

NAME = "dflash_grouped"
_SINK_DIMS = 8  # query/key dimensions added for the sink logit (`_sink_attention`)


def _fold(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, heads, t, d] -> [b, kv_heads, groups * t, d]: each key/value head's query heads one after another."""
    b, heads, t, d = query.shape
    return query.reshape(b, kv_heads, heads // kv_heads * t, d)


def _unfold(out: torch.Tensor, heads: int, t: int) -> torch.Tensor:
    """[b, kv_heads, groups * t, d] -> [b, t, heads, d], as transformers' attention functions return."""
    return out.reshape(out.shape[0], heads, t, out.shape[-1]).transpose(1, 2).contiguous()


def folding_pays(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether folding the queries [b, heads, t, d] over keys [b, kv_heads, s, d] saves memory traffic with a mask:
    the folded mask grows by groups x t x s, the key/value copies it saves by heads x s x d (a long prefill
    chunk: the copies are cheaper)."""
    heads, t, kv_heads = query.shape[1], query.shape[2], key.shape[1]
    return heads // kv_heads * t <= 2 * heads * key.shape[-1]


def _folded_mask(mask: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """An additive [b, 1 or heads, t, s] mask for the folded queries: [b, 1 or kv_heads, groups * t, s]."""
    b, mask_heads, t, s = mask.shape
    if mask_heads == 1:
        return mask[:, :, None].expand(b, 1, groups, t, s).reshape(b, 1, groups * t, s)
    return mask.reshape(b, kv_heads, groups * t, s)


def _mask_with_sink(mask: torch.Tensor) -> torch.Tensor:
    """An additive [..., s] mask plus the sink's slot, visible: [..., s + 1], in rows of whole multiples of 16
    elements, as SDPA's memory-efficient kernel takes a mask without copying it."""
    slots = mask.shape[-1]
    rows = mask.new_zeros(*mask.shape[:-1], (slots + 16) // 16 * 16)
    rows[..., :slots] = mask
    return rows[..., :slots + 1]


def _sink_attention(query, key, value, mask, sinks, scaling: float, dropout: float, training: bool):
    """gpt-oss's sink softmax on folded queries [b, kv_heads, groups * t, d] by torch's SDPA (fused kernels, no
    [rows, slots] score tensors in memory, where the eager math makes eight passes over them): each head's sink is
    one more key slot, always visible, whose value is zero, so its share of the softmax is dropped. Its score is
    the sink logit: a padding dimension holds 1 in the sink's key (0 in every other key) and the row's sink logit
    in the query, whose other dimensions come pre-scaled (`scale=1`: exact for gpt-oss's power-of-four head dims).
    Padding dimensions come in eights, as SDPA's fused kernels take head dims. A row that sees no slot sees the
    sink alone and gives zeros, as the eager math does. Queries may also come unfolded ([b, heads, t, d]:
    `folded_attention` where the folded mask would outweigh the copies): each key/value head is then written once per
    query head into the padded keys and values, which are copies anyway."""
    b, query_heads, rows, d = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    repeat = query_heads // kv_heads  # 1 for folded queries
    groups = sinks.numel() // query_heads  # query heads per row block of a head: 1 for unfolded queries
    row_sinks = sinks.to(query.dtype).view(1, query_heads, groups, 1).expand(b, -1, -1, rows // groups)
    query = torch.cat([query * scaling, row_sinks.reshape(b, query_heads, rows, 1),
                       query.new_zeros(b, query_heads, rows, _SINK_DIMS - 1)], dim=-1)
    padded_key = key.new_zeros(b, kv_heads, repeat, slots + 1, d + _SINK_DIMS)
    padded_key[..., :slots, :d] = key[:, :, None]
    padded_key[..., slots, d] = 1
    padded_value = value.new_zeros(b, kv_heads, repeat, slots + 1, value.shape[-1])
    padded_value[..., :slots, :] = value[:, :, None]
    key = padded_key.view(b, query_heads, slots + 1, d + _SINK_DIMS)
    value = padded_value.view(b, query_heads, slots + 1, value.shape[-1])
    if mask is not None:
        mask = _mask_with_sink(_folded_mask(mask, query_heads, groups))
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                            dropout_p=dropout if training else 0.0, scale=1.0)


def _attention_and_lse(query, key, value, mask, causal: bool, scale: float):
    """SDPA over queries [b, h, t, d] and keys/values of as many heads, with each row's log-sum-exp of its scaled
    scores ([b, h, t], fp32), from the fused kernels that return it: flash on the CPU, and on CUDA flash for half
    precision without a mask, else memory-efficient. Values narrower than the keys (MiMo-V2-Flash's) go in padded
    with zeros to the keys' size, which the flash kernels need, and come out cut back."""
    aten = torch.ops.aten
    width = value.shape[-1]
    if width < query.shape[-1]:
        value = torch.nn.functional.pad(value, (0, query.shape[-1] - width))
    if not query.is_cuda:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, attn_mask=mask,
                                                                    scale=scale)
    elif mask is None and query.dtype in (torch.float16, torch.bfloat16):
        out, lse = aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = aten._scaled_dot_product_efficient_attention(query, key, value, mask, True, 0.0, causal,
                                                                scale=scale)[:2]
    return out[..., :width], lse[..., :query.shape[2]]  # the memory-efficient kernel pads rows to multiples of 32


def _repeated(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, kv_heads, s, d] -> [b, heads, s, d]: each key/value head once per query head of its group."""
    b, kv_heads, s, d = x.shape
    return x[:, :, None].expand(b, kv_heads, heads // kv_heads, s, d).reshape(b, heads, s, d)


def _windowed_attention_and_lse(query, key, value, window: int, scale: float):
    """Causal attention inside `window` of queries [b, heads, t, d], the last t positions of keys/values [b,
    kv_heads, s, d], as batched blocks: queries in blocks of w (the window rounded up to eights, as the
    memory-efficient kernel takes mask rows), each block's queries of one key/value head folded together over the
    2w keys of its block and the one before, with one [2w]-wide mask row per query. A chunk of t tokens then costs
    t x 2w scores a head, not t x s. -> (out [b, heads, t, d], lse [b, heads, t])."""
    b, heads, t, d = query.shape
    kv_heads, earlier = key.shape[1], key.shape[2] - t
    groups, w = heads // kv_heads, -(-window // 8) * 8
    blocks = -(-t // w)
    padded = blocks * w
    folded = torch.nn.functional.pad(query, (0, 0, 0, padded - t)).view(b, kv_heads, groups, blocks, w, d)
    folded = folded.permute(0, 3, 1, 2, 4, 5).reshape(b * blocks, kv_heads, groups * w, d)

    def block_keys(x):  # [b, kv_heads, s, dx] -> [b * blocks, kv_heads, 2w, dx]: chunk tokens (j - 1)w .. (j + 1)w - 1
        x = torch.nn.functional.pad(x, (0, 0, w, padded - t))[:, :, earlier:].unfold(2, 2 * w, w)
        return x.permute(0, 2, 1, 4, 3).reshape(b * blocks, kv_heads, 2 * w, x.shape[3])

    row = torch.arange(w, 2 * w, device=query.device)[:, None]  # a query's index among its block's keys
    column = torch.arange(2 * w, device=query.device)
    first_key = torch.arange(earlier - w, earlier - w + padded, w, device=query.device)[:, None, None]  # of each block
    visible = (column <= row) & (row - column < window) & (first_key + column >= 0)  # [blocks, w, 2w]
    mask = torch.zeros(visible.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~visible, torch.finfo(query.dtype).min)
    mask = mask[None, :, None, None].expand(b, blocks, 1, groups, w, 2 * w).reshape(b * blocks, 1, groups * w, 2 * w)
    mask = mask.expand(-1, kv_heads, -1, -1)  # the memory-efficient kernel broadcasts no head dimension
    out, lse = _attention_and_lse(folded, block_keys(key), block_keys(value), mask, False, scale)
    out = out.reshape(b, blocks, kv_heads, groups, w, -1).permute(0, 2, 3, 1, 4, 5).reshape(b, heads, padded, -1)
    lse = lse.reshape(b, blocks, kv_heads, groups, w).permute(0, 2, 3, 1, 4).reshape(b, heads, padded)
    return out[:, :, :t], lse[..., :t]


def _with_sink(parts, sinks) -> torch.Tensor:
    """Rows' attention outputs [b, heads, t, d] over disjoint sets of keys, each with its log-sum-exp, as one
    softmax over all of them and each head's sink logit (whose value is zero): each part weighted by its share,
    softmax([lse_1, .., sink]) (one part: sigmoid(lse - sink)). -> [b, t, heads, d]."""
    lse = torch.stack([lse for _, lse in parts] + [sinks.float()[None, :, None].expand_as(parts[0][1])])
    shares = torch.softmax(lse, dim=0)
    out = sum(part.float() * share[..., None] for (part, _), share in zip(parts, shares))
    return out.to(parts[0][0].dtype).transpose(1, 2).contiguous()


def causal_sink_attention(query, key, value, sinks, scaling: float, window: int | None = None) -> torch.Tensor:
    """gpt-oss's sink softmax without a mask for queries [b, heads, t, d], the last t positions of the keys/values
    [b, kv_heads, s, d] (every earlier key a real earlier token: a prompt chunk after the ones before it): causal,
    inside `window` where given. By SDPA's fused kernels that return each row's log-sum-exp -- flash by its causal
    flag over the chunk's own keys and without it over the earlier ones; a window shorter than the keys by blocks,
    `_windowed_attention_and_lse` -- merged with the sink's logit by `_with_sink`. -> [b, t, heads, d]."""
    heads, earlier = query.shape[1], key.shape[2] - query.shape[2]
    if window is not None and window < key.shape[2]:
        return _with_sink([_windowed_attention_and_lse(query, key, value, window, scaling)], sinks)
    parts = [_attention_and_lse(query, _repeated(key[:, :, earlier:], heads), _repeated(value[:, :, earlier:], heads),
                                None, True, scaling)]
    if earlier:
        parts.append(_attention_and_lse(query, _repeated(key[:, :, :earlier], heads),
                                        _repeated(value[:, :, :earlier], heads), None, False, scaling))
    return _with_sink(parts, sinks)


def row_starts(first: list[int]) -> torch.Tensor:
    """What a prefill forward of a left-padded batch passes its attention layers in place of a mask: causal
    attention over the last t keys, as a missing mask means, for row b from its key first[b] on (its padding
    before it). An int64 [b, 1, 1, 1] tensor on the CPU: transformers hands a 4-D mask through as it is, and the
    attention reads it without a sync."""
    return torch.tensor(first, dtype=torch.int64)[:, None, None, None]


def _is_row_starts(mask) -> bool:
    return mask is not None and mask.dtype == torch.int64 and mask.dim() == 4 and mask.shape[1:] == (1, 1, 1)


def _by_rows(attend, query, key, value, starts: torch.Tensor) -> torch.Tensor:
    """`attend` (queries [1, heads, t', d], the last t' positions of keys/values [1, kv_heads, s', d] -> [1, t',
    heads, d]) row by row over each row's real keys (`row_starts`); queries of padding get zeros. -> [b, t, heads,
    d]."""
    b, heads, t, _ = query.shape
    out = query.new_zeros(b, t, heads, value.shape[-1])
    earlier = key.shape[2] - t
    for row, first in enumerate(starts.flatten().tolist()):
        real = max(first - earlier, 0)  # the row's first real query
        if real < t:
            out[row, real:] = attend(query[row:row + 1, :, real:], key[row:row + 1, :, first:],
                                     value[row:row + 1, :, first:])[0]
    return out


# The keyword argument the target's forward passes its attention layers (transformers hands unknown ones down to the
# attention function): `TargetCache.seen_slots`, the slots past which no new token sees, for `dflash::decode_attention`.
SEEN_SLOTS = "dflash_seen_slots"

# What `dflash::decode_attention` takes to its CUDA kernel: a decode or verify step's folded query rows per key/value
# head (a verify block of gpt-oss-20b or Qwen3-30B-A3B: 8 groups x 16 tokens), in programs of 16 rows. More (a
# prefill chunk) stay with SDPA's fused kernels: the kernel was never timed against them there.
DECODE_KERNEL_MAX_ROWS = 128


def decode_kernel_takes(query, key, value, mask) -> bool:
    """Whether `dflash::decode_attention` runs its CUDA kernel for these: bf16 or fp16 on CUDA, in shapes the
    kernel holds (`decode_kernel_shapes`)."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
            and decode_kernel_shapes(query, key, value, mask))


def decode_kernel_shapes(query, key, value, mask) -> bool:
    """At most DECODE_KERNEL_MAX_ROWS folded query rows, one head dim for queries, keys and values (a power of two
    from 16 to 256), and an additive mask [b, 1, t, s] over exactly the keys."""
    d = query.shape[-1]
    return (mask is not None and mask.is_floating_point() and mask.dim() == 4 and mask.shape[1] == 1
            and mask.shape[-1] == key.shape[2] and key.shape[-1] == value.shape[-1] == d and 16 <= d <= 256
            and d & (d - 1) == 0 and query.shape[1] // key.shape[1] * query.shape[2] <= DECODE_KERNEL_MAX_ROWS)


def folded_attention(query, key, value, mask, sinks, scaling: float, dropout: float = 0.0,
                     training: bool = False) -> torch.Tensor:
    """Grouped-query attention in torch's math: query [b, heads, t, d], key/value [b, kv_heads, s, d], an additive
    [b, 1 or heads, t, s] mask or None, sinks [heads] or None -> [b, t, heads, d]. The queries folded by group,
    then torch's SDPA with the folded mask, with sinks as one more key slot (`_sink_attention`); sinks with a mask
    that folding would outweigh (`folding_pays`) on unfolded queries instead."""
    heads, t, kv_heads = query.shape[1], query.shape[2], key.shape[1]
    if sinks is not None and mask is not None and not folding_pays(query, key):
        return _unfold(_sink_attention(query, key, value, mask, sinks, scaling, dropout, training), heads, t)
    folded = _fold(query, kv_heads)
    if sinks is not None:
        out = _sink_attention(folded, key, value, mask, sinks, scaling, dropout, training)
    else:
        folded_mask = None if mask is None else _folded_mask(mask, kv_heads, heads // kv_heads)
        out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=folded_mask,
                                                               dropout_p=dropout, scale=scaling)
    return _unfold(out, heads, t)


def _latents_as_cached(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A latent-attention layer's `expand_kv` while `grouped_attention` runs it: the cached latents handed over
    unexpanded, as (rotary key [b, 1, s, rope], latent [b, 1, s, r])."""
    return k_rot, kv_nope


def _absorbs(module, query: torch.Tensor, mask) -> bool:
    """Whether attending in the latent space costs fewer multiplies than expanding the cache: expanding is s x r x
    (nope + v) a head, whatever the new tokens; the latent space adds t x s x (2r - nope - v) a head to the scores and
    the weighted sum (keys of r + rope dims instead of nope + rope, values of r instead of v). Decode and verify
    steps (DeepSeek-V3 up to 170 tokens, GLM-4.7-Flash up to 398) absorb; a long prefill expands. Only with
    an additive mask over every slot: a forward without one (causal by flag) or row by row expands."""
    r, nope, v = module.kv_lora_rank, module.qk_nope_head_dim, module.v_head_dim
    return (isinstance(mask, torch.Tensor) and mask.is_floating_point() and mask.dim() == 4 and not module.training
            and query.shape[2] * (2 * r - nope - v) < r * (nope + v))


def absorbed_attention(module, query, rotary_key, latent, mask, scaling: float,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Latent attention over the cached latents as they are: query [b, heads, t, nope + rope], rotary key [b, 1, s,
    rope], latent [b, 1, s, r], an additive mask [b, 1, t, s], sinks [heads] or None -> [b, t, heads, v], as
    transformers' expanded keys and values give it (with sinks, HY V4's: each head's logit joins its rows' softmax
    and is dropped after it). A head's key is W_UK latent next to the shared rotary key, its value W_UV latent
    (kv_b_proj's rows of that head), so q . k = (q_nope W_UK) . latent + q_rot . k_rot and the weighted sum of values
    is W_UV (weighted sum of latents): the queries move into the latent space, every head's queries (folded, as
    `folded_attention` folds them) attend to the one latent, and the output moves back. Per step t x (nope + v) x r
    multiplies a head instead of transformers' s x r x (nope + v). In transformers' eager math (products, fp32
    softmax, product): its GEMMs spread the slots over the GPU's SMs, where a fused SDPA kernel would give one head's
    few query rows a handful of programs."""
    heads, nope = query.shape[1], module.qk_nope_head_dim
    up = _dense_weight(module.kv_b_proj, query.dtype).view(heads, nope + module.v_head_dim, -1)  # [heads, nope + v, r]
    q_nope, q_rot = query.split([nope, query.shape[-1] - nope], dim=-1)
    q_latent, q_rot = _fold(q_nope @ up[:, :nope], 1), _fold(q_rot, 1)  # [b, 1, heads * t, r or rope]
    scores = (q_latent @ latent.transpose(-1, -2) + q_rot @ rotary_key.transpose(-1, -2)) * scaling
    scores = scores + _folded_mask(mask, 1, heads)
    if sinks is not None:  # rows are head-major: head h's are h * t .. (h + 1) * t - 1
        column = sinks.to(scores.dtype).repeat_interleave(query.shape[2]).view(1, 1, -1, 1)
        scores = torch.cat([scores, column.expand(scores.shape[0], 1, -1, 1)], dim=-1)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = weights if sinks is None else weights[..., :-1]
    out = _unfold_heads(weights @ latent, heads)  # [b, heads, t, r]
    return (out @ up[:, nope:].transpose(1, 2)).transpose(1, 2)  # [b, t, heads, v]


def _unfold_heads(folded: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, 1, heads * t, d] -> [b, heads, t, d]."""
    return folded.reshape(folded.shape[0], heads, -1, folded.shape[-1])


def grouped_query_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """A transformers attention function (registered as NAME): query [b, heads, t, d], key/value [b, kv_heads, s,
    d] -> ([b, t, heads, d], None). A left-padded prefill's `row_starts` row by row, each as without a mask. With
    `s_aux` (gpt-oss's sinks) the sink softmax (without a mask: causal over the last t keys,
    `causal_sink_attention`), else torch's SDPA; without a mask (causal by flag), or where the
    folded mask would outweigh the key/value copies it saves (`folding_pays`: a long prefill), transformers' SDPA
    as it is. A few new tokens on CUDA (`decode_kernel_takes`: decode and verify steps) take
    `dflash::decode_attention`'s one launch. A latent-attention layer's cached latents (`_latents_as_cached`) are
    attended in the latent space where that costs less (`_absorbs`: decode and verify steps), else expanded by the
    layer's own `expand_kv` first. A DSA layer's `indices` (the keys its indexer picked) are folded into its mask,
    as transformers' eager and SDPA paths fold them, and so are a MiniMax-M3 sparse layer's `block_indices` (the
    blocks of keys each head's indexer picked, `key_selection.picked_blocks_only`)."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    indices, blocks = kwargs.pop("indices", None), kwargs.pop("block_indices", None)
    if indices is not None:
        attention_mask = _picked_keys_only(attention_mask, indices, key.shape[2])
    if blocks is not None:
        attention_mask = picked_blocks_only(attention_mask, blocks, module.indexer.block_size, query.shape[1])
    if getattr(module, "expand_kv", None) is _latents_as_cached:
        if _absorbs(module, query, attention_mask):
            return absorbed_attention(module, query, key, value, attention_mask, scaling, s_aux), None
        key, value = type(module).expand_kv(module, value, key)
    return _grouped(module, query, key, value, attention_mask, dropout, scaling, s_aux, **kwargs)


def _picked_keys_only(mask: torch.Tensor, indices: torch.Tensor, slots: int) -> torch.Tensor:
    """An additive mask [b, 1, t, slots] with every key not among a query's `indices` [b, t, k] masked out."""
    unpicked = indices.new_ones((*indices.shape[:2], slots), dtype=torch.bool).scatter(-1, indices.long(), False)
    return mask.masked_fill(unpicked[:, None], torch.finfo(mask.dtype).min)


def _grouped(module, query, key, value, attention_mask, dropout: float, scaling: float, s_aux, **kwargs):
    """`grouped_query_attention` over keys and values per head."""
    if _is_row_starts(attention_mask):
        def attend(*rows):
            return _grouped(module, *rows, None, dropout, scaling, s_aux, **kwargs)[0]

        return _by_rows(attend, query, key, value, attention_mask), None
    if s_aux is not None and attention_mask is None:
        return causal_sink_attention(query, key, value, s_aux, scaling, kwargs.get("sliding_window")), None
    if s_aux is None and (attention_mask is None or not folding_pays(query, key)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if not (dropout and module.training) and decode_kernel_takes(query, key, value, attention_mask):
        return torch.ops.dflash.decode_attention(query, key, value, attention_mask, s_aux, scaling,
                                                 kwargs.get(SEEN_SLOTS)), None
    return folded_attention(query, key, value, attention_mask, s_aux, scaling, dropout, module.training), None


AttentionInterface.register(NAME, grouped_query_attention)


def _replaces(model, implementation: str | None) -> bool:
    """Whether `grouped_query_attention` reproduces the model's attention implementation."""
    spec = spec_for_model(model)
    if spec is not None and spec.position_bias:  # a bias by position it does not add (transformers' SDPA adds it)
        return False
    return implementation == "sdpa" or (implementation == "eager" and spec is not None and spec.attention_sinks)


def unmasked_is_causal(model) -> bool:
    """Whether a forward's layers may now take no mask for causal attention over the forward's own keys (the last
    of the keys they get): `grouped_attention(model)` is running them, and `grouped_query_attention` then calls
    SDPA by its causal flag (its flash kernels, no mask in memory), or for sinks `causal_sink_attention`.
    transformers builds no mask of its own for an implementation outside its mask registry (ours), so a missing
    mask reaches the layers as it is."""
    return model.config.get_text_config()._attn_implementation == NAME


def unmasked_chunks(model) -> bool:
    """Whether, beyond `unmasked_is_causal`, every layer of every prefill chunk may take no mask: causal for the
    chunk's tokens after every earlier key, inside the window of a sliding layer. `causal_sink_attention` reads
    the window transformers passes it (gpt-oss); SDPA has no window flag and aligns its causal flag to the first
    key."""
    spec = spec_for_model(model)
    return unmasked_is_causal(model) and spec is not None and spec.attention_sinks


@contextlib.contextmanager
def grouped_attention(model):
    """Within: the model's attention layers run `grouped_query_attention` where it reproduces their implementation
    (`_replaces`); the user's implementation is back afterwards (their own `model.generate` runs it unchanged)."""
    config = model.config.get_text_config()
    implementation = config._attn_implementation
    if not _replaces(model, implementation):
        yield
        return
    config._attn_implementation = NAME
    latent_layers = _latent_layers(model)
    for layer in latent_layers:
        layer.expand_kv = _latents_as_cached
    try:
        yield
    finally:
        config._attn_implementation = implementation
        for layer in latent_layers:
            del layer.expand_kv


def _dense_weight(linear: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight [out, in]: nn.Linear's own, or an FP8 one's (`checkpoint.FP8Linear`) dequantized to
    `dtype` (a step dequantizes kv_b_proj once instead of expanding the cache through it)."""
    dense_weight = getattr(linear, "dense_weight", None)
    return linear.weight if dense_weight is None else dense_weight(dtype)


def _absorbable(linear) -> bool:
    """A kv_b_proj without bias whose weight `_dense_weight` reads (not a subclass of nn.Linear of another library's
    quantization: its weight is not the values)."""
    return (type(linear) is torch.nn.Linear or hasattr(linear, "dense_weight")) and linear.bias is None


def _latent_layers(model) -> list[torch.nn.Module]:
    """The attention layers of a latent-attention family that `absorbed_attention` can take."""
    spec = spec_for_model(model)
    if spec is None or not spec.latent_attention:
        return []
    return [module for module in model.modules()
            if hasattr(type(module), "expand_kv") and _absorbable(getattr(module, "kv_b_proj", None))]
