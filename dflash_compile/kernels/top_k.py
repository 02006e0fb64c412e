"""`dflash::top_k` on CUDA: the k largest of each row of a short last dimension (a router's expert scores) in one
launch. `torch.topk` runs a radix select and then a sort, two kernels of ~4.4 us each per MoE layer on an H200
for 4 of 32 experts: two launch gaps inside a decode step's CUDA graph for a few hundred bytes of work. With
SOFTMAX the row's softmax comes first, and with RENORMALIZE the chosen values are divided by their sum, in the same
launch (the routers of Qwen3-MoE, Qwen3.5-MoE, OLMoE and Mixtral choose among their experts' probabilities, and
most renormalize them), where each was one more launch of its own.

One program holds BLOCK_ROWS whole rows in registers and picks K times the largest key not yet taken, one
reduction a round: each value's rank and its column packed in one int64 (the float's bits made monotone in its
value, above the column counted down, so that among equal values the lowest index wins); the chosen values are
read back by index at the end. NaN ranks with +inf (torch.topk ranks it above), -0.0 with +0.0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _top_k_kernel(x, values, indices, M, N, K: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    columns = tl.arange(0, BLOCK_N)
    rows_x = x + rows[:, None].to(tl.int64) * N
    inside = (rows[:, None] < M) & (columns[None, :] < N)
    scores = tl.load(rows_x + columns[None, :], mask=inside, other=float("-inf")).to(tl.float32)
    if SOFTMAX:  # in fp32, as softmax(x, dtype=torch.float) computes it; columns past the row are exp(-inf) = 0
        largest = tl.max(scores, axis=1)
        exponentials = tl.exp(scores - largest[:, None])
        total = tl.sum(exponentials, axis=1)
        scores = exponentials / total[:, None]
    ranked = tl.where(scores != scores, float("inf"), tl.where(scores == 0, 0.0, scores))  # NaN as +inf, -0.0 as 0
    bits = ranked.to(tl.int32, bitcast=True)
    monotone = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats' magnitude bits flipped: int order = float order
    keys = (monotone.to(tl.int64) << 32) | (BLOCK_N - 1 - columns)[None, :].to(tl.int64)
    lowest = tl.full([BLOCK_ROWS, BLOCK_N], -2**63, tl.int64)
    keys = tl.where(inside, keys, lowest)
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_ROWS, BLOCK_K], tl.int64)
    for j in tl.static_range(K):  # unrolled: ops.TOP_K_MAX_K rounds at most
        best = tl.max(keys, axis=1)
        chosen = tl.where(slots[None, :] == j, BLOCK_N - 1 - (best & 0xFFFFFFFF)[:, None], chosen)
        keys = tl.where(keys == best[:, None], lowest, keys)  # keys are unique in a row: the chosen one taken
    kept = (rows[:, None] < M) & (slots[None, :] < K)
    picked = tl.load(rows_x + chosen, mask=kept, other=0.0).to(tl.float32)  # their own values, NaN too
    if SOFTMAX:
        picked = tl.exp(picked - largest[:, None]) / total[:, None]
    if RENORMALIZE:  # the chosen values over their sum (kept masks the slots past k)
        picked = picked / tl.sum(tl.where(kept, picked, 0.0), axis=1)[:, None]
    out = rows[:, None] * K + slots[None, :]
    tl.store(values + out, picked.to(values.dtype.element_ty), mask=kept)
    tl.store(indices + out, chosen, mask=kept)


# Warps per program holding one row (a decode step's router) and several (a verify step's). Session 47's H200 sweep
# (`bench/top_k.py --warps 1 2 4`, docs/benchmarks.md): one row of 64-256 experts takes 2.4-2.8 us with one warp
# against 3.1-3.7 with four; 8-16 rows of 64-256 experts 2.4-4.5 us with four against 3.6-10.8 with one.
TOP_K_WARPS = {"one row": 1, "rows": 4}


def top_k(x: torch.Tensor, k: int, softmax_dtype: torch.dtype | None = None, renormalize: bool = False,
          values_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.top_k`: torch.topk(x, k, dim=-1) (largest, sorted), equal values in index order, of
    torch.softmax(x, dim=-1, dtype=softmax_dtype) with `softmax_dtype`; with `renormalize`, the values over their
    sum; in `values_dtype` if given. For rows within `ops.TOP_K_MAX_WIDTH` (one program holds whole rows) and k
    within `ops.TOP_K_MAX_K`."""
    width = x.shape[-1]
    rows = x.reshape(-1, width).contiguous()
    values = x.new_empty(*x.shape[:-1], k, dtype=values_dtype or softmax_dtype or x.dtype)
    indices = torch.empty(*x.shape[:-1], k, dtype=torch.int64, device=x.device)
    block_n = triton.next_power_of_2(width)
    block_rows = max(1, min(triton.next_power_of_2(rows.shape[0]), 2048 // block_n))
    if rows.shape[0]:
        _top_k_kernel[(triton.cdiv(rows.shape[0], block_rows),)](
            rows, values, indices, rows.shape[0], width, K=k, BLOCK_ROWS=block_rows, BLOCK_N=block_n,
            BLOCK_K=triton.next_power_of_2(k), SOFTMAX=softmax_dtype is not None, RENORMALIZE=renormalize,
            num_warps=TOP_K_WARPS["one row" if block_rows == 1 else "rows"])
    return values, indices
