"""Custom ops of the `dflash` namespace (torch.library). Each has a fake implementation and exact `mutates_args`.

`moe_dispatch` is opaque to Inductor: the graph sees activations in, activations out, and the expert store decides
how the experts run (today: the reference math on the model's own weights).
"""

from __future__ import annotations

import torch

from .attention import decode_kernel_takes, folded_attention
from .expert_store import Gate, get_store, run_packed
from .packed import PackedWeight
from .quant import dequantize_fp8_block, dequantize_mxfp4


def _dispatch(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, store: int, layer: int
) -> torch.Tensor:
    """Routed experts of one MoE layer: hidden [T, H], top_k_index [T, K], top_k_weights [T, K] -> [T, H].

    `store` and `layer` name the weights in the expert store (see `dflash_compile.expert_store`).
    """
    return get_store(store).dispatch(layer, hidden, top_k_index, top_k_weights)


def _dispatch_fake(hidden, top_k_index, top_k_weights, store, layer):
    torch._check(top_k_index.shape == top_k_weights.shape, lambda: "top_k_index and top_k_weights differ in shape")
    torch._check(top_k_index.shape[0] == hidden.shape[0], lambda: "one routing row per token expected")
    return torch.empty_like(hidden)


moe_dispatch = torch.library.custom_op("dflash::moe_dispatch", _dispatch, mutates_args=())
moe_dispatch.register_fake(_dispatch_fake)
# The same for offloaded experts, whose dispatch reads the routing on the host and copies weights: tagged so that
# Inductor's graph partitioning keeps it out of CUDA graphs while the rest of the step is captured.
moe_dispatch_offloaded = torch.library.custom_op("dflash::moe_dispatch_offloaded", _dispatch, mutates_args=(),
                                                 tags=(torch.Tag.cudagraph_unsafe,))
moe_dispatch_offloaded.register_fake(_dispatch_fake)


@torch.library.custom_op("dflash::packed_moe", mutates_args=())
def packed_moe(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, format: str,
    gate_up_data: torch.Tensor, gate_up_scales: torch.Tensor | None, gate_up_bias: torch.Tensor | None,
    down_data: torch.Tensor, down_scales: torch.Tensor | None, down_bias: torch.Tensor | None,
    interleaved: bool, activation: str, alpha: float, limit: float,
) -> torch.Tensor:
    """Routed experts on packed weights (`dflash_compile.packed` layouts): what a packed experts module runs when it
    is not compiled with the dflash backend (which turns it into `moe_dispatch` on the same weights). On a CPU the
    C++ kernel registered for the CPU key runs instead; this is the fallback where it could not be built."""
    gate_up = PackedWeight(format, gate_up_data, gate_up_scales, gate_up_bias)
    down = PackedWeight(format, down_data, down_scales, down_bias)
    return run_packed(hidden, top_k_index, top_k_weights, gate_up, down, Gate(interleaved, activation, alpha, limit),
                      cpu_kernels=False)


@packed_moe.register_fake
def _packed_moe_fake(hidden, top_k_index, top_k_weights, format, gate_up_data, gate_up_scales, gate_up_bias,
                     down_data, down_scales, down_bias, interleaved, activation, alpha, limit):
    torch._check(top_k_index.shape == top_k_weights.shape, lambda: "top_k_index and top_k_weights differ in shape")
    return torch.empty_like(hidden)


@torch.library.custom_op("dflash::kv_write", mutates_args=("key_cache", "value_cache"))
def kv_write(key_cache: torch.Tensor, value_cache: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor | None,
             lengths: torch.Tensor) -> None:
    """key_cache[b, :, (lengths[b] + i) % S] = key[b, :, i] and value_cache likewise, for every row b and
    i < key.shape[2] (caches [B, H, S, D]; keys and values may differ in D). On CUDA one kernel writes both
    (`kernels.kv_cache`). Without a value cache (and value), the keys alone: a DSA indexer's.

    Full-attention buffers are long enough that the modulo never wraps; sliding-window rings wrap."""
    if key_cache.is_cuda:
        from .kernels.kv_cache import write_kv

        write_kv(key_cache, value_cache, key, value, lengths)
        return
    slots = (lengths[:, None] + torch.arange(key.shape[2], device=key.device)).remainder(key_cache.shape[2])
    for cache, new in _written(key_cache, value_cache, key, value):
        index = slots[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3])
        cache.scatter_(2, index, new.to(cache.dtype))


