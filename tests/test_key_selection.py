"""Indexers' picks of keys (`key_selection`): Kolibri 1.1's for a whole batch at once, the keys transformers' indexer
picks query group by query group; MiniMax-M3's blocks counted from each row's first key; GLM-5-Next's pools formed
per row over the target cache; Qwen4-Exp's blocks for every query at once."""

import copy

import pytest
import torch

import dflash_compile
from dflash_compile.cache import TargetCache
from dflash_compile.key_selection import (batched_qwen4_exp_indexer, captured_kolibri_indexer, picked_blocks_only,
                                          row_pooled_glm5_next_indexer)
from dflash_compile.testing import in_installed_transformers, tiny_multimodal_config

kolibri = pytest.mark.skipif(not in_installed_transformers("kolibri1_1"), reason="Kolibri 1.1: transformers 5.25")


def causal_over_padding(pads: torch.Tensor, first_query: torch.Tensor, queries: int, slots: int) -> torch.Tensor:
    """[b, 1, q, k] additive masks as the decoder passes them: row b's keys from slot pads[b] up to each query's own
    slot (its queries at slots first_query[b], first_query[b] + 1, ...); keys past them dead."""
    slot = torch.arange(slots)
    query = (first_query[:, None] + torch.arange(queries))[..., None]
    visible = (slot <= query) & (slot >= pads[:, None, None])
    return torch.where(visible, 0.0, torch.finfo(torch.float32).min)[:, None]


@kolibri
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


@kolibri
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


@kolibri
def test_kolibri_layers_reading_another_layers_keys_cache_none(tiny):
    """The layers `kv_source_layers` points elsewhere cache no keys or values of their own: the cache's bytes, known
    before it is made, count none for them."""
    model = tiny("kolibri1_1")
    fast = dflash_compile.optimize(model, adaptive=False, compile=False)
    per_token = fast.decoder.cached_per_token
    assert per_token[3] == 0 and per_token[1] == per_token[0] > 0


def test_minimax_m3_picked_blocks_count_from_each_rows_first_key(tiny):
    """A MiniMax-M3 sparse layer's picked blocks laid onto the slots (`picked_blocks_only`): transformers' own block
    mask for a row without padding; for a row padded by p slots, the same mask p slots to the right (blocks counted
    from its first key, padding masked), as the row gets alone."""
    model = tiny("minimax_m3_vl")
    indexer = model.model.layers[1].self_attn.indexer
    heads = model.config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(-1, 5, (1, indexer.num_heads, 6, 2), generator=generator)
    alone = causal_over_padding(torch.tensor([0]), torch.tensor([14]), 6, 20)
    expected = indexer.build_block_mask(blocks, alone, 20, torch.float32, "cpu", torch.arange(14, 20)[None])
    torch.testing.assert_close(picked_blocks_only(alone, blocks, indexer.block_size, heads), expected)
    assert (expected != 0).sum() > (alone != 0).sum() * heads  # the picks drop keys the mask shows
    padded = causal_over_padding(torch.tensor([3]), torch.tensor([17]), 6, 23)
    shifted = picked_blocks_only(padded, blocks, indexer.block_size, heads)
    torch.testing.assert_close(shifted[..., 3:], expected)
    assert (shifted[..., :3] != 0).all()


def _picked_sets(picked: torch.Tensor, first: int = 0) -> list[set[int]]:
    """[t, width] slots per query (-1: none) -> each query's set of slots, counted from slot `first`."""
    return [{slot - first for slot in row.tolist() if slot >= 0} for row in picked]


