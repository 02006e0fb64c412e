"""`dflash::top_k` on CUDA: the k largest of each row of a short last dimension (a router's expert scores) in one
launch. `torch.topk` runs a radix select and then a sort, two kernels of ~4.4 us each per MoE layer on an H200
for 4 of 32 experts: two launch gaps inside a decode step's CUDA graph for a few hundred bytes of work. With
SOFTMAX, the row's softmax first, in the same launch (the routers of Qwen3-MoE, Qwen3.5-MoE, OLMoE and Mixtral
choose among their experts' probabilities), where it was one more launch of its own.

One program holds BLOCK_ROWS whole rows in registers and picks K times the largest value not yet taken, the lowest
index among equal values. NaN ranks with +inf (torch.topk ranks it above).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _top_k_kernel(x, values, indices, M, N, K: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                  SOFTMAX: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    columns = tl.arange(0, BLOCK_N)
    ok = (rows[:, None] < M) & (columns[None, :] < N)
    row_values = tl.load(x + rows[:, None].to(tl.int64) * N + columns[None, :], mask=ok, other=float("-inf"))
    as_float = row_values.to(tl.float32)
    if SOFTMAX:  # in fp32, as softmax(x, dtype=torch.float) computes it; columns past the row are exp(-inf) = 0
        exponentials = tl.exp(as_float - tl.max(as_float, axis=1)[:, None])
        as_float = exponentials / tl.sum(exponentials, axis=1)[:, None]
    keys = tl.where(as_float != as_float, float("inf"), as_float)  # NaN ranks with +inf
    taken = columns[None, :] >= N
    for j in tl.static_range(K):  # unrolled: ops.TOP_K_MAX_K rounds at most
        best = tl.max(tl.where(taken, float("-inf"), keys), axis=1)
        hits = (keys == best[:, None]) & ~taken
        index = tl.min(tl.where(hits, columns[None, :], BLOCK_N), axis=1)
        chosen = columns[None, :] == index[:, None]
        value = tl.sum(tl.where(chosen, as_float, 0.0), axis=1)  # its own value, NaN too
        tl.store(values + rows * K + j, value.to(values.dtype.element_ty), mask=rows < M)
        tl.store(indices + rows * K + j, index.to(tl.int64), mask=rows < M)
        taken = taken | chosen


def top_k(x: torch.Tensor, k: int, softmax_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k, dim=-1) (largest, sorted), equal values in index order; with `softmax_dtype`, of
    torch.softmax(x, dim=-1, dtype=softmax_dtype). For rows within `ops.TOP_K_MAX_WIDTH` (one program holds whole
    rows) and k within `ops.TOP_K_MAX_K`."""
    width = x.shape[-1]
    rows = x.reshape(-1, width).contiguous()
    values = x.new_empty(*x.shape[:-1], k, dtype=softmax_dtype or x.dtype)
    indices = torch.empty(*x.shape[:-1], k, dtype=torch.int64, device=x.device)
    block_n = triton.next_power_of_2(width)
    block_rows = max(1, min(triton.next_power_of_2(rows.shape[0]), 2048 // block_n))
    if rows.shape[0]:
        _top_k_kernel[(triton.cdiv(rows.shape[0], block_rows),)](
            rows, values, indices, rows.shape[0], width, K=k, BLOCK_ROWS=block_rows, BLOCK_N=block_n,
            SOFTMAX=softmax_dtype is not None, num_warps=4)
    return values, indices