def _written(key_cache, value_cache, key, value) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(cache, new) pairs `kv_write` writes: the keys, and the values where given."""
    return [(key_cache, key)] + ([(value_cache, value)] if value_cache is not None else [])


@kv_write.register_fake
def _kv_write_fake(key_cache, value_cache, key, value, lengths):
    torch._check((value_cache is None) == (value is None), lambda: "a value cache and values come together")
    for cache, new in _written(key_cache, value_cache, key, value):
        torch._check(new.shape[0] == cache.shape[0] and new.shape[1] == cache.shape[1], lambda: "batch/heads differ")
        torch._check(new.shape[3] == cache.shape[3], lambda: "head_dim differs")
        torch._check(new.shape[2] == key.shape[2] and cache.shape[2] == key_cache.shape[2],
                     lambda: "keys and values differ in tokens or slots")


@torch.library.custom_op("dflash::kv_commit", mutates_args=("lengths",))
def kv_commit(lengths: torch.Tensor, counts: torch.Tensor) -> None:
    """Advance each row's committed length by counts[b]: the tokens it keeps. Everything past it is rolled back."""
    lengths.add_(counts.to(lengths.dtype))


@kv_commit.register_fake
def _kv_commit_fake(lengths, counts):
    torch._check(lengths.shape == counts.shape, lambda: "one count per row expected")


# What `dflash::top_k` takes to its kernel: one program holds a whole row (a router has at most a few hundred
# experts), and each of the k rounds is a pass over it (routers pick 1-10 experts; a sampler's top-k stays torch's).
TOP_K_MAX_WIDTH, TOP_K_MAX_K = 1024, 32


@torch.library.custom_op("dflash::top_k", mutates_args=())
def top_k(x: torch.Tensor, k: int, softmax_dtype: torch.dtype | None = None, renormalize: bool = False,
          values_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k, dim=-1): the k largest of each row, sorted, and their indices. A router's steps around it,
    each optional: with `softmax_dtype`, of torch.softmax(x, dim=-1, dtype=softmax_dtype) (its probabilities);
    with `renormalize`, the values divided by their sum; in `values_dtype` (else the scores' dtype). On CUDA, for
    floating-point rows within the limits above, one Triton launch (`kernels.top_k`; equal values in index order)
    where torch takes two for the topk and one for each step."""
    if x.is_cuda and x.is_floating_point() and x.shape[-1] <= TOP_K_MAX_WIDTH and k <= TOP_K_MAX_K:
        from .kernels.top_k import top_k as top_k_kernel

        return top_k_kernel(x, k, softmax_dtype, renormalize, values_dtype)
    values, indices = torch.topk(x if softmax_dtype is None else torch.softmax(x, dim=-1, dtype=softmax_dtype), k,
                                 dim=-1)
    if renormalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(values_dtype or values.dtype), indices


@top_k.register_fake
def _top_k_fake(x, k, softmax_dtype=None, renormalize=False, values_dtype=None):
    torch._check(0 <= k <= x.shape[-1], lambda: f"top_k: k = {k} exceeds the last dimension ({x.shape[-1]})")
    shape = (*x.shape[:-1], k)
    return (x.new_empty(shape, dtype=values_dtype or softmax_dtype or x.dtype),
            x.new_empty(shape, dtype=torch.int64))


# What pass `split_k_linear` hands to `dflash::split_k_linear`: decode and verify rows, one tile of the kernel's rows
# (verify blocks have at most 16 tokens).
SPLIT_K_LINEAR_MAX_ROWS = 16


@torch.library.custom_op("dflash::split_k_linear", mutates_args=())
def split_k_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """torch's linear(x, weight, bias), for a few rows and a weight with more columns than rows (K > N: a router,
    o_proj, a dense down projection). On CUDA in bf16, the packed-linear kernel on the weight as it is
    (`kernels.moe.packed_linear`, format "dense"): K split over enough programs to fill the GPU and the shares added
    in the same launch, where cuBLAS runs a split-K GEMV and then a reduce launch. Elsewhere torch's linear (fp16
    too: the kernel's dense tiles multiply bf16 operands, which would round fp16 weights)."""
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16:
        from .kernels.moe import packed_linear

        return packed_linear(x, PackedWeight("dense", weight[None], None, None if bias is None else bias[None]))
    return torch.nn.functional.linear(x, weight, bias)


