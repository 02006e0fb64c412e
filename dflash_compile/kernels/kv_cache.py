"""`dflash::kv_write` on CUDA: a layer's new keys and values written into their row caches at each row's length in
one launch. The op's tensor form (index arithmetic, then a scatter per cache) is about eight small kernels per
layer, each a launch gap inside the step's CUDA graph; this is one.

One program copies one (row, head, token): its key vector and its value vector (head dims may differ, as in
DeepSeek's attention; a DSA indexer's keys come without values), to slot (lengths[row] + token) mod S of the caches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_vector(target, source, D, target_stride, source_stride, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    tl.store(target + d * target_stride, tl.load(source + d * source_stride, mask=d < D), mask=d < D)


@triton.jit
def _kv_write_kernel(key_cache, value_cache, key, value, lengths, heads, S, DK, DV,
                     kc_b, kc_h, kc_s, kc_d, vc_b, vc_h, vc_s, vc_d, k_b, k_h, k_n, k_d, v_b, v_h, v_n, v_d,
                     BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_VALUE: tl.constexpr):
    row_head, token = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    row, head = row_head // heads, row_head % heads
    slot = (tl.load(lengths + row) + token) % S
    _copy_vector(key_cache + row * kc_b + head * kc_h + slot * kc_s, key + row * k_b + head * k_h + token * k_n,
                 DK, kc_d, k_d, BLOCK_DK)
    if HAS_VALUE:
        _copy_vector(value_cache + row * vc_b + head * vc_h + slot * vc_s,
                     value + row * v_b + head * v_h + token * v_n, DV, vc_d, v_d, BLOCK_DV)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor | None,
             lengths: torch.Tensor) -> None:
    """key_cache[b, :, (lengths[b] + i) % S] = key[b, :, i], value_cache likewise where given, for i < key.shape[2]
    (caches [B, H, S, D], any strides; cast to the caches' dtype). Values of no width (GLM-5-Next's rotary keys,
    which its latent attention caches as values, have none) write nothing."""
    batch, heads, tokens, _ = key.shape
    has_value = value_cache is not None and value.shape[3] > 0
    value_cache, value = (value_cache, value) if has_value else (key_cache, key)  # unread pointers
    _kv_write_kernel[(batch * heads, tokens)](
        key_cache, value_cache, key, value, lengths, heads, key_cache.shape[2], key.shape[3], value.shape[3],
        *key_cache.stride(), *value_cache.stride(), *key.stride(), *value.stride(),
        BLOCK_DK=triton.next_power_of_2(key.shape[3]), BLOCK_DV=triton.next_power_of_2(value.shape[3]),
        HAS_VALUE=has_value, num_warps=1)  # a head's vector (64-256 values) is one warp's work
