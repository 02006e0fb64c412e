"""The device-managed expert cache: which (layer, expert) sits in which slot, LRU order and the choice of victims,
all kept in device tensors and updated on the device (one Triton program per update, `kernels.slot_table`), so an
offloaded MoE layer never reads anything back to the host (`offload_experts(..., manager="device")`).

The host-managed cache (`dflash_compile.offload.ExpertCache`) reads each layer's routing on the host to decide its
copies: one sync per MoE layer, and the step cannot be one CUDA graph. Here a layer call

1. `use`: stamps the slots of its routed experts with the current clock (they are this call's and cannot be
   evicted by it) and counts hits (expert in a slot) and misses (read by the kernel from its host blob);
2. `plan`: for the next layer's predicted experts, picks for each one not in a slot the least recently stamped slot
   that is not protected, evicts its owner and writes the copy list (expert, slot, valid) into fixed buffers that a
   copy kernel on a side stream reads (`kernels.blob_copy`);
3. runs the fused kernel with its `slot_of` row: experts without a slot come from pinned host memory.

A call with many pairs per expert (a prompt's) first plans slots for its own routed experts (`plan(...,
staged=True)`) and waits for their copies, since the kernel would read a host blob once per block of pairs.

Only predicted experts enter the cache; a miss is read over PCIe once and not kept. Layers that nothing predicts (the
first MoE layer) would miss every time: `pin` gives their experts slots for good while the pool keeps a full layer's
worth free for the others. Every update has a fixed shape (the copy lists a fixed length, rows marked valid or
not), so it can be captured in a CUDA graph. On the CPU the updates run in Triton's interpreter.
"""

from __future__ import annotations

import torch


class DeviceSlotTable:
    """Slot tables of `layers` MoE layers with `experts` experts each over `slots` device slots."""

    HITS, MISSES, PREFETCHED, WASTED = range(4)  # rows of `counts`
    PINNED = torch.iinfo(torch.int64).max  # the stamp of a pinned slot: never older than the clock

    def __init__(self, layers: int, experts: int, slots: int, device: torch.device, ahead: int = 1):
        if slots < experts:
            raise ValueError(f"{slots} slots cannot hold one layer's {experts} experts")
        self.experts, self.slots = experts, slots
        self.slot_of = torch.full((layers * experts,), -1, dtype=torch.int32, device=device)  # key -> slot
        self.owner = torch.full((slots,), -1, dtype=torch.int64, device=device)  # slot -> key (layer*E + e)
        self.stamp = torch.zeros(slots, dtype=torch.int64, device=device)  # slot -> clock of its last use
        self.used = torch.zeros(slots, dtype=torch.uint8, device=device)  # read since it was filled
        self.clock = torch.zeros((), dtype=torch.int64, device=device)
        self.counts = torch.zeros(4, dtype=torch.int64, device=device)
        # copy lists, written by plans and read by the copy kernel on the side stream: one per layer and distance
        # ahead of the planning call (up to `ahead`). With one list per layer, a plan for layer L+2 made at L+1
        # rewrote the list that L's plan for L+2 left to a copy kernel still queued behind other copies: those copies
        # were lost and their slots held stale experts. A list (L, d) is written again only by the next step's call
        # d+1 layers before L, which the compute stream reaches after waiting for L's copies.
        lists = (layers, max(ahead, 1), experts)
        self.copy_experts = torch.zeros(lists, dtype=torch.int64, device=device)
        self.copy_slots = torch.zeros(lists, dtype=torch.int64, device=device)
        self.copy_valid = torch.zeros(lists, dtype=torch.int32, device=device)
        from .kernels.slot_table import candidate_rows  # a plan's oldest keys per chunk of a large pool

        self.candidates = torch.empty(candidate_rows(slots, experts), dtype=torch.int64, device=device)

    def table(self, layer: int) -> torch.Tensor:
        """[E] int32: layer's expert -> slot, -1 for none (a view: later updates show)."""
        return self.slot_of[layer * self.experts: (layer + 1) * self.experts]

    def pin(self, layers: list[int]) -> list[tuple[int, int, int]]:
        """Give `layers`' experts the first slots for good (before any use); the (layer, expert, slot) placements,
        whose blobs the caller copies in."""
        placed = [(layer, expert, i * self.experts + expert)
                  for i, layer in enumerate(layers) for expert in range(self.experts)]
        if len(placed) > self.slots - self.experts:
            raise ValueError(f"pinning {len(layers)} layer(s) would leave fewer than one layer's {self.experts} "
                             f"slots of {self.slots} to the others")
        for layer, expert, slot in placed:
            self.slot_of[layer * self.experts + expert] = slot
            self.owner[slot] = layer * self.experts + expert
            self.stamp[slot] = self.PINNED
        return placed

    def use(self, layer: int, top_k_index: torch.Tensor) -> None:
        """A layer call's routed experts: a new clock tick, their slots stamped and marked used, hits and misses
        counted (each needed expert once)."""
        from .kernels.slot_table import use_slots

        use_slots(self.table(layer), top_k_index, self.stamp, self.used, self.clock, self.counts)

    def copy_list(self, layer: int, distance: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(experts, slots, valid), each [E]: the copy list of plans for `layer` made `distance` layers before it."""
        return tuple(rows[layer, distance - 1] for rows in (self.copy_experts, self.copy_slots, self.copy_valid))

    def plan(self, layer: int, predicted: torch.Tensor, distance: int = 1, staged: bool = False) -> int:
        """Slots for `layer`'s `predicted` experts that have none (least recently used unprotected slots, their
        owners evicted), planned by the call `distance` layers before it; the copies are written to that copy list
        (`copy_list`), whose first returned-count rows a copy kernel must run. Predicted experts already in a slot
        are stamped (kept). `staged`: the layer's own routed experts, planned by its call after `use` (counted as
        its misses there, not as prefetches, and used)."""
        from .kernels.slot_table import plan_slots

        return plan_slots(self.table(layer), predicted, self.slot_of, self.owner, self.stamp, self.used, self.clock,
                          self.counts, *self.copy_list(layer, distance), layer * self.experts, self.candidates,
                          staged)

    def drain(self) -> list[int]:
        """[hits, misses, prefetched, wasted] since the last drain (reads the device: a sync)."""
        counts = self.counts.tolist()
        self.counts.zero_()
        return counts
