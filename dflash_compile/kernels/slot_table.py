"""The device-managed expert cache's per-call table updates (`dflash_compile.slot_table`), each one Triton program:
`use` (a layer call's routed experts: clock tick, stamps, hit and miss counts) and `plan` (slots for the next layer's
predicted experts: LRU victims, evictions, the copy list). As tensor ops they were ~50 small kernels per layer call,
which inside a CUDA graph still cost a launch gap each, on every MoE layer of every step.

One program holds a whole layer's experts (BLOCK_E) and, in `plan`, every slot's stamp (BLOCK_S), which it sorts as
keys (stamp << KEY_BITS | slot): least recently stamped first, lower slot first among equals. Rows a step writes in
global memory and reads back (the stamps it touched, the sorted victims) are separated by a barrier: all threads of
the one program see them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KEY_BITS = tl.constexpr(25)  # slot bits of a sort key: up to 2**25 slots
SLOT_MASK = tl.constexpr(2**25 - 1)
STAMP_CAP = tl.constexpr(2**37 - 1)  # stamps sort as at most this (pinned ones); a clock gets there after 1.4e11 calls
PAD_KEY = tl.constexpr(2**62)  # above every key: the block's entries past the last slot sort last
BLOCK_P = 64  # routing entries compared with the experts per step


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
                 copy_valid, first_key, E, S, rows, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                 BLOCK_S: tl.constexpr):
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
    slots = tl.arange(0, BLOCK_S)
    stamps = tl.load(stamp + slots, mask=slots < S, other=0)
    keys = tl.where(slots < S, (tl.minimum(stamps, STAMP_CAP) << KEY_BITS) | slots, PAD_KEY)
    tl.store(copy_slots + slots, tl.sort(keys) & SLOT_MASK, mask=slots < rows)
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
    tl.store(used + victim, tl.full([BLOCK_E], 0, tl.uint8), mask=valid)
    _add(counts, 2, valid)
    tl.store(copy_valid + row, valid.to(tl.int32), mask=row_ok)


def use_slots(table: torch.Tensor, top_k_index: torch.Tensor, stamp: torch.Tensor, used: torch.Tensor,
              clock: torch.Tensor, counts: torch.Tensor) -> None:
    """One layer call's routed experts (`top_k_index`, ids into the layer's `table` [E] of slots): the clock ticks,
    their slots are stamped with it and marked used, hits and misses (each expert once) are added to `counts`."""
    experts = table.numel()
    _use_kernel[(1,)](table, top_k_index.reshape(-1).contiguous(), top_k_index.numel(), stamp, used, clock, counts,
                      experts, BLOCK_E=triton.next_power_of_2(experts), BLOCK_P=BLOCK_P)


def plan_slots(table: torch.Tensor, predicted: torch.Tensor, slot_of: torch.Tensor, owner: torch.Tensor,
               stamp: torch.Tensor, used: torch.Tensor, clock: torch.Tensor, counts: torch.Tensor,
               copy_experts: torch.Tensor, copy_slots: torch.Tensor, copy_valid: torch.Tensor, first_key: int) -> int:
    """Slots for the `predicted` experts of the layer whose slots are `table` (a view of `slot_of` from `first_key`)
    that have none: the least recently stamped unprotected slots, their owners evicted. Writes the copy rows
    (`copy_experts`, `copy_slots`, `copy_valid`, each [E]) and returns how many a copy kernel must run."""
    experts, slots = table.numel(), stamp.numel()
    rows = min(predicted.numel(), experts)
    block_s = triton.next_power_of_2(slots)
    _plan_kernel[(1,)](table, predicted.reshape(-1).contiguous(), predicted.numel(), slot_of, owner, stamp, used,
                       clock, counts, copy_experts, copy_slots, copy_valid, first_key, experts, slots, rows,
                       BLOCK_E=triton.next_power_of_2(experts), BLOCK_P=BLOCK_P, BLOCK_S=block_s,
                       num_warps=min(32, max(4, block_s // 128)))  # ~4 keys per thread to sort
    return rows
