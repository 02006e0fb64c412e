"""The device-managed expert cache's tables on their own: consistency, protection and LRU order of its victims."""

import pytest
import torch

from dflash_compile.kernels import slot_table as slot_kernels
from dflash_compile.slot_table import DeviceSlotTable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the update kernels: compiled or interpreted


def _ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, device=DEVICE)


def _residents(table: DeviceSlotTable) -> dict[tuple[int, int], int]:
    """{(layer, expert): slot}, after checking that slot_of and owner describe the same placement."""
    slot_of, owner = table.slot_of.tolist(), table.owner.tolist()
    placed = {divmod(key, table.experts): slot for key, slot in enumerate(slot_of) if slot >= 0}
    assert {slot: key for slot, key in enumerate(owner) if key >= 0} == {
        slot: layer * table.experts + expert for (layer, expert), slot in placed.items()}
    return placed


def _copy_rows(table: DeviceSlotTable, layer: int, rows: int, distance: int = 1) -> list[tuple[int, int, bool]]:
    experts, slots, valid = (part[:rows].tolist() for part in table.copy_list(layer, distance))
    return list(zip(experts, slots, map(bool, valid)))


def _copies(table: DeviceSlotTable, layer: int, rows: int) -> list[tuple[int, int]]:
    return [(expert, slot) for expert, slot, valid in _copy_rows(table, layer, rows) if valid]


def test_plan_fills_free_slots_then_evicts_the_least_recently_used():
    table = DeviceSlotTable(layers=3, experts=4, slots=4, device=DEVICE)
    table.use(0, _ids([[0, 1]]))
    rows = table.plan(1, _ids([[2, 3]]))
    assert sorted(e for e, _ in _copies(table, 1, rows)) == [2, 3]
    assert set(_residents(table)) == {(1, 2), (1, 3)}
    table.use(1, _ids([[2, 3]]))  # both hits
    assert table.plan(2, _ids([[0, 1]])) == 2
    assert set(_residents(table)) == {(1, 2), (1, 3), (2, 0), (2, 1)}  # the two free slots
    table.use(2, _ids([[0, 3]]))  # (2, 0) a hit, expert 3 of layer 2 a miss (read from host)
    table.use(0, _ids([[1]]))  # next step: layer 1's experts are now the least recently used
    rows = table.plan(1, _ids([[0]]))
    (expert, slot), = _copies(table, 1, rows)
    placed = _residents(table)
    assert expert == 0 and placed[(1, 0)] == slot and len(placed) == 4
    assert (1, 2) not in placed or (1, 3) not in placed  # one of layer 1's old experts gave its slot
    assert (2, 0) in placed  # stamped at its use, after layer 1's
    hits, misses, prefetched, wasted = table.drain()
    assert (hits, misses, prefetched) == (3, 4, 5)  # layer 0 three times (never predicted) and (2, 3) missed
    assert wasted == 0  # the evicted expert had been used
    assert table.drain() == [0, 0, 0, 0]


def test_a_plan_never_evicts_what_the_current_call_uses():
    """One layer's worth of slots: a call's own experts are protected, so a prediction that needs their slots gets
    none (its experts will be read from host memory) and nothing the running layer reads is overwritten."""
    table = DeviceSlotTable(layers=2, experts=4, slots=4, device=DEVICE)
    table.use(0, _ids([[0, 1, 2, 3]]))
    table.plan(1, _ids([[0, 1, 2, 3]]))  # fills all four slots for layer 1
    table.use(1, _ids([[0, 1, 2, 3]]))
    rows = table.plan(0, _ids([[0, 1]]))
    assert _copies(table, 0, rows) == []
    assert set(_residents(table)) == {(1, 0), (1, 1), (1, 2), (1, 3)}


def test_plans_for_a_layer_from_two_calls_keep_their_own_copy_lists():
    """Prefetching two layers ahead, layer 2 is planned by layer 0's call and again by layer 1's. On the GPU the copy
    kernel of the first plan may still be queued when the second is made: the second must not rewrite its list (it
    did, and the first plan's copies were lost while their slots claimed the experts)."""
    table = DeviceSlotTable(layers=3, experts=4, slots=8, device=DEVICE, ahead=2)
    table.use(0, _ids([[0]]))
    first = table.plan(2, _ids([[1, 2]]), distance=2)
    listed = _copy_rows(table, 2, first, distance=2)
    table.use(1, _ids([[0]]))
    second = table.plan(2, _ids([[1, 3]]), distance=1)  # 1 has its slot now: only 3 is copied
    assert _copy_rows(table, 2, first, distance=2) == listed
    assert sorted(expert for expert, _, valid in listed if valid) == [1, 2]
    assert [expert for expert, _, valid in _copy_rows(table, 2, second) if valid] == [3]


def test_prefetched_experts_evicted_unused_count_as_waste():
    table = DeviceSlotTable(layers=2, experts=4, slots=4, device=DEVICE)
    table.use(0, _ids([[0]]))
    table.plan(1, _ids([[0, 1, 2, 3]]))
    table.use(1, _ids([[0]]))  # 1, 2 and 3 were guessed wrong
    table.use(0, _ids([[0]]))
    table.plan(0, _ids([[0, 1, 2]]))  # evicts three slots: the unused guesses are older than (1, 0)
    assert set(_residents(table)) == {(1, 0), (0, 0), (0, 1), (0, 2)}
    assert table.drain()[DeviceSlotTable.WASTED] == 3


