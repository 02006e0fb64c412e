"""The device-managed expert cache's per-call table updates (`dflash_compile.slot_table`), each one Triton program:
`use` (a layer call's routed experts: clock tick, stamps, hit and miss counts) and `plan` (slots for the next layer's
predicted experts: LRU victims, evictions, the copy list). As tensor ops they were ~50 small kernels per layer call,
which inside a CUDA graph still cost a launch gap each, on every MoE layer of every step.

One program holds a whole layer's experts (BLOCK_E) and, in `plan`, the stamps of the slots that can be victims
(BLOCK_S), which it sorts as keys (stamp << KEY_BITS | slot): least recently stamped first, lower slot first among
equals. Rows a step writes in global memory and reads back (the stamps it touched, the sorted victims) are separated
by a barrier: all threads of the one program see them.

A pool larger than one chunk (`victim_chunk`) is first cut into chunks, one program each, and each keeps its `rows`
oldest keys (`_oldest_kernel`, before `plan`); `plan` then sorts only those candidates. One program sorting every
slot's key took 67 us per call at 3072 slots and 605 us at 12288 on the H200 (`bench/slot_table.py`), on every MoE
layer of every step. The candidates hold the answer: `plan` needs at most `rows` victims and protects at most
`rows` minus that many slots, and protected slots sort after every unprotected one, so each victim is among its
chunk's `rows` oldest keys.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

KEY_BITS = tl.constexpr(25)  # slot bits of a sort key: up to 2**25 slots
SLOT_MASK = tl.constexpr(2**25 - 1)
STAMP_CAP = tl.constexpr(2**37 - 1)  # stamps sort as at most this (pinned ones); a clock gets there after 1.4e11 calls
PAD_KEY = tl.constexpr(2**62)  # above every key: the block's entries past the last slot sort last
BLOCK_P = 64  # routing entries compared with the experts per step
MIN_CHUNK = 512  # slots per program of the oldest-keys pass, at least (a smaller pool is sorted whole by `plan`)


def victim_chunk(slots: int, rows: int) -> int:
    """Slots per program of the oldest-keys pass: about sqrt(slots * rows), so that a chunk's sort and the sort of
    all chunks' candidates are about as large; `slots` or more means no pass (the pool is one chunk)."""
    return max(MIN_CHUNK, triton.next_power_of_2(math.isqrt(slots * triton.next_power_of_2(rows))))


def candidate_rows(slots: int, experts: int) -> int:
    """The most candidate keys an oldest-keys pass over `slots` can write (for the buffer `plan_slots` takes)."""
    rows = triton.next_power_of_2(experts)
    return triton.cdiv(slots, victim_chunk(slots, 1)) * rows


@triton.jit
def _needed(index, count, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    """[BLOCK_E] bool: which experts occur among the `count` expert ids at `index`."""
    experts = tl.arange(0, BLOCK_E)
    needed = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, count, BLOCK_P):
        entries = start + tl.arange(0, BLOCK_P)
        listed = tl.load(index + entries, mask=entries < count, other=-1)
        needed = tl.maximum(needed, tl.max((listed[:, None] == experts[None, :]).to(tl.int32), axis=0))
    return needed != 0


@triton.jit
def _stamp(stamp, slot, chosen, now):
    """Stamp the chosen slots (distinct) with `now`; pinned ones keep their larger stamp."""
    old = tl.load(stamp + slot, mask=chosen, other=0)
    tl.store(stamp + slot, tl.maximum(old, now), mask=chosen)


@triton.jit
def _add(counts, entry, flags):
    tl.store(counts + entry, tl.load(counts + entry) + tl.sum(flags.to(tl.int64)))


@triton.jit
def _keys(stamp, slots, inside):
    """Sort keys of `slots` (PAD_KEY where not `inside`): stamp above, slot below."""
    stamps = tl.load(stamp + slots, mask=inside, other=0)
    return tl.where(inside, (tl.minimum(stamps, STAMP_CAP) << KEY_BITS) | slots, PAD_KEY)


@triton.jit
def _oldest_kernel(stamp, S, candidates, CHUNK: tl.constexpr, R: tl.constexpr):
    """Program p: the R smallest keys of slots [p * CHUNK, (p + 1) * CHUNK), in order, at candidates[p * R:]."""
    first = tl.program_id(0) * CHUNK
    slots = first + tl.arange(0, CHUNK)
    rank = tl.arange(0, CHUNK)
    tl.store(candidates + tl.program_id(0) * R + rank, tl.sort(_keys(stamp, slots, slots < S)), mask=rank < R)


