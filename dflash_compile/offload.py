"""Expert offload: routed experts live in host memory, one contiguous blob per expert in its stored format (bf16,
MXFP4, FP8), and a fixed pool of device slots caches them under a memory budget.

    model = dflash_compile.offload_experts(model, gpu_memory="20GiB")     # dense weights on the GPU, experts on host
    fast = dflash_compile.optimize(model, drafter=...)                    # generation as usual, same tokens

Per MoE layer call: the routed experts are read on the host (the one host sync per MoE layer; the expert ids
decide which copies to issue), misses are copied host -> slot on a side stream ordered by events, and the layer
runs the fused kernel on the slot pool with expert ids remapped to slots. A slot a call needs is never evicted by
the same call. Policies: "lru" (least recently used) and "lfu" (least frequently used, ties to the oldest).
That routing read is the only host sync (`stats.routing_wait_s` adds up the time blocked in it; with
`cpu_compute`, misses run on the CPU also read their tokens' hidden rows back).

Prefetch (on by default): in the same host read, the next `prefetch` MoE layers' routers are applied to this
layer's input, and the experts they pick for the call's tokens (one token in decode, the whole block in a DFlash
verify step: the route-ahead union) are copied on the side stream while this layer computes; a layer waits only for
the copies it uses. Two layers ahead keeps the copy engine busy through the next layer's routing read (the layer
after next is already queued), at the price of a weaker guess for it. `stats` counts coverage (needed experts a
prefetch brought in) and waste (prefetched experts evicted unused). Hooks (`add_hook`) see every fetch, hit and
prefetch. With `device="cpu"` the same logic runs with plain copies, which is how the CPU tests check it.

The first MoE layer is never predicted, so it would miss on every call: when the budget leaves a layer's worth of
slots free for the rest, its experts are pinned in slots at start (all layers that fit, without prefetch).

`manager="device"` (what "auto", the default, picks on CUDA) moves all of this onto the device
(`dflash_compile.slot_table`): no routing read, predicted experts copied in by a kernel on the side stream, misses
read by the fused kernel from pinned host memory, and the whole step one CUDA graph (LRU only, no CPU compute, no
hooks).
"""

from __future__ import annotations

import mmap
import os
import re
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .families import experts_modules, routing_of, spec_for_experts_class
from .packed import PackedWeight, expert_weights
from .slot_table import DeviceSlotTable

OFFLOAD_IMPLEMENTATION = "dflash_offload"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}
_ALIGN = 64  # bytes: every component of a blob starts aligned for any dtype and vector loads
# hidden [T, H] -> a router's outputs, expert indices last (`families.routing_of`)
Routing = Callable[[torch.Tensor], tuple]


def parse_size(value) -> int:
    """Bytes from an int, a size string ("20GiB", "500MB", "1.5 GB") or an accelerate-style max_memory dict (its
    GPU entry: key 0, "cuda" or "cuda:0")."""
    if isinstance(value, dict):
        entry = next((value[k] for k in (0, "0", "cuda", "cuda:0") if k in value), None)
        if entry is None:
            raise ValueError(f"max_memory {value} has no GPU entry (key 0 or 'cuda')")
        return parse_size(entry)
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a memory size; write e.g. '20GiB', '500MB' or a byte count")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


