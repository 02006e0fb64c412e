"""Kolibri 1.1's key selection for a whole batch at once (`key_selection.CapturedKolibriIndexer`): the keys
transformers' indexer picks, query group by query group."""

import copy

import pytest
import torch

import dflash_compile
from dflash_compile.key_selection import captured_kolibri_indexer
from dflash_compile.testing import in_installed_transformers

pytestmark = pytest.mark.skipif(not in_installed_transformers("kolibri1_1"), reason="Kolibri 1.1: transformers 5.25")


def causal_over_padding(pads: torch.Tensor, first_query: torch.Tensor, queries: int, slots: int) -> torch.Tensor:
    """[b, 1, q, k] additive masks as the decoder passes them: row b's keys from slot pads[b] up to each query's own
    slot (its queries at slots first_query[b], first_query[b] + 1, ...); keys past them dead."""
    slot = torch.arange(slots)
    query = (first_query[:, None] + torch.arange(queries))[..., None]
    visible = (slot <= query) & (slot >= pads[:, None, None])
    return torch.where(visible, 0.0, torch.finfo(torch.float32).min)[:, None]


@pytest.mark.parametrize("queries", [1, 5, 12])
def test_a_batch_picks_the_keys_transformers_picks_group_by_group(tiny, queries):
    """Rows of different padding and lengths, some queries seeing no more keys than the budget, some fewer than the
    pool, others more (and every row's last query past both): the selected keys and the pool are transformers'
    exactly, on the pool-source layer and on a layer reading its pool; and the selection drops keys."""
    indexer = tiny("kolibri1_1").model.layers[1].self_attn.indexer
    captured = copy.deepcopy(indexer)
    captured_kolibri_indexer(None, captured)
    assert type(captured).__name__ == "CapturedKolibri1_1Indexer"
    generator = torch.Generator().manual_seed(queries)
    for _ in range(10):
        query = torch.randn(3, 4, queries, 16, generator=generator).to(torch.bfloat16)
        key = torch.randn(3, 2, 40, 16, generator=generator).to(torch.bfloat16)
        pads = torch.randint(0, 6, (3,), generator=generator)
        mask = causal_over_padding(pads, pads + torch.randint(0, 40 - queries - 5, (3,), generator=generator), queries,
                                   40)
        expected, pool = indexer(query, key, mask)
        selected, captured_pool = captured(query, key, mask)
        assert torch.equal(selected, expected) and torch.equal(captured_pool, pool)
        assert not torch.equal(selected, mask == 0)  # some queries see fewer keys than their mask shows
        indexer.is_pool_source = captured.is_pool_source = False
        assert torch.equal(captured(query, key, mask, pool)[0], indexer(query, key, mask, pool)[0])
        indexer.is_pool_source = captured.is_pool_source = True


def test_a_query_seeing_no_key_keeps_none(tiny):
    """A prompt's padding positions see no key: they select none, as in transformers, beside real queries."""
    indexer = tiny("kolibri1_1").model.layers[1].self_attn.indexer
    captured = copy.deepcopy(indexer)
    captured_kolibri_indexer(None, captured)
    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn(2, 4, 20, 16, generator=generator), torch.randn(2, 2, 20, 16, generator=generator)
    mask = causal_over_padding(torch.tensor([0, 7]), torch.tensor([0, 0]), 20, 20)
    selected, pool = captured(query, key, mask)
    assert not selected[1, 0, :7].any()
    expected, expected_pool = indexer(query, key, mask)
    assert torch.equal(selected, expected) and torch.equal(pool, expected_pool)


def test_kolibri_layers_reading_another_layers_keys_cache_none(tiny):
    """The layers `kv_source_layers` points elsewhere cache no keys or values of their own: the cache's bytes, known
    before it is made, count none for them."""
    model = tiny("kolibri1_1")
    fast = dflash_compile.optimize(model, adaptive=False, compile=False)
    per_token = fast.decoder.cached_per_token
    assert per_token[3] == 0 and per_token[1] == per_token[0] > 0
