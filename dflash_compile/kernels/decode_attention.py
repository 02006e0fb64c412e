"""Grouped-query attention of a few new tokens (decode, verify) over the cache's slots, for `dflash::decode_attention`
on CUDA: one Triton launch, split over the slots flash-decoding style. What the compiled step ran before (the
torch math of `attention.folded_attention`: a QK^T GEMM, a softmax and a PV GEMM, plus the mask's and the sinks'
elementwise kernels) read the whole [rows, slots] score matrix three times through memory and left most SMs idle at
one token; here each program holds its scores in registers.

Queries come folded by group, as `attention.folded_attention` folds them ([b, kv heads, groups * t, d]): each
program takes one (batch row, key/value head)'s group of `block_r` folded rows (16 by default) and a
share of the slots, with an online softmax in fp32 (the additive mask read as given), and writes its share's partial
output and softmax statistics. The last program of a group to arrive (`arrivals`) merges the shares, and gpt-oss's
sinks join each query's softmax there; without arrival counts (a CUDA graph captured before any were made) a second
launch merges.

Rows that see no slot (padding queries under an additive finfo.min mask) come out as the torch math makes them: all
their scores tie, so a uniform average of the values (or, with sinks, zeros); with `seen`, of the values it reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention import _fold, _unfold
from . import sm_count
from .arrivals import arrival_counts

# fp32's finfo.min: below every masked score (finfo.min of the mask's dtype), so rows seeing no slot tie as in torch
_LOWEST = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _group_rows(group, PARTS: tl.constexpr, BLOCK_R: tl.constexpr):
    """A group (a (batch row, kv head)'s part of its folded rows)'s (batch row, kv head) index, its rows' places in
    the group's partials, and their folded row indices."""
    local = tl.arange(0, BLOCK_R)
    return group // PARTS, local, group % PARTS * BLOCK_R + local


@triton.jit
def _split_kernel(q, k, v, mask, seen, acc_out, stats_out, sinks, out, counts, scaling, R, T, S, GROUPS,
                  q_b, q_h, q_r, k_b, k_h, k_s, v_b, v_h, v_s, m_b, m_t, m_s,
                  KV_HEADS: tl.constexpr, PARTS: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_SEEN: tl.constexpr,
                  MERGE_IN_LAUNCH: tl.constexpr, PRECISION: tl.constexpr):
    group, split = tl.program_id(0), tl.program_id(1)
    row_head, local, rows = _group_rows(group, PARTS, BLOCK_R)
    b, h = row_head // KV_HEADS, row_head % KV_HEADS
    dims = tl.arange(0, D)
    row_ok = rows < R
    queries = tl.load(q + b * q_b + h * q_h + rows[:, None] * q_r + dims[None, :], mask=row_ok[:, None], other=0.0)
    largest = tl.full([BLOCK_R], _LOWEST, tl.float32)  # finite: a share's padding slots (-inf) make no NaN
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    # The slots any row may see, shared by every share: rounded up to 16, as the capacity S is, so the shares'
    # bounds keep the alignment that vectorizes the mask's loads (the masked slots past `seen` are finite).
    span = tl.minimum(tl.cdiv(tl.load(seen).to(tl.int32), 16) * 16, S) if HAS_SEEN else S
    chunk = tl.cdiv(tl.cdiv(span, SPLITS), BLOCK_S) * BLOCK_S
    start = split * chunk
    stop = tl.minimum(start + chunk, span)
    for first in range(start, stop, BLOCK_S):
        slots = first + tl.arange(0, BLOCK_S)
        slot_ok = slots < stop
        keys = tl.load(k + b * k_b + h * k_h + slots[:, None] * k_s + dims[None, :], mask=slot_ok[:, None], other=0.0)
        scores = tl.dot(queries, tl.trans(keys), input_precision=PRECISION) * scaling
        bias = tl.load(mask + b * m_b + (rows % T)[:, None] * m_t + slots[None, :] * m_s,
                       mask=row_ok[:, None] & slot_ok[None, :], other=0.0)
        scores = tl.where(slot_ok[None, :], scores + bias.to(tl.float32), float("-inf"))
        new_largest = tl.maximum(largest, tl.max(scores, axis=1))
        shrink = tl.exp(largest - new_largest)
        p = tl.exp(scores - new_largest[:, None])
        total = total * shrink + tl.sum(p, axis=1)
        values = tl.load(v + b * v_b + h * v_h + slots[:, None] * v_s + dims[None, :], mask=slot_ok[:, None],
                         other=0.0)
        acc = acc * shrink[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
        largest = new_largest
    part = group * SPLITS + split
    tl.store(acc_out + (part * BLOCK_R + local[:, None]) * D + dims[None, :], acc)
    tl.store(stats_out + (part * 2) * BLOCK_R + local, largest)
    tl.store(stats_out + (part * 2 + 1) * BLOCK_R + local, total)
    if MERGE_IN_LAUNCH:  # the last of a group's programs to arrive merges (acquire-release orders the partials)
        tl.debug_barrier()
        arrived = tl.atomic_add(counts + group, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()  # every thread's loads of the merge after the acquire, as `moe._sum_when_last` orders them
        if arrived == SPLITS - 1:
            _merge(acc_out, stats_out, sinks, out, group, R, T, GROUPS, KV_HEADS, PARTS, SPLITS, D, BLOCK_R,
                   HAS_SINKS)
            tl.store(counts + group, 0)  # zero again for the next launch


@triton.jit
def _merge_kernel(acc_in, stats_in, sinks, out, R, T, GROUPS, KV_HEADS: tl.constexpr, PARTS: tl.constexpr,
                  SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SINKS: tl.constexpr):
    _merge(acc_in, stats_in, sinks, out, tl.program_id(0), R, T, GROUPS, KV_HEADS, PARTS, SPLITS, D, BLOCK_R,
           HAS_SINKS)


@triton.jit
def _merge(acc_in, stats_in, sinks, out, group, R, T, GROUPS, KV_HEADS: tl.constexpr, PARTS: tl.constexpr,
           SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SINKS: tl.constexpr):
    """A group's output rows from its SPLITS partials (and its sinks' logits), in a fixed order."""
    row_head, local, rows = _group_rows(group, PARTS, BLOCK_R)
    dims = tl.arange(0, D)
    largest = tl.full([BLOCK_R], _LOWEST, tl.float32)
    for split in tl.static_range(SPLITS):
        largest = tl.maximum(largest, tl.load(stats_in + ((group * SPLITS + split) * 2) * BLOCK_R + local))
    if HAS_SINKS:
        sink = tl.load(sinks + (row_head % KV_HEADS) * GROUPS + rows // T, mask=rows < R, other=0.0).to(tl.float32)
        largest = tl.maximum(largest, sink)
        total = tl.exp(sink - largest)
    else:
        total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for split in tl.static_range(SPLITS):
        part = group * SPLITS + split
        weight = tl.exp(tl.load(stats_in + (part * 2) * BLOCK_R + local) - largest)
        total += weight * tl.load(stats_in + (part * 2 + 1) * BLOCK_R + local)
        acc += weight[:, None] * tl.load(acc_in + (part * BLOCK_R + local[:, None]) * D + dims[None, :])
    total = tl.where(total == 0, 1.0, total)  # a row seeing nothing at all (a -inf mask) gives zeros
    tl.store(out + (row_head * R + rows[:, None]) * D + dims[None, :], (acc / total[:, None]).to(out.dtype.element_ty),
             mask=rows[:, None] < R)


# One program merges a group's SPLITS x BLOCK_R x D fp32 partials in an unrolled loop: past this many floats a row,
# its reads and compile time outweigh the shares'. Qwen3.5-MoE on an H200 (D 256, two kv heads, one token, 8192
# slots): with 128 shares, compiling and running did not finish in 100 s; 64 run in 38 us.
_MERGED_FLOATS_PER_ROW = 16384


def _programs(device: torch.device) -> int:
    """About two programs per SM fill a GPU (4 in the interpreter)."""
    sms = sm_count(device)
    return 2 * sms if sms else 4


def _splits(slots: int, block_s: int, groups: int, d: int, programs: int) -> int:
    """Shares of the slots per group of rows: `programs` in all, whole tiles each, and no more partials than one
    program merges quickly."""
    return max(1, min(triton.cdiv(slots, block_s), programs // groups, _MERGED_FLOATS_PER_ROW // d))


def decode_attention(folded: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, t: int,
                     scaling: float, sinks: torch.Tensor | None = None, seen: torch.Tensor | None = None,
                     splits: int | None = None, block_s: int = 64, block_r: int = 16) -> torch.Tensor:
    """folded queries [b, kv heads, groups * t, d] (`attention._fold`), key/value [b, kv heads, S, d] (any strides),
    additive mask [b, 1, t, S], sinks [heads] or None -> [b, kv heads, groups * t, d] in the queries' dtype.
    `seen`: None, or a one-element integer tensor on the device: no row sees a slot from it on (the mask hides them
    all), so the shares split the slots before it, rounded up to 16, and the rest are never read. A cache's
    capacity is a power of two between half and all filled; the count stays on the device, so one CUDA graph
    serves every step.
    `splits`: shares of the slots per group of rows (default: `_splits`); `block_r`: folded rows per program, a
    power of two from 16. Each group of rows reads the keys and values again, yet 16 (tl.dot's smallest tile) is
    the fastest on the H200 for verify blocks (session 35: 1.3-5.9x over a program per head's 64-128 rows, whose
    fp32 accumulators spill; 0.99x at worst)."""
    b, kv_heads, rows, d = folded.shape
    slots = key.shape[2]
    whole = max(16, triton.next_power_of_2(rows))  # tl.dot's smallest tile
    block_r = min(block_r, whole)
    if block_r < 16 or block_r & (block_r - 1):
        raise ValueError(f"block_r must be a power of two from 16, got {block_r}")
    groups = b * kv_heads * triton.cdiv(rows, block_r)
    chunk = triton.cdiv(triton.cdiv(slots, splits or _splits(slots, block_s, groups, d, _programs(folded.device))),
                        block_s) * block_s
    splits = triton.cdiv(slots, chunk)
    acc = torch.empty(groups, splits, block_r, d, device=folded.device, dtype=torch.float32)
    stats = torch.empty(groups, splits, 2, block_r, device=folded.device, dtype=torch.float32)
    out = torch.empty(b, kv_heads, rows, d, device=folded.device, dtype=folded.dtype)
    counts = arrival_counts(folded.device, groups)
    sinks_or_any = sinks if sinks is not None else acc  # an unread pointer without sinks
    shape = dict(KV_HEADS=kv_heads, PARTS=groups // (b * kv_heads), SPLITS=splits, D=d, BLOCK_R=block_r,
                 HAS_SINKS=sinks is not None)
    _split_kernel[(groups, splits)](  # acc: an unread pointer in place of what is None
        folded, key, value, mask, seen if seen is not None else acc, acc, stats, sinks_or_any, out,
        counts if counts is not None else acc, scaling, rows, t, slots, rows // t, *folded.stride()[:3],
        *key.stride()[:3], *value.stride()[:3], mask.stride(0), mask.stride(2), mask.stride(3), **shape,
        BLOCK_S=block_s, HAS_SEEN=seen is not None, MERGE_IN_LAUNCH=counts is not None,
        PRECISION="ieee" if folded.dtype == torch.float32 else "tf32",
        num_warps=8 if block_r * d >= 8192 else 4)  # a verify block's rows x head dim of fp32 accumulators
    if counts is None:
        _merge_kernel[(groups,)](acc, stats, sinks_or_any, out, rows, t, rows // t, **shape, num_warps=4)
    return out


def grouped_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                             sinks: torch.Tensor | None, scaling: float, seen: torch.Tensor | None = None,
                             **tiles) -> torch.Tensor:
    """query [b, heads, t, d] -> [b, t, heads, d], as `attention.folded_attention` takes and returns them: the
    queries folded for `decode_attention`, its output unfolded. `seen` and `tiles` (splits, block_s, block_r) as
    `decode_attention` takes them."""
    heads, t = query.shape[1], query.shape[2]
    folded = decode_attention(_fold(query, key.shape[1]).contiguous(), key, value, mask, t, scaling, sinks, seen,
                              **tiles)
    return _unfold(folded, heads, t)