@dataclass(frozen=True)
class BlobLayout:
    """Where each tensor of one expert sits inside its byte blob: (part, dtype, shape, byte offset)."""

    parts: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]
    nbytes: int

    @classmethod
    def of(cls, weights: dict[str, torch.Tensor | None]) -> BlobLayout:
        """From one layer's [E, ...] tensors: each expert's slice of each becomes a part of its blob."""
        parts, offset = [], 0
        for name, tensor in weights.items():
            if tensor is None:
                continue
            parts.append((name, tensor.dtype, tuple(tensor.shape[1:]), offset))
            offset += -(-tensor[0].numel() * tensor.element_size() // _ALIGN) * _ALIGN
        return cls(tuple(parts), offset)

    def blobs(self, parts: dict[str, torch.Tensor | None], pin_memory: bool = False) -> torch.Tensor:
        """[E, nbytes] uint8 host blobs holding the [E, ...] `parts` (pinned for copies to a GPU)."""
        experts = next(t for t in parts.values() if t is not None).shape[0]
        blobs = pinned_zeros(experts, self.nbytes) if pin_memory else torch.zeros(experts, self.nbytes,
                                                                                   dtype=torch.uint8)
        for name, view in self.views(blobs).items():
            view.copy_(parts[name])
        return blobs

    def views(self, blobs: torch.Tensor) -> dict[str, torch.Tensor]:
        """[S, nbytes] uint8 blobs -> {part: [S, *shape] view in its dtype} (strided over S, no copy)."""
        out = {}
        for name, dtype, shape, offset in self.parts:
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            out[name] = blobs[:, offset: offset + size].view(dtype).view(blobs.shape[0], *shape)
        return out

    def weights(self, blobs: torch.Tensor, format: str) -> tuple[PackedWeight, PackedWeight]:
        """(gate_up, down) read through `views(blobs)`: expert i is blob row i."""
        views = self.views(blobs)
        return tuple(PackedWeight(format, views[f"{p}_data"], views.get(f"{p}_scales"), views.get(f"{p}_bias"))
                     for p in ("gate_up", "down"))


def pinned_zeros(rows: int, columns: int) -> torch.Tensor:
    """[rows, columns] zeroed uint8 host memory, page-locked for the GPU at exactly its size. torch's pinned
    allocator rounds every allocation up to a power of two (a gpt-oss-20b layer's 0.39 GiB of MXFP4 blobs took
    0.5 GiB: 12.0 GiB of host memory for 9.4 GiB of experts), so the pages of an anonymous mapping are registered
    with CUDA instead (mapped: kernels read them too) and unregistered once no tensor views them."""
    buffer = mmap.mmap(-1, rows * columns, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc'd memory
    blobs = torch.frombuffer(buffer, dtype=torch.uint8).view(rows, columns)
    cudart = torch.cuda.cudart()
    torch.cuda.check_error(cudart.cudaHostRegister(blobs.data_ptr(), blobs.numel(), 3))  # portable | mapped
    weakref.finalize(buffer, cudart.cudaHostUnregister, blobs.data_ptr())
    return blobs


def blob_parts(gate_up: PackedWeight, down: PackedWeight) -> dict[str, torch.Tensor | None]:
    """Routed weights as the named [E, ...] parts of the experts' blobs (what `BlobLayout.weights` reads back)."""
    return {f"{prefix}_{part}": getattr(weight, part) for prefix, weight in (("gate_up", gate_up), ("down", down))
            for part in ("data", "scales", "bias")}


def _blob_parts(module: torch.nn.Module) -> tuple[str, dict[str, torch.Tensor | None]]:
    """An experts module's format and routed weights as the named [E, ...] parts of its blobs, packed or not."""
    gate_up, down = expert_weights(module)
    return gate_up.format, blob_parts(gate_up, down)


class ExpertCache:
    """Which (layer, expert) sits in which slot, and which slot to give up next; pinned entries are never given
    up."""

    def __init__(self, slots: int, policy: str):
        if policy not in ("lru", "lfu"):
            raise ValueError(f"cache policy must be 'lru' or 'lfu', got {policy!r}")
        self.policy, self.free = policy, list(range(slots - 1, -1, -1))
        self.where: OrderedDict[tuple[int, int], int] = OrderedDict()  # least recently used first
        self.uses: dict[tuple[int, int], int] = {}
        self.pinned: dict[tuple[int, int], int] = {}

    def pin(self, key: tuple[int, int]) -> int:
        """A free slot that holds `key` for good."""
        self.pinned[key] = self.free.pop()
        return self.pinned[key]

    def holds(self, key: tuple[int, int]) -> bool:
        return key in self.where or key in self.pinned

    def lookup(self, key: tuple[int, int]) -> int | None:
        if key in self.pinned:
            return self.pinned[key]
        slot = self.where.get(key)
        if slot is not None:
            self.where.move_to_end(key)
            self.uses[key] += 1
        return slot

    def assign(self, key: tuple[int, int], keep: set[tuple[int, int]]) -> tuple[int, tuple[int, int] | None]:
        """A slot for `key` and the entry it evicted (None when a slot was free); never one of `keep`."""
        evicted = None
        if self.free:
            slot = self.free.pop()
        else:
            candidates = (k for k in self.where if k not in keep)  # least recently used first
            if self.policy == "lfu":
                evicted = min(candidates, key=self.uses.get, default=None)
            else:  # the first will do: a decode step's misses must not walk all slots (host time per layer)
                evicted = next(candidates, None)
            if evicted is None:
                raise RuntimeError("every cache slot holds an expert this call needs; the budget is too small")
            slot = self.where.pop(evicted)
            del self.uses[evicted]
        self.where[key], self.uses[key] = slot, 1
        return slot, evicted


@dataclass
class OffloadStats:
    hits: int = 0  # needed experts found in a slot (prefetched ones included)
    misses: int = 0  # needed experts not in a slot: copied in while their layer waited (host manager) or read by
    # the kernel from host memory (device manager)
    bytes_fetched: int = 0  # all host -> device bytes, prefetches included
    per_layer_calls: int = 0
    routing_wait_s: float = 0.0  # host time blocked reading the routing (the one sync per MoE layer), incl. the
    # device work still queued before it
    computed_on_host: int = 0  # needed experts run by the CPU where their blob lives instead of being copied
    prefetched: int = 0  # experts copied ahead of their layer
    prefetch_hits: int = 0  # needed experts that were there because of a prefetch
    prefetch_wasted: int = 0  # prefetched experts evicted before any layer used them

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)

    @property
    def coverage(self) -> float:
        """Of the needed experts that were not cached before their layer was predicted, the share prefetch
        brought in time."""
        return self.prefetch_hits / max(self.prefetch_hits + self.misses, 1)

    @property
    def waste(self) -> float:
        return self.prefetch_wasted / max(self.prefetched, 1)


@dataclass
class _Layer:
    host: torch.Tensor  # [E, blob bytes] uint8, pinned on CUDA machines
    layout: BlobLayout
    format: str
    pooled: tuple[PackedWeight, PackedWeight]  # (gate_up, down) as views over the slot pool, indexed by slot
    router: Routing | None = None  # picks this layer's experts; read by the previous layer's prefetch

    @property
    def on_host(self) -> tuple[PackedWeight, PackedWeight]:
        """(gate_up, down) as views over the host blobs, indexed by expert (what the CPU kernels read)."""
        return self.layout.weights(self.host, self.format)


CPU_COMPUTE = ("off", "auto", "always")
MANAGERS = ("auto", "host", "device")
DEVICE_MANAGER_OPTIONS = ("lru", "off")  # the (policy, cpu_compute) the device-managed cache runs: LRU, all on device


def choose_manager(device: torch.device, policy: str, cpu_compute: str) -> str:
    """The manager "auto" stands for: "device" on CUDA for the options it supports (LRU, no CPU compute), else
    "host". On the H200 the device manager decoded within 1.3x of the PCIe floor in every measured case (Qwen3-
    and gpt-oss-shaped, 25% and 50% resident), the host manager up to 1.83x (its routing read per layer costs most
    where experts are small and many; docs/benchmarks.md); on a CPU the device's tables would need Triton's
    interpreter."""
    return "device" if device.type == "cuda" and (policy, cpu_compute) == DEVICE_MANAGER_OPTIONS else "host"


PREFETCH_TRIAL, PREFETCH_MIN_PRECISION = 64, 0.5
# Device manager: from this many pairs per routed expert (uniform routing, `pairs_per_routed_expert`) a layer call
# copies its experts that have no slot into slots before its kernel (`_stage`), as a prompt's forward does. The
# kernel reads an expert without a slot from host memory once per block of up to 16 of its pairs (the tensor
# cores' rows), so past one block the copy (one PCIe read) wins: H200, gpt-oss-20b (4 layers, bf16 experts, 25%
# resident), an 8192-token prefill took 4.1 s reading them over PCIe block by block (session 38).
STAGED_PAIRS = 16
# Programs of a staged copy (`_stage`): the compute stream waits for it, so unlike a prefetch (blob_copy.PROGRAMS,
# sized to leave SMs to the compute beside it) it takes every SM. H200 (132 SMs), gpt-oss-20b (4 layers, bf16
# experts, 25% resident), an 8192-token prefill: 213.6 / 194.2 / 194.6 ms with 64 / 132 / 264 programs (session 39).
STAGED_COPY_PROGRAMS = 132


@dataclass(frozen=True)
class MissCosts:
    """Measured cost of a missed expert either way: copying its blob to the device, or running it on the CPU
    where it lives (the C++ kernel: a fixed part for reading the weights plus a part per routed token)."""

    fetch_s: float
    host_s: float  # one token
    host_per_token_s: float  # each further token

    def host_cheaper(self, tokens: int) -> bool:
        return self.host_s + self.host_per_token_s * (tokens - 1) < self.fetch_s

    @classmethod
    def measure(cls, offloaded: OffloadedExperts, layer: int, gate, hidden_size: int) -> MissCosts:
        """Median of 3 of each (after a warm-up): blob 0 copied into a scratch device buffer; expert 0 on the CPU
        for 1 and 8 tokens."""
        from .benchmark import timed
        from .expert_store import run_packed

        host, weights = offloaded.layers[layer].host, offloaded.layers[layer].on_host
        scratch = torch.empty_like(host[0], device=offloaded.device)

        def on_host(tokens: int) -> float:
            x = torch.zeros(tokens, hidden_size, dtype=torch.float32)
            index, routing = torch.zeros(tokens, 1, dtype=torch.long), torch.ones(tokens, 1)
            return timed(lambda: run_packed(x, index, routing, *weights, gate), 3)[1]

        one, eight = on_host(1), on_host(8)
        fetch = timed(lambda: scratch.copy_(host[0], non_blocking=True), 3, offloaded.device)[1]
        return cls(fetch, one, max(eight - one, 0.0) / 7)


def predict_experts(router: Routing, hidden: torch.Tensor) -> torch.Tensor:
    """[T, top_k] experts `router` picks for `hidden`: a guess when `hidden` is another layer's input. The
    router module itself runs, as its MoE block calls it (`families.routing_of`; every transformers router returns
    its expert indices last), so each family's own scoring, biases and group limits apply."""
    return router(hidden)[-1]


@dataclass
class OffloadedExperts:
    """The offloaded routed experts of one model: host blobs per MoE layer, one slot pool, the cache."""

    device: torch.device
    slots: int
    policy: str = "lru"
    layers: list[_Layer] = field(default_factory=list)
    prefetch: int = 1  # MoE layers ahead whose predicted experts are copied in (0: none)
    cpu_compute: str = "off"  # "auto": a miss runs on the CPU when MissCosts says that beats its copy; "always"
    hooks: list[Callable[[str, int, int, int], None]] = field(default_factory=list)
    manager: str = "auto"  # who decides the cache: "host" (reads each layer's routing), "device" (slot_table) or
    # "auto" (`choose_manager`)
    _stats: OffloadStats = field(default_factory=OffloadStats)

    def __post_init__(self):
        self.cache = ExpertCache(self.slots, self.policy)
        self.pool: torch.Tensor | None = None
        cuda = self.device.type == "cuda"  # misses (and their slot tables) and prefetches get their own streams, so
        # a layer never waits behind another layer's prefetch
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.prefetch_stream = torch.cuda.Stream(self.device) if cuda else None
        self.in_flight: dict[int, torch.cuda.Event] = {}  # slot -> the event its prefetch copy records
        self.unused_prefetches: set[tuple[int, int]] = set()
        self.miss_costs: MissCosts | None = None  # measured at the first "auto" decision
        self._window = (0, 0)  # stats.prefetched and stats.prefetch_hits when the current prefetch trial began
        if self.cpu_compute not in CPU_COMPUTE:
            raise ValueError(f"cpu_compute must be one of {CPU_COMPUTE}, got {self.cpu_compute!r}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch is a number of layers ahead (0 turns it off), got {self.prefetch}")
        if self.manager not in MANAGERS:
            raise ValueError(f"manager must be one of {MANAGERS}, got {self.manager!r}")
        if self.manager == "auto":
            self.manager = choose_manager(self.device, self.policy, self.cpu_compute)
        if self.manager == "device" and (self.policy, self.cpu_compute) != DEVICE_MANAGER_OPTIONS:
            raise ValueError(f"the device-managed cache is LRU and runs every expert on the device: policy "
                             f"{self.policy!r} and cpu_compute {self.cpu_compute!r} need manager='host'")
        interpreted = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true")
        if self.manager == "device" and not (cuda or interpreted):
            raise ValueError(f"the device-managed cache updates its tables with Triton kernels, which run on "
                             f"{self.device.type} only in Triton's interpreter: set TRITON_INTERPRET=1 before "
                             f"importing dflash_compile, or use manager='host'")
        self.slot_table: DeviceSlotTable | None = None  # manager "device": made by `start`, once the layers are in
        self.landing: dict[int, torch.cuda.Event] = {}  # manager "device": layer -> its planned copies' event
        self.pinned_layers: list[int] = []  # layers whose experts `start` placed in slots for good

    def start(self) -> None:
        """After the last `add_layer`: the layers that no prefetch predicts (the first; all without prefetch), which
        would miss on every call, get their experts pinned in slots for as long as a layer's worth of slots stays
        free for the rest; with manager "device" the cache's tables are made (before any CUDA graph is captured)."""
        experts = self.layers[0].host.shape[0]
        unpredicted = list(range(1 if self.prefetch else len(self.layers)))
        self.pinned_layers = pinned = unpredicted[:max(self.slots // experts - 1, 0)]
        if self.manager == "device":
            self.slot_table = DeviceSlotTable(len(self.layers), experts, self.slots, self.device, ahead=self.prefetch)
            placements = self.slot_table.pin(pinned)
        else:
            placements = [(layer, e, self.cache.pin((layer, e))) for layer in pinned for e in range(experts)]
        for layer, expert, slot in placements:
            self.pool[slot].copy_(self.layers[layer].host[expert])
            self._stats.bytes_fetched += self.pool.shape[1]

    @property
    def stats(self) -> OffloadStats:
        """The counters so far (with the device manager this reads its device counters: a sync)."""
        if self.slot_table is not None:
            hits, misses, prefetched, wasted = self.slot_table.drain()
            self._stats.hits += hits
            self._stats.misses += misses
            self._stats.prefetched += prefetched
            self._stats.prefetch_hits += hits  # only prefetches (and a prompt's own staged copies) fill its slots
            self._stats.prefetch_wasted += wasted
            self._stats.bytes_fetched += (prefetched + misses) * self.layers[0].host.shape[1]
        return self._stats

    def add_layer(self, module: torch.nn.Module, router: Routing | None = None) -> int:
        format, weights = _blob_parts(module)
        layout = BlobLayout.of(weights)
        host = layout.blobs(weights, pin_memory=self.device.type == "cuda")
        if self.layers and layout.nbytes != self.layers[0].layout.nbytes:
            raise ValueError("MoE layers with different expert sizes cannot share one slot pool")
        if self.pool is None:
            self.pool = torch.empty(self.slots, layout.nbytes, dtype=torch.uint8, device=self.device)
        self.layers.append(_Layer(host, layout, format, layout.weights(self.pool, format), router))
        return len(self.layers) - 1

    def add_hook(self, hook: Callable[[str, int, int, int], None]) -> None:
        """`hook(event, layer, expert, slot)` with event "fetch", "prefetch" or "hit", called as the host-managed
        cache decides."""
        if self.manager == "device":
            raise ValueError("hooks see the host-managed cache's decisions; the device-managed one decides on the "
                             "device without telling the host (read `stats`, or offload with manager='host')")
        self.hooks.append(hook)

    def _assign(self, layer: int, experts: list[int], keep: set[tuple[int, int]], event: str):
        """Slots for `experts` of `layer` (never evicting `keep`) and the (slot, expert) copies the misses need."""
        slots, copies = [], []
        for expert in experts:
            key = (layer, expert)
            slot = self.cache.lookup(key)
            if slot is None:
                slot, evicted = self.cache.assign(key, keep)
                if evicted in self.unused_prefetches:
                    self.unused_prefetches.discard(evicted)
                    self.stats.prefetch_wasted += 1
                copies.append((slot, expert))
                kind = event
            else:
                kind = "hit"
            slots.append(slot)
            for hook in self.hooks:
                hook(kind, layer, expert, slot)
        self.stats.bytes_fetched += len(copies) * self.layers[layer].host.shape[1]
        return slots, copies

    def _copy(self, layer: int, copies: list[tuple[int, int]], table: list[int] | None = None):
        """Host -> slot copies on a side stream, after all work queued so far on the compute stream (the slots'
        previous experts are no longer read) and after any prefetch still landing in those slots. With `table` (a
        layer's expert -> slot map; the call's misses) the copies and then the table go on the miss stream, the
        compute stream waits for both now and the device table is returned; without (prefetches) they go on the
        prefetch stream and the compute stream waits per slot at the slot's next use. Nothing is copied on the
        compute stream, so a layer never queues behind another layer's prefetch."""
        host = self.layers[layer].host
        if self.copy_stream is None:
            for slot, expert in copies:
                self.pool[slot].copy_(host[expert])
            return None if table is None else torch.tensor(table, device=self.device)
        compute = torch.cuda.current_stream(self.device)
        stream = self.copy_stream if table is not None else self.prefetch_stream
        stream.wait_stream(compute)
        for slot, _ in copies:
            if slot in self.in_flight:
                stream.wait_event(self.in_flight.pop(slot))
        with torch.cuda.stream(stream):
            for slot, expert in copies:
                self.pool[slot].copy_(host[expert], non_blocking=True)
            device_table = None if table is None else torch.tensor(table, pin_memory=True).to(self.device,
                                                                                           non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        if table is None:
            self.in_flight.update((slot, done) for slot, _ in copies)
            return None
        compute.wait_event(done)
        device_table.record_stream(compute)
        return device_table

    def _fetch(self, layer: int, experts: list[int]) -> torch.Tensor:
        """The device table expert -> slot of `layer` with `experts` in slots, copying the missing ones in; the
        compute stream waits for them and for any prefetch copy still in flight into a slot it reads."""
        slots, copies = self._assign(layer, experts, {(layer, e) for e in experts}, "fetch")
        for expert in experts:
            if (layer, expert) in self.unused_prefetches:
                self.unused_prefetches.discard((layer, expert))
                self.stats.prefetch_hits += 1
        self.stats.hits += len(experts) - len(copies)
        self.stats.misses += len(copies)
        compute = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        for slot in {*slots} & self.in_flight.keys():
            compute.wait_event(self.in_flight.pop(slot))
        table = [-1] * (max(experts) + 1)
        for expert, slot in zip(experts, slots):
            table[expert] = slot
        return self._copy(layer, copies, table)

    def _ahead(self, layer: int) -> list[int]:
        """The MoE layers whose experts `layer`'s call predicts: of the next `prefetch` ones, those whose router reads
        hidden states (DeepSeek-V4's first layers route by token id: `routing_of` gives them none)."""
        following = range(layer + 1, min(layer + 1 + self.prefetch, len(self.layers)))
        return [ahead for ahead in following if self.layers[ahead].router is not None]

    def _judge_prefetch(self) -> None:
        """After each PREFETCH_TRIAL prefetched experts: if fewer than PREFETCH_MIN_PRECISION of them were used, the
        farthest layer ahead is no longer predicted (its guess is the weakest; at depth 1 prefetching stops), as
        for a model whose guesses are poor prefetches only cost bandwidth. The next window judges what is left."""
        prefetched, used = self.stats.prefetched - self._window[0], self.stats.prefetch_hits - self._window[1]
        if prefetched >= PREFETCH_TRIAL:
            if used < PREFETCH_MIN_PRECISION * prefetched:
                self.prefetch -= 1
            self._window = (self.stats.prefetched, self.stats.prefetch_hits)

    def _prefetch(self, layer: int, experts: list[int], keep: set[tuple[int, int]]) -> None:
        """Start copying `layer`'s predicted `experts` (those not cached) without making anything wait yet."""
        predicted = [e for e in experts if not self.cache.holds((layer, e))]
        evictable = self.slots - len(self.cache.pinned)
        if not predicted or len(keep - self.cache.pinned.keys()) + len(predicted) > evictable:
            return  # no room without evicting what this call uses
        _, copies = self._assign(layer, predicted, keep | {(layer, e) for e in predicted}, "prefetch")
        self.stats.prefetched += len(copies)
        self.unused_prefetches.update((layer, e) for e in predicted)
        self._copy(layer, copies)

    def _routed_experts(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor):
        """(the routed expert of every (token, slot) pair, {following layer: its predicted experts} for the next
        `prefetch` layers), all read in ONE host transfer."""
        following = self._ahead(layer)
        guesses = [predict_experts(self.layers[ahead].router, hidden).reshape(-1).to(top_k_index.dtype)
                   for ahead in following]
        start = time.perf_counter()
        ids = torch.cat([top_k_index.reshape(-1), *guesses]).tolist()  # the host sync
        self.stats.routing_wait_s += time.perf_counter() - start
        predicted, offset = {}, top_k_index.numel()
        for ahead, guess in zip(following, guesses):
            predicted[ahead] = sorted(set(ids[offset: offset + guess.numel()]))
            offset += guess.numel()
        return ids[:top_k_index.numel()], predicted

    def _host_side(self, layer: int, pair_experts: list[int], hidden: torch.Tensor, gate) -> set[int]:
        """The missed experts of this call that run on the CPU instead of being copied (see `cpu_compute`)."""
        if self.cpu_compute == "off":
            return set()
        misses = {e for e in pair_experts if not self.cache.holds((layer, e))}
        if self.cpu_compute == "always" or not misses:
            return misses
        if self.miss_costs is None:
            self.miss_costs = MissCosts.measure(self, layer, gate, hidden.shape[-1])
        return {e for e in misses if self.miss_costs.host_cheaper(pair_experts.count(e))}

    def _run_on_host(self, layer: int, hidden: torch.Tensor, top_k_weights: torch.Tensor, pairs: list[int],
                     pair_experts: list[int], gate) -> torch.Tensor:
        """[T, H] on the device: the given (token, slot) pairs' expert outputs, computed by the CPU kernels on the
        host blobs, routing weights applied, summed per token."""
        from .expert_store import run_packed

        top_k = top_k_weights.shape[-1]
        pair_ids = torch.tensor(pairs, device=hidden.device)
        tokens = pair_ids // top_k
        # the pairs' hidden rows and routing weights come back in one transfer
        rows_and_routing = torch.cat([hidden[tokens].float(), top_k_weights.reshape(-1)[pair_ids, None].float()],
                                     dim=1).cpu()
        rows, routing = rows_and_routing[:, :-1], rows_and_routing[:, -1:]
        index = torch.tensor([[pair_experts[p]] for p in pairs])
        per_pair = run_packed(rows, index, routing, *self.layers[layer].on_host, gate)
        self.stats.computed_on_host += len(set(index.flatten().tolist()))
        return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device).index_add_(
            0, tokens, per_pair.to(hidden.device, non_blocking=True)).to(hidden.dtype)

    def run(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate):
        """The layer's routed experts: cached and copied-in ones by the device kernel on the slot pool (launched
        first, so it runs while the CPU works), misses chosen for the CPU by its kernels on the host blobs."""
        from .expert_store import run_packed

        if self.slot_table is not None:
            return self._run_device_managed(layer, hidden, top_k_index, top_k_weights, gate)
        self.stats.per_layer_calls += 1
        pair_experts, predicted = self._routed_experts(layer, hidden, top_k_index)
        on_host = self._host_side(layer, pair_experts, hidden, gate)
        on_device = sorted(set(pair_experts) - on_host)
        table = self._fetch(layer, on_device) if on_device else None
        keep = {(layer, e) for e in on_device}
        self._judge_prefetch()
        for ahead, experts in predicted.items():  # issued before this layer's kernel, which never reads the slots
            # they fill, nearest layer first: they overlap
            if ahead - layer > self.prefetch:
                break
            self._prefetch(ahead, experts, keep)
            keep |= {(ahead, e) for e in experts}
        out = None
        if on_device:
            index, weights = top_k_index, top_k_weights
            if on_host:  # host pairs: the weight 0 on a loaded expert (finite) keeps the device kernel's shape
                host_pairs = torch.tensor([e in on_host for e in pair_experts], device=hidden.device).view_as(index)
                index = torch.where(host_pairs, on_device[0], index)
                weights = torch.where(host_pairs, 0.0, weights)
            out = run_packed(hidden, table[index].to(index.dtype), weights, *self.layers[layer].pooled, gate)
        if on_host:
            pairs = [p for p, e in enumerate(pair_experts) if e in on_host]
            host_out = self._run_on_host(layer, hidden, top_k_weights, pairs, pair_experts, gate)
            out = host_out if out is None else out + host_out
        return out

    def _run_device_managed(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, gate) -> torch.Tensor:
        """The layer with the device-managed cache (`slot_table`): nothing read on the host. A call of more than
        STAGED_PAIRS pairs per routed expert (a prompt's) first copies its own experts that have no slot into slots
        (`_stage`) and then reads the pool as its experts (so at many pairs per expert torch's grouped GEMM runs them,
        as for resident experts: 1.23x / 1.13x over host-fallback reads for gpt-oss-20b / Qwen3-30B-A3B layers at 8192
        tokens, session 40). Copies for the next `prefetch` layers' predicted experts go out on the side stream; this
        layer waits for its own (planned by the previous layer); a call that staged nothing reads the experts that
        have no slot from host memory."""
        from .expert_store import run_packed
        from .kernels.moe import fused_moe, pairs_per_routed_expert

        table = self.slot_table
        table.use(layer, top_k_index)
        staged = pairs_per_routed_expert(*top_k_index.shape, table.experts) > STAGED_PAIRS
        if staged:
            self._stage(layer, top_k_index)
        for ahead in self._ahead(layer):
            distance = ahead - layer
            rows = table.plan(ahead, predict_experts(self.layers[ahead].router, hidden), distance)
            self._copy_planned(ahead, distance, rows)
        self._wait_for_copies(layer)
        spec, slot_of = self.layers[layer], table.table(layer)
        if hidden.is_cuda:
            index, reads = (top_k_index, dict(host=spec.on_host, slot_of=slot_of))
            if staged:  # every routed expert is in a slot: the pool read as the layer's experts, none from the host
                index, reads = slot_of[top_k_index].to(top_k_index.dtype), dict(routed_experts=table.experts)
            return fused_moe(hidden, index, top_k_weights, *spec.pooled, **reads, interleaved=gate.interleaved,
                             activation=gate.activation, alpha=gate.alpha, limit=gate.limit)
        # CPU ("device" and host both CPU memory, for the logic): each pair's blob from its slot or its host blob
        slots = slot_of[top_k_index].long()
        blobs = torch.where((slots >= 0)[..., None], self.pool[slots.clamp(min=0)], spec.host[top_k_index])
        pairs = torch.arange(top_k_index.numel()).view_as(top_k_index)
        return run_packed(hidden, pairs, top_k_weights, *spec.layout.weights(blobs.flatten(0, 1), spec.format), gate)

    def _stage(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Slots for the call's routed experts that have none (planned first, before any layer ahead takes the
        least recently used slots) and their copies, which the call waits for. The copy list is the one the previous
        layer's plan for this layer filled, so its copies must have landed first."""
        self._wait_for_copies(layer)
        rows = self.slot_table.plan(layer, top_k_index, staged=True)
        self._copy_planned(layer, 1, rows, STAGED_COPY_PROGRAMS)

    def _wait_for_copies(self, layer: int) -> None:
        """The compute stream waits for the copies planned for `layer` (if any are still landing)."""
        if layer in self.landing:
            torch.cuda.current_stream(self.device).wait_event(self.landing.pop(layer))

    def _copy_planned(self, layer: int, distance: int, rows: int, programs: int | None = None) -> None:
        """Run the copies `slot_table.plan` listed for `layer` from `distance` layers before it: on CUDA a copy kernel
        (of `programs` programs, by default blob_copy's) on the side stream after everything queued so far (the
        victims' previous experts are no longer read), whose event `layer` waits for."""
        host = self.layers[layer].host
        experts, slots, valid = (part[:rows] for part in self.slot_table.copy_list(layer, distance))
        if self.copy_stream is None:
            chosen = valid.bool()
            self.pool[slots[chosen]] = host[experts[chosen]]
            return
        from .kernels.blob_copy import copy_blobs

        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            copy_blobs(host, self.pool, experts, slots, valid, programs)
            self.landing[layer] = torch.cuda.Event()
            self.landing[layer].record()

    @property
    def pool_bytes(self) -> int:
        return self.pool.numel() if self.pool is not None else 0

    def placements(self) -> dict[tuple[int, int], int]:
        """{(layer, expert): slot} for every expert the cache says is in a slot (device manager: reads its table)."""
        if self.slot_table is None:
            return {**self.cache.where, **self.cache.pinned}
        experts = self.slot_table.experts
        return {divmod(key, experts): slot for slot, key in enumerate(self.slot_table.owner.tolist()) if key >= 0}

    def stale_slots(self) -> list[tuple[int, int, int]]:
        """(layer, expert, slot) of each slot whose bytes are not the blob of the expert the cache places there: a
        copy that was lost or has not landed. Waits for all copies first; for tests and benchmarks (reads the pool)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return [(layer, expert, slot) for (layer, expert), slot in sorted(self.placements().items())
                if not torch.equal(self.pool[slot].cpu(), self.layers[layer].host[expert].cpu())]


@dataclass(frozen=True)
class OffloadPlan:
    """What offloading a model needs: device bytes of everything but the routed experts, bytes per expert blob, and
    the runtime's own reserve on the device."""

    dense_bytes: int
    blob_bytes: int
    experts_per_layer: int
    layers: int
    reserve_bytes: int = 0  # CUDA: cuBLAS workspaces and a step's temporaries (CUDA_RUNTIME_RESERVE)

    @property
    def minimum_budget(self) -> int:
        """Dense weights, one MoE layer of experts and the reserve: a smaller budget could not run a layer."""
        return self.dense_bytes + self.experts_per_layer * self.blob_bytes + self.reserve_bytes

    def slots(self, budget: int) -> int:
        if budget < self.minimum_budget:
            raise ValueError(
                f"gpu_memory {budget / 2**20:.2f} MiB is too small: the dense weights take "
                f"{self.dense_bytes / 2**20:.2f} MiB, one MoE layer's {self.experts_per_layer} experts "
                f"{self.experts_per_layer * self.blob_bytes / 2**20:.2f} MiB ({self.blob_bytes} bytes each) and the "
                f"runtime {self.reserve_bytes / 2**20:.2f} MiB; give at least {self.minimum_budget / 2**20:.2f} MiB")
        return min((budget - self.dense_bytes - self.reserve_bytes) // self.blob_bytes,
                   self.experts_per_layer * self.layers)


def _experts_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no routed experts to offload")
    return modules


# Device memory the allocator hands to the runtime whatever the model: cuBLAS / cuBLASLt workspaces (32 MiB on
# Hopper by default) and a decode or verify step's temporaries. The KV cache and long prefills come on top.
CUDA_RUNTIME_RESERVE = 64 * 2**20


def plan_offload(model: torch.nn.Module, device="cpu") -> OffloadPlan:
    """The plan for offloading `model`'s routed experts to a slot pool on `device`."""
    modules = list(_experts_modules(model).values())
    expert_tensors = {id(t) for m in modules for t in (*m.parameters(), *m.buffers())}
    dense = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                if id(t) not in expert_tensors)
    _, weights = _blob_parts(modules[0])
    reserve = CUDA_RUNTIME_RESERVE if torch.device(device).type == "cuda" else 0
    return OffloadPlan(dense, BlobLayout.of(weights).nbytes, weights["gate_up_data"].shape[0], len(modules), reserve)


def offload_experts(model: torch.nn.Module, gpu_memory, device="cuda", policy: str = "lru",
                    prefetch: int = 1, cpu_compute: str = "off", manager: str = "auto") -> torch.nn.Module:
    """Move `model` to `device` except its routed experts, which go to host blobs behind a slot pool that, with the
    dense weights and the runtime's reserve, fits `gpu_memory` (bytes, "20GiB", or an accelerate max_memory dict).
    Checked before anything moves: the budget must hold the dense weights, one MoE layer's experts and, on CUDA,
    CUDA_RUNTIME_RESERVE. (The KV cache and long prompts' activations come on top, as with accelerate's
    max_memory; `generate` checks the cache against the device's free memory and prefills in chunks that fit.)
    `prefetch`: how many MoE layers ahead to predict and copy experts for (True: 1, False: 0; 0 for a family whose
    routers cannot read its experts' input, `FamilySpec.routers_read_experts_input`).
    `cpu_compute`: "auto" runs a missed expert on the CPU (C++ kernels, on its host blob) when measuring says that
    beats copying it, "always" runs every miss there; outputs then differ from the resident model's by rounding.
    `manager`: "host" decides the cache from each layer's routing read on the host (exact LRU / LFU, misses
    copied in); "device" keeps the cache in device tensors (`dflash_compile.slot_table`): no host read per layer, so
    the whole step is one CUDA graph, predicted experts copied in by a kernel, misses read from pinned memory;
    "auto" (default): "device" on CUDA where the options allow it, else "host" (`choose_manager`)."""
    from .checkpoint import refuse_weights_outside_the_model
    from .expert_store import ExpertStore

    refuse_weights_outside_the_model(model)
    device = torch.device(device)
    slots = plan_offload(model, device).slots(parse_size(gpu_memory))
    modules = _experts_modules(model)
    spec = spec_for_experts_class(type(next(iter(modules.values()))))
    prefetch = int(prefetch) if spec.routers_read_experts_input else 0
    offloaded = OffloadedExperts(device, int(slots), policy, prefetch=prefetch, cpu_compute=cpu_compute,
                                 manager=manager)
    store = ExpertStore()  # what the eager forward dispatches to; compiled graphs get their own entries
    for name, module in tqdm(modules.items(), desc="offloading experts", unit="layer", disable=len(modules) < 8):
        layer = offloaded.add_layer(module, routing_of(model, name))
        for tensor_name in list(module._parameters) + list(module._buffers):
            if tensor_name.startswith(("gate_up_proj", "up_proj", "down_proj", "packed_")):
                module._parameters.pop(tensor_name, None)
                module._buffers.pop(tensor_name, None)
        module.packed_format = None
        module.dflash_offload = (offloaded, layer)
        module.dflash_dispatch = (store.id, store.add_layer(module, spec, f"offloaded layer {layer}"))
        module.config._experts_implementation = OFFLOAD_IMPLEMENTATION
    offloaded.start()
    model.to(device)
    model.dflash_offload, model.dflash_offload_store = offloaded, store  # the store lives as long as the model
    return model
