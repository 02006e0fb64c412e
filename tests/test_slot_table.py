"""The device-managed expert cache's tables on their own: consistency, protection and LRU order of its victims."""

import pytest
import torch

from dflash_compile.slot_table import DeviceSlotTable


def _residents(table: DeviceSlotTable) -> dict[tuple[int, int], int]:
    """{(layer, expert): slot}, after checking that slot_of and owner describe the same placement."""
    slot_of, owner = table.slot_of[:-1].tolist(), table.owner[:-1].tolist()
    placed = {divmod(key, table.experts): slot for key, slot in enumerate(slot_of) if slot >= 0}
    assert {slot: key for slot, key in enumerate(owner) if key >= 0} == {
        slot: layer * table.experts + expert for (layer, expert), slot in placed.items()}
    return placed


def _copies(table: DeviceSlotTable, layer: int, rows: int) -> list[tuple[int, int]]:
    valid = table.copy_valid[layer, :rows].bool()
    return list(zip(table.copy_experts[layer, :rows][valid].tolist(), table.copy_slots[layer, :rows][valid].tolist()))


def test_plan_fills_free_slots_then_evicts_the_least_recently_used():
    table = DeviceSlotTable(layers=3, experts=4, slots=4, device=torch.device("cpu"))
    table.use(0, torch.tensor([[0, 1]]))
    rows = table.plan(1, torch.tensor([[2, 3]]))
    assert sorted(e for e, _ in _copies(table, 1, rows)) == [2, 3]
    assert set(_residents(table)) == {(1, 2), (1, 3)}
    table.use(1, torch.tensor([[2, 3]]))  # both hits
    assert table.plan(2, torch.tensor([[0, 1]])) == 2
    assert set(_residents(table)) == {(1, 2), (1, 3), (2, 0), (2, 1)}  # the two free slots
    table.use(2, torch.tensor([[0, 3]]))  # (2, 0) a hit, expert 3 of layer 2 a miss (read from host)
    table.use(0, torch.tensor([[1]]))  # next step: layer 1's experts are now the least recently used
    rows = table.plan(1, torch.tensor([[0]]))
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
    table = DeviceSlotTable(layers=2, experts=4, slots=4, device=torch.device("cpu"))
    table.use(0, torch.tensor([[0, 1, 2, 3]]))
    table.plan(1, torch.tensor([[0, 1, 2, 3]]))  # fills all four slots for layer 1
    table.use(1, torch.tensor([[0, 1, 2, 3]]))
    rows = table.plan(0, torch.tensor([[0, 1]]))
    assert _copies(table, 0, rows) == []
    assert set(_residents(table)) == {(1, 0), (1, 1), (1, 2), (1, 3)}


def test_prefetched_experts_evicted_unused_count_as_waste():
    table = DeviceSlotTable(layers=2, experts=4, slots=4, device=torch.device("cpu"))
    table.use(0, torch.tensor([[0]]))
    table.plan(1, torch.tensor([[0, 1, 2, 3]]))
    table.use(1, torch.tensor([[0]]))  # 1, 2 and 3 were guessed wrong
    table.use(0, torch.tensor([[0]]))
    table.plan(0, torch.tensor([[0, 1, 2]]))  # evicts three slots: the unused guesses are older than (1, 0)
    assert set(_residents(table)) == {(1, 0), (0, 0), (0, 1), (0, 2)}
    assert table.drain()[DeviceSlotTable.WASTED] == 3


def test_pinned_experts_are_never_evicted():
    table = DeviceSlotTable(layers=3, experts=4, slots=8, device=torch.device("cpu"))
    assert table.pin([0]) == [(0, e, e) for e in range(4)]
    for step in range(3):  # predictions for layers 1 and 2 cycle through all their experts
        table.use(0, torch.tensor([[step % 4]]))
        table.plan(1, torch.tensor([[0, 1, 2, 3]]))
        table.use(1, torch.tensor([[0]]))
        table.plan(2, torch.tensor([[0, 1, 2, 3]]))
        table.use(2, torch.tensor([[1]]))
        assert all(_residents(table).get((0, e)) == e for e in range(4))
    hits, misses, _, _ = table.drain()
    assert misses == 0 and hits == 9
    with pytest.raises(ValueError, match="pinning 2 layer.s. would leave fewer than one layer's 4 slots of 8"):
        DeviceSlotTable(layers=3, experts=4, slots=8, device=torch.device("cpu")).pin([0, 1])