def _linear_output(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fake output of a linear layer's op: x [..., K], weight [N, K] -> [..., N]."""
    torch._check(x.shape[-1] == weight.shape[1],
                 lambda: f"x has {x.shape[-1]} features, weight takes {weight.shape[1]}")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@split_k_linear.register_fake
def _split_k_linear_fake(x, weight, bias):
    return _linear_output(x, weight)


@torch.library.custom_op("dflash::decode_attention", mutates_args=())
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     sinks: torch.Tensor | None, scaling: float, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention of a few new tokens over the cache: query [b, heads, t, d], key/value [b, kv_heads,
    s, d], additive mask [b, 1, t, s], sinks [heads] or None (gpt-oss) -> [b, t, heads, d], as
    `attention.folded_attention` computes it. `seen`: None, or a one-element integer tensor: the mask hides every
    slot from it on from every row (`TargetCache.seen_slots`). Where `attention.decode_kernel_takes` them (decode
    and verify steps on CUDA), one Triton launch split over the slots before `seen` (`kernels.decode_attention`)
    instead of torch's GEMM, softmax and GEMM over the whole score matrix."""
    if decode_kernel_takes(query, key, value, mask):
        from .kernels.decode_attention import grouped_decode_attention

        return grouped_decode_attention(query, key, value, mask, sinks, scaling, seen)
    return folded_attention(query, key, value, mask, sinks, scaling)


@decode_attention.register_fake
def _decode_attention_fake(query, key, value, mask, sinks, scaling, seen=None):
    b, heads, t, _ = query.shape
    torch._check(heads % key.shape[1] == 0, lambda: "query heads must be a multiple of key/value heads")
    torch._check(mask.shape[-2:] == (t, key.shape[2]), lambda: "the mask must be [b, 1, new tokens, slots]")
    return query.new_empty(b, t, heads, value.shape[-1])


@torch.library.custom_op("dflash::greedy_accept", mutates_args=())
def greedy_accept(block: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance over a verify block, per row.

    block [B, T] = [anchor, d1 .. d_{T-1}], logits [B, T, V] of the target over the block. Returns
    (accepted [B]: how many drafts match the target's argmax before the first miss, target [B, T]: the argmax).
    The row commits target[:, :accepted + 1]: the accepted drafts and the bonus token.
    """
    target = logits.argmax(dim=-1)
    accepted = (block[:, 1:] == target[:, :-1]).long().cumprod(dim=-1).sum(dim=-1)
    return accepted, target


@greedy_accept.register_fake
def _greedy_accept_fake(block, logits):
    return block.new_empty(block.shape[0]), block.new_empty(block.shape)


@torch.library.custom_op("dflash::conv_window_commit", mutates_args=("state",))
def conv_window_commit(state: torch.Tensor, full: torch.Tensor, end: torch.Tensor) -> None:
    """Linear-attention conv state after each row's kept tokens: state[b] = full[b, ..., end[b] - K : end[b]].

    `full` is the conv input the forward saw (the old K-column state, then the new tokens; [b, channels, K + n], or
    [b, K + n] for a state of token ids: Qwen4-Exp's n-gram context); `end[b]` is K plus the row's kept tokens, so a
    row that keeps nothing gets its old state back."""
    width = state.shape[-1]
    index = end[:, None] - width + torch.arange(width, device=end.device)  # [b, K]
    index = index.view(index.shape[0], *([1] * (full.dim() - 2)), width).expand(*full.shape[:-1], width)
    state.copy_(full.gather(-1, index))


@conv_window_commit.register_fake
def _conv_window_commit_fake(state, full, end):
    torch._check(full.shape[:-1] == state.shape[:-1], lambda: "conv state and conv input differ in batch/channels")


@torch.library.custom_op("dflash::state_select", mutates_args=("state",))
def state_select(state: torch.Tensor, candidate: torch.Tensor, take: torch.Tensor) -> None:
    """Recurrent state commit: state[b] = candidate[b] where take[b] (the row kept the whole block)."""
    keep = take.view(-1, *([1] * (state.ndim - 1))).bool()
    state.copy_(torch.where(keep, candidate.to(state.dtype), state))


@state_select.register_fake
def _state_select_fake(state, candidate, take):
    torch._check(candidate.shape == state.shape, lambda: "candidate state differs in shape")


@torch.library.custom_op("dflash::ordered_cumsum", mutates_args=())
def ordered_cumsum(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """values.gather(-1, order).cumsum(-1): the running sum of `values` taken in `order` along the last dimension. An
    op of its own so that Inductor never fuses the gather into the scan: torch 2.11 fails to generate the split scan
    of a vocabulary-long cumsum on CUDA with a gather fused in (typical-p's, `sampling.TypicalWarper`; the same
    family of failures as pytorch/pytorch#180221)."""
    return values.gather(-1, order).cumsum(-1)


@ordered_cumsum.register_fake
def _ordered_cumsum_fake(values, order):
    torch._check(values.shape[:-1] == order.shape[:-1], lambda: "values and order differ before the last dimension")
    return values.new_empty(order.shape)


@torch.library.custom_op("dflash::sampled_accept", mutates_args=())
def sampled_accept(
    block: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor, uniforms: torch.Tensor,
    one_hot_drafts: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling over a verify block, per row (lossless: committed tokens follow the target).

    block [B, T] = [anchor, d1 .. d_{T-1}]; target_probs [B, T, V]: the processed target distribution of the token
    at block position i + 1; draft_probs [B, T-1, V]: the processed distribution d_{i+1} was drawn from (ignored
    when `one_hot_drafts`: the drafts were argmax, q = 1 at the draft). uniforms [B, T]: one U(0,1) per draft for
    its accept test (accept d_i when u < min(1, p(d_i) / q(d_i))), and the last for sampling the final token by
    inverse CDF: from normalize(max(p - q, 0)) at the first rejection (p without d_i's mass for one-hot drafts), or
    from p at the last position when every draft passed.

    Returns (accepted [B], tokens [B, T]): the row commits tokens[:, :accepted + 1].
    """
    drafts = block[:, 1:]
    p_draft = target_probs[:, :-1].gather(2, drafts[..., None]).squeeze(-1)
    q_draft = torch.ones_like(p_draft) if one_hot_drafts else draft_probs.gather(2, drafts[..., None]).squeeze(-1)
    ratio = (p_draft / q_draft.clamp_min(torch.finfo(q_draft.dtype).tiny)).clamp(max=1.0)
    passed = (uniforms[:, :-1] < ratio).long().cumprod(dim=-1)
    accepted = passed.sum(dim=-1)

    at = accepted[:, None, None]
    p = target_probs.gather(1, at.expand(-1, 1, target_probs.shape[-1])).squeeze(1)
    if one_hot_drafts:
        q = torch.nn.functional.one_hot(drafts, p.shape[-1]).to(p.dtype)
    else:
        q = draft_probs
    q = torch.cat([q, q.new_zeros(q.shape[0], 1, q.shape[2])], dim=1)  # no draft at the last position: bonus from p
    final = (p - q.gather(1, at.expand(-1, 1, q.shape[-1])).squeeze(1)).clamp_min(0)
    cdf = final.cumsum(dim=-1)
    sampled = torch.searchsorted(cdf, uniforms[:, -1:] * cdf[:, -1:], right=True).clamp(max=p.shape[-1] - 1)
    tokens = torch.cat([drafts, block[:, :1]], dim=1).scatter(1, accepted[:, None], sampled)
    return accepted, tokens


@sampled_accept.register_fake
def _sampled_accept_fake(block, target_probs, draft_probs, uniforms, one_hot_drafts):
    return block.new_empty(block.shape[0]), block.new_empty(block.shape)


@torch.library.custom_op("dflash::mxfp4_dequantize", mutates_args=())
def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 blocks uint8 [..., G, 16] and E8M0 scales uint8 [..., G] -> [..., G * 32] in `dtype` (reference)."""
    return dequantize_mxfp4(blocks, scales, dtype)


@mxfp4_dequantize.register_fake
def _mxfp4_dequantize_fake(blocks, scales, dtype):
    torch._check(blocks.shape[:-1] == scales.shape and blocks.shape[-1] == 16, lambda: "bad MXFP4 block shapes")
    return blocks.new_empty((*scales.shape[:-1], scales.shape[-1] * 32), dtype=dtype)


@torch.library.custom_op("dflash::fp8_block_dequantize", mutates_args=())
def fp8_block_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block_n: int, block_k: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn weight [N, K] (or its bytes as uint8, as packed stores hold it) times its per-block
    scale_inv [ceil(N/bn), ceil(K/bk)] -> [N, K] in `dtype`."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    return dequantize_fp8_block(weight, scale_inv, (block_n, block_k), dtype)


@fp8_block_dequantize.register_fake
def _fp8_block_dequantize_fake(weight, scale_inv, block_n, block_k, dtype):
    grid = (-(-weight.shape[0] // block_n), -(-weight.shape[1] // block_k))
    torch._check(tuple(scale_inv.shape) == grid, lambda: f"scale grid {list(scale_inv.shape)} != {list(grid)}")
    return weight.new_empty(weight.shape, dtype=dtype)


@torch.library.custom_op("dflash::fp8_block_linear", mutates_args=())
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """linear(x, weight * scale_inv per 128 x 128 block, bias) without materialising the weight: on CUDA the fused
    Triton kernel reads the FP8 bytes tile by tile (on GPUs of compute capability 8.9 or newer: `fused_blocker`;
    from `DEQUANTIZE_ROWS` rows, e.g. a prefill, it dequantizes slab by slab for torch's matmul instead); on a CPU
    the C++ kernel (csrc/, registered for the CPU key once built); elsewhere the reference dequantizes then
    multiplies."""
    from .kernels import cpu

    if x.device.type == "cpu" and cpu.load():  # built just now: the CPU key has its kernel from here on
        return torch.ops.dflash.fp8_block_linear(x, weight, scale_inv, bias)
    packed = PackedWeight("fp8_block", weight.view(torch.uint8)[None], scale_inv.float()[None],
                          None if bias is None else bias[None])
    if x.is_cuda:
        from .kernels.moe import fused_blocker, packed_linear

        if not fused_blocker("fp8_block", x.device, x.dtype == torch.float32):
            return packed_linear(x, packed)
    return torch.nn.functional.linear(x, packed.dequantize(x.dtype)[0], bias)


@fp8_block_linear.register_fake
def _fp8_block_linear_fake(x, weight, scale_inv, bias):
    return _linear_output(x, weight)