def test_pinned_experts_are_never_evicted():
    table = DeviceSlotTable(layers=3, experts=4, slots=8, device=DEVICE)
    assert table.pin([0]) == [(0, e, e) for e in range(4)]
    for step in range(3):  # predictions for layers 1 and 2 cycle through all their experts
        table.use(0, _ids([[step % 4]]))
        table.plan(1, _ids([[0, 1, 2, 3]]))
        table.use(1, _ids([[0]]))
        table.plan(2, _ids([[0, 1, 2, 3]]))
        table.use(2, _ids([[1]]))
        assert all(_residents(table).get((0, e)) == e for e in range(4))
    hits, misses, _, _ = table.drain()
    assert misses == 0 and hits == 9
    with pytest.raises(ValueError, match="pinning 2 layer.s. would leave fewer than one layer's 4 slots of 8"):
        DeviceSlotTable(layers=3, experts=4, slots=8, device=DEVICE).pin([0, 1])


class _ReferenceTable:
    """The cache's rules in plain Python, one expert at a time (what the kernels compute at once)."""

    def __init__(self, layers, experts, slots):
        self.experts, self.slots = experts, slots
        self.slot_of, self.owner = [-1] * (layers * experts), [-1] * slots
        self.stamp, self.used, self.clock, self.counts = [0] * slots, [0] * slots, 0, [0, 0, 0, 0]

    def use(self, layer, experts):
        self.clock += 1
        for expert in set(experts):
            slot = self.slot_of[layer * self.experts + expert]
            if slot >= 0:
                self.stamp[slot], self.used[slot] = max(self.stamp[slot], self.clock), 1
            self.counts[0 if slot >= 0 else 1] += 1

    def plan(self, layer, predicted):
        rows, wanted = min(len(predicted), self.experts), set(predicted)
        table = self.slot_of[layer * self.experts:(layer + 1) * self.experts]
        for expert in wanted:
            if table[expert] >= 0:
                self.stamp[table[expert]] = max(self.stamp[table[expert]], self.clock)
        missing = sorted(e for e in wanted if table[e] < 0)
        experts = (missing + [e for e in range(self.experts) if e not in missing])[:rows]
        victims = sorted(range(self.slots), key=lambda s: (self.stamp[s], s))[:rows]
        valid = [r < len(missing) and self.stamp[victims[r]] < self.clock for r in range(rows)]
        for expert, victim, ok in zip(experts, victims, valid):
            if ok:
                evicted = self.owner[victim]
                if evicted >= 0:
                    self.slot_of[evicted] = -1
                    self.counts[3] += not self.used[victim]
                self.slot_of[layer * self.experts + expert], self.owner[victim] = victim, layer * self.experts + expert
                self.stamp[victim], self.used[victim] = self.clock, 0
                self.counts[2] += 1
        return list(zip(experts, victims, valid))


@pytest.mark.parametrize("min_chunk", [None, 8], ids=["whole pool", "chunks"])
def test_the_kernels_follow_the_rules_over_a_random_run(min_chunk, monkeypatch):
    """Many layers, a pool that is no power of two, random routing and predictions of any size: tables, counters and
    copy lists equal the plain-Python rules after every update, whether `plan` sorts every slot or (chunks of 8-32
    slots) only the oldest keys of each chunk."""
    if min_chunk:
        monkeypatch.setattr(slot_kernels, "MIN_CHUNK", min_chunk)
    layers, experts, slots, top_k = 5, 12, 37, 3
    assert (slot_kernels.victim_chunk(slots, 1) < slots) == bool(min_chunk)
    table, reference = DeviceSlotTable(layers, experts, slots, DEVICE, ahead=2), _ReferenceTable(layers, experts,
                                                                                                               slots)
    generator = torch.Generator().manual_seed(0)
    for step in range(40):
        layer = step % layers
        routed = torch.randperm(experts, generator=generator)[:top_k].view(1, top_k).to(DEVICE)
        table.use(layer, routed)
        reference.use(layer, routed.reshape(-1).tolist())
        tokens = int(torch.randint(1, 6, (1,), generator=generator))
        predicted = torch.randint(0, experts, (tokens, top_k), generator=generator).to(DEVICE)
        distance = 1 + step % 2
        ahead = (layer + distance) % layers
        rows = table.plan(ahead, predicted, distance)
        expected = reference.plan(ahead, predicted.reshape(-1).tolist())
        # a row that copies nothing names no particular slot (in chunks its slot may differ from the full sort's)
        assert [(e, s if v else None, v) for e, s, v in _copy_rows(table, ahead, rows, distance)] == [
            (e, s if v else None, v) for e, s, v in expected]
        assert table.slot_of.tolist() == reference.slot_of and table.owner.tolist() == reference.owner
        assert table.stamp.tolist() == reference.stamp and table.used.tolist() == reference.used
        assert table.counts.tolist() == reference.counts
    assert reference.counts[2] > slots and reference.counts[3] > 0  # slots were reused, some guesses wasted