@pytest.mark.skipif(not in_installed_transformers("glm5_next"), reason="transformers lacks GLM-5-Next")
def test_glm5_next_pools_pick_each_rows_keys_as_transformers_picks_the_row_alone():
    """A left-padded batch over a `TargetCache`, as a prefill (over the prompt's slots: the last pool ends past them)
    and then a verify block on the cached keys (dead slots past the rows' keys): each query attends over the slots
    transformers' indexer picks for its row alone (its pools counted from the row's first key, the tail of its newest
    keys), shifted by the row's padding; fewer keys than it sees once it sees more than its budget."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    config = tiny_multimodal_config("glm5_next").text_config
    generator = torch.Generator().manual_seed(0)
    indexer = Glm5NextTextIndexer(config, layer_idx=1).eval()
    for parameter in indexer.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.5
    pooled = copy.deepcopy(indexer)
    row_pooled_glm5_next_indexer(None, pooled)
    pads, length, block = torch.tensor([0, 3, 6]), 30, 5
    hidden = torch.randn(3, length, config.hidden_size, generator=generator)
    q_resid = torch.randn(3, length, config.q_lora_rank, generator=generator)
    for row, pad in enumerate(pads.tolist()):  # each row's real tokens at its end, padding before (zeros)
        hidden[row, :pad], q_resid[row, :pad] = 0, 0
    cache = TargetCache(3, length + 7, torch.float32, "cpu")
    cache.reset(pads)
    prompt = length - block
    cache.visible = prompt
    prefill_mask = causal_over_padding(pads, torch.zeros(3, dtype=torch.long), prompt, prompt)
    first = pooled(hidden[:, :prompt], q_resid[:, :prompt], prefill_mask, cache)
    cache.visible = None
    cache.rows.commit(torch.full((3,), prompt))
    verified = pooled(hidden[:, prompt:], q_resid[:, prompt:],
                      causal_over_padding(pads, torch.full((3,), prompt), block, length + 7), cache)
    picked = torch.cat([first, verified], dim=1)
    dropped = 0
    for row, pad in enumerate(pads.tolist()):
        alone = indexer(hidden[row:row + 1, pad:], q_resid[row:row + 1, pad:],
                        torch.ones(1, length - pad, dtype=torch.bool), None)[0]
        assert _picked_sets(picked[row, pad:], pad) == _picked_sets(alone)
        assert (picked[row, :pad] == -1).all()
        dropped += sum(len(keys) < query + 1 for query, keys in enumerate(_picked_sets(alone)))
    assert dropped > 20


@pytest.mark.skipif(not in_installed_transformers("qwen4_exp"), reason="transformers lacks Qwen4-Exp")
def test_qwen4_exp_blocks_pick_each_rows_keys_as_transformers_picks_the_row_alone():
    """A left-padded batch over a `TargetCache` (a prefill, then a verify block on the cached keys, dead slots past
    them), each row's queries at their row positions: each query attends over the keys transformers' indexer picks
    for its row alone (blocks from the row's first key, rotated to their first positions, and the tail), shifted by
    the row's padding; fewer keys than it sees once it sees more than its budget."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling

    config = tiny_multimodal_config("qwen4_exp").text_config
    generator = torch.Generator().manual_seed(0)
    indexer = modeling.Qwen4ExpTextQSAIndexer(config, layer_idx=1).eval()
    for parameter in indexer.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.5
    rotary = modeling.Qwen4ExpTextRotaryEmbedding(config)
    holder = torch.nn.ModuleDict({"rotary": rotary, "indexer": copy.deepcopy(indexer)})
    batched_qwen4_exp_indexer(holder, holder["indexer"])
    pads, length, block = torch.tensor([0, 3, 6]), 30, 5
    hidden = torch.randn(3, length, config.hidden_size, generator=generator)
    positions = (torch.arange(length) - pads[:, None]).clamp(min=0)
    cache = TargetCache(3, length + 7, torch.float32, "cpu")
    cache.reset(pads)
    prompt = length - block

    def batched(tokens: slice, mask: torch.Tensor) -> torch.Tensor:
        embeddings = rotary(hidden, positions[None, :, tokens].expand(3, -1, -1))
        return holder["indexer"](hidden[:, tokens], embeddings, mask, cache)[:, 0]

    cache.visible = prompt
    first = batched(slice(0, prompt), causal_over_padding(pads, torch.zeros(3, dtype=torch.long), prompt, prompt))
    cache.visible = None
    cache.rows.commit(torch.full((3,), prompt))
    verified = batched(slice(prompt, length), causal_over_padding(pads, torch.full((3,), prompt), block, length + 7))
    dropped = 0
    for row, pad in enumerate(pads.tolist()):
        alone = length - pad
        embeddings = rotary(hidden, torch.arange(alone).expand(3, 1, -1))
        causal = torch.ones(alone, alone, dtype=torch.bool).tril()[None, None]
        expected = indexer(hidden[row:row + 1, pad:], embeddings, causal, None)[0, 0]
        prefilled = torch.nn.functional.pad(first[row, pad:, pad:], (0, block))  # the prompt's slots, then the block's
        picked = torch.cat([prefilled, verified[row, :, pad:length]])
        assert torch.equal(picked, expected)
        assert not first[row, :pad].any() and not verified[row, :, length:].any()
        dropped += int((expected.sum(-1) < torch.arange(1, alone + 1)).sum())
    assert dropped > 20
