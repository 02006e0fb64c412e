"""DeepSeek-V4's compressed entries over the target cache (dflash_compile.compressed_attention): made per row from
each row's own windows, and taken back by position when a verify block's drafts are rejected."""

import pytest
import torch
from transformers import DynamicCache

import dflash_compile
from dflash_compile.testing import OracleDrafter, in_installed_transformers
from tests.test_speculative import NEW_TOKENS, prompts, reference

pytestmark = pytest.mark.skipif(not in_installed_transformers("deepseek_v4"), reason="needs DeepSeek-V4")


def _entries_alone(model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' compressed entries by our cache's names ("compressor 1", "indexer 1", ...) after a forward over
    one row's `tokens` [n] alone."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(tokens[None], cache=cache, use_cache=True)
    return {f"{name} {layer}": entries[0] for layer, cached in enumerate(cache.layers)
            for name, entries in getattr(cached, "compressed_kv", {}).items()}


@pytest.mark.parametrize("corruption", [0.0, 0.3])
def test_each_rows_entries_are_transformers_for_the_row_alone(tiny, corruption):
    """After a generation over left-padded rows with drafts accepted in full or in part (verify blocks that close
    windows with tokens later rejected), each row's entries, HCA's, CSA's and its indexer's, are the ones transformers
    makes for that row's kept tokens alone: windows counted from the row's first token, rejected tokens' entries
    made again from the kept ones."""
    model = tiny("deepseek_v4")
    ids, mask = prompts(3)
    expected = reference(model, ids, mask)
    drafter = OracleDrafter(expected, mask, 4, corruption=corruption, vocab_size=128)
    fast = dflash_compile.optimize(model, drafter, adaptive=False, compile=False)
    assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)
    cache = fast.decoder.target_cache
    for row in range(len(ids)):
        pad, length = cache.pad[row].item(), cache.lengths[row].item()
        alone = _entries_alone(model, expected[row, pad:length])
        assert set(alone) == set(cache.compressed) and all(len(entries) for entries in alone.values())
        for name, entries in alone.items():
            torch.testing.assert_close(cache.compressed[name][row, :len(entries)], entries, rtol=1e-5, atol=1e-5)


def test_a_verify_block_sees_only_the_entries_of_windows_closed_before_each_query(tiny):
    """A rejected token's entry stays in the buffer until a kept token writes it again, unseen meanwhile: with every
    entry past the committed ones overwritten by noise before each verify step, greedy tokens are unchanged."""
    model = tiny("deepseek_v4")
    ids, mask = prompts(2)
    expected = reference(model, ids, mask)
    fast = dflash_compile.optimize(model, OracleDrafter(expected, mask, 4, corruption=0.3, vocab_size=128),
                                   adaptive=False, compile=False)
    verify = fast.decoder.verify_step

    def noisy_verify(*args, **kwargs):
        cache = fast.decoder.target_cache
        for name, entries in cache.compressed.items():
            rate = 4 if name == "compressor 0" else 2  # the tiny model's HCA layer 0, CSA layers 1 and 3
            closed = (cache.lengths - cache.pad) // rate
            unseen = torch.arange(entries.shape[1]) >= closed[:, None]
            entries.masked_scatter_(unseen[..., None], torch.randn_like(entries)[unseen[..., None].expand_as(entries)])
        return verify(*args, **kwargs)

    fast.decoder.verify_step = noisy_verify
    assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)