@triton.jit
def _use_kernel(table, index, count, stamp, used, clock, counts, E, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    now = tl.load(clock) + 1
    tl.store(clock, now)
    experts = tl.arange(0, BLOCK_E)
    slot = tl.load(table + experts, mask=experts < E, other=-1)
    needed = _needed(index, count, BLOCK_E, BLOCK_P)
    hit = needed & (slot >= 0)
    _stamp(stamp, slot, hit, now)
    tl.store(used + slot, tl.full([BLOCK_E], 1, tl.uint8), mask=hit)
    _add(counts, 0, hit)  # counts: hits, misses, prefetched, wasted (DeviceSlotTable's rows)
    _add(counts, 1, needed & (slot < 0))


@triton.jit
def _plan_kernel(table, predicted, count, slot_of, owner, stamp, used, clock, counts, copy_experts, copy_slots,
                 copy_valid, first_key, E, S, rows, candidates, n_candidates, BLOCK_E: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, CANDIDATES: tl.constexpr, STAGED: tl.constexpr):
    now = tl.load(clock)
    experts = tl.arange(0, BLOCK_E)
    slot = tl.load(table + experts, mask=experts < E, other=-1)
    wanted = _needed(predicted, count, BLOCK_E, BLOCK_P)
    _stamp(stamp, slot, wanted & (slot >= 0), now)  # predicted experts already in a slot are kept
    missing = wanted & (slot < 0)
    n_missing = tl.sum(missing.to(tl.int32))
    # copy rows: the missing experts first, then the others, each in expert order (padding ranks past E >= rows)
    rank = tl.where(missing, tl.cumsum(missing.to(tl.int32), 0) - 1,
                    n_missing + tl.cumsum((~missing).to(tl.int32), 0) - 1)
    tl.store(copy_experts + rank, experts.to(tl.int64), mask=rank < rows)
    tl.debug_barrier()  # the stamps just touched are read back below: those slots are now protected
    position = tl.arange(0, BLOCK_S)
    if CANDIDATES:  # the chunks' oldest keys, their stamps read again (this plan may have protected some)
        listed = tl.load(candidates + position, mask=position < n_candidates, other=PAD_KEY)
        keys = _keys(stamp, listed & SLOT_MASK, listed != PAD_KEY)
    else:
        keys = _keys(stamp, position, position < S)
    tl.store(copy_slots + position, tl.sort(keys) & SLOT_MASK, mask=position < rows)
    tl.debug_barrier()
    row = tl.arange(0, BLOCK_E)
    row_ok = row < rows
    expert = tl.load(copy_experts + row, mask=row_ok, other=0)
    victim = tl.load(copy_slots + row, mask=row_ok, other=0)
    valid = row_ok & (row < n_missing) & (tl.load(stamp + victim, mask=row_ok, other=now) < now)  # unprotected
    evicted = tl.load(owner + victim, mask=row_ok, other=-1)
    _add(counts, 3, valid & (evicted >= 0) & (tl.load(used + victim, mask=row_ok, other=1) == 0))
    tl.store(slot_of + evicted, tl.full([BLOCK_E], -1, tl.int32), mask=valid & (evicted >= 0))
    key = first_key + expert
    tl.store(slot_of + key, victim.to(tl.int32), mask=valid)
    tl.store(owner + victim, key, mask=valid)
    tl.store(stamp + victim, tl.full([BLOCK_E], 0, tl.int64) + now, mask=valid)
    tl.store(used + victim, tl.full([BLOCK_E], STAGED, tl.uint8), mask=valid)
    if not STAGED:
        _add(counts, 2, valid)
    tl.store(copy_valid + row, valid.to(tl.int32), mask=row_ok)


def use_slots(table: torch.Tensor, top_k_index: torch.Tensor, stamp: torch.Tensor, used: torch.Tensor,
              clock: torch.Tensor, counts: torch.Tensor) -> None:
    """One layer call's routed experts (`top_k_index`, ids into the layer's `table` [E] of slots): the clock ticks,
    their slots are stamped with it and marked used, hits and misses (each expert once) are added to `counts`."""
    experts = table.numel()
    _use_kernel[(1,)](table, top_k_index.reshape(-1).contiguous(), top_k_index.numel(), stamp, used, clock, counts,
                      experts, BLOCK_E=triton.next_power_of_2(experts), BLOCK_P=BLOCK_P)


def _sort_warps(keys: int) -> int:
    return min(32, max(4, keys // 128))  # ~4 keys per thread to sort


def plan_slots(table: torch.Tensor, predicted: torch.Tensor, slot_of: torch.Tensor, owner: torch.Tensor,
               stamp: torch.Tensor, used: torch.Tensor, clock: torch.Tensor, counts: torch.Tensor,
               copy_experts: torch.Tensor, copy_slots: torch.Tensor, copy_valid: torch.Tensor, first_key: int,
               candidates: torch.Tensor, staged: bool = False) -> int:
    """Slots for the `predicted` experts of the layer whose slots are `table` (a view of `slot_of` from `first_key`)
    that have none: the least recently stamped unprotected slots, their owners evicted. Writes the copy rows
    (`copy_experts`, `copy_slots`, `copy_valid`, each [E]; the slot of a row that is not valid means nothing) and
    returns how many a copy kernel must run. `staged`: the experts are the planning call's own, which reads their
    slots (marked used) and counted them as misses (not counted as prefetched).
    `candidates` ([`candidate_rows`] int64) takes the oldest-keys pass's keys when the pool is cut into chunks."""
    experts, slots = table.numel(), stamp.numel()
    rows = min(predicted.numel(), experts)
    chunk = victim_chunk(slots, rows)
    keys = slots
    if chunk < slots:
        programs, keep = triton.cdiv(slots, chunk), triton.next_power_of_2(rows)
        keys = programs * keep
        _oldest_kernel[(programs,)](stamp, slots, candidates, CHUNK=chunk, R=keep, num_warps=_sort_warps(chunk))
    block_s = triton.next_power_of_2(keys)
    _plan_kernel[(1,)](table, predicted.reshape(-1).contiguous(), predicted.numel(), slot_of, owner, stamp, used,
                       clock, counts, copy_experts, copy_slots, copy_valid, first_key, experts, slots, rows,
                       candidates, keys, BLOCK_E=triton.next_power_of_2(experts), BLOCK_P=BLOCK_P, BLOCK_S=block_s,
                       CANDIDATES=chunk < slots, STAGED=staged, num_warps=_sort_warps(block_s))
    return rows
