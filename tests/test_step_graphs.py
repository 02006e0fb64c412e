"""Verify steps replayed from CUDA graphs of their own (`StepGraphs`, the CUDA default): the tokens stay
`model.generate`'s, and everything a step's graph depends on besides its arguments' shapes selects its own graph."""

import logging

import pytest
import torch

import dflash_compile
from dflash_compile.step_graphs import StepGraphs
from dflash_compile.testing import OracleDrafter
from tests.test_speculative import NEW_TOKENS, prompts, reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def captured(decoder, step: str = "verify_step") -> int:
    return len(getattr(decoder, step).graphs)


@needs_cuda
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_steps_replay_from_graphs_and_keep_generates_tokens(tiny, family):
    model = tiny(family).cuda()
    ids, mask = (t.cuda() for t in prompts(2))
    expected = reference(model, ids, mask)
    fast = dflash_compile.optimize(model)  # no drafter: one-token steps
    assert isinstance(fast.decoder.verify_step, StepGraphs)
    for _ in range(2):  # the first step of a shape runs as compiled, the next ones replay its graph
        assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)
    assert captured(fast.decoder) == 1

    oracle = dflash_compile.optimize(model, OracleDrafter(expected.cpu(), mask.cpu(), block_size=4), adaptive=False)
    assert torch.equal(oracle.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)
    assert captured(oracle.decoder) == 1


@needs_cuda
def test_the_drafters_calls_replay_from_graphs_too(tiny, random_drafter):
    """The drafter's `draft_logits` and `add_context` of a step's tokens get graphs of their own, over a drafter
    cache that the next generation of the same shape empties and reuses."""
    model = tiny("qwen3_moe").cuda()
    ids, mask = (t.cuda() for t in prompts(2))
    expected = reference(model, ids, mask)
    fast = dflash_compile.optimize(model, random_drafter(model, block_size=4), adaptive=False)
    assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)
    drafter_cache = fast.decoder.drafter_cache
    assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)
    assert fast.decoder.drafter_cache is drafter_cache
    assert captured(fast.decoder, "draft_logits") == 1 and captured(fast.decoder, "context_step") == 1


@needs_cuda
def test_sampling_settings_select_their_own_graph(tiny):
    """A graph replays its capture's temperature: a later generation at another one must not reuse it."""
    model = tiny("qwen3_moe").cuda()
    ids, mask = (t.cuda() for t in prompts(2))

    def sampled(fast, temperature):
        generator = torch.Generator(device="cuda").manual_seed(0)
        return fast.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=True,
                             temperature=temperature, top_k=0, generator=generator)

    fast = dflash_compile.optimize(model)
    for _ in range(2):
        sampled(fast, 0.7)
    hot = sampled(fast, 3.0)
    assert captured(fast.decoder) == 2
    assert torch.equal(hot, sampled(dflash_compile.optimize(model), 3.0))  # a fresh decoder: no graph yet


@needs_cuda
def test_a_new_cache_drops_the_old_caches_graphs(tiny):
    """The graphs write the cache they were captured with; a generation that needs a cache of another capacity
    makes a new one, and the old one's graphs go with it."""
    model = tiny("gpt_oss").cuda()
    ids, mask = (t.cuda() for t in prompts(2))
    more = torch.randint(3, 127, (2, 27), generator=torch.Generator().manual_seed(1)).cuda()
    long_ids, long_mask = torch.cat([ids, more], dim=1), torch.cat([mask, torch.ones_like(more)], dim=1)
    fast = dflash_compile.optimize(model)
    for _ in range(2):
        fast.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    first_cache = fast.decoder.target_cache
    assert captured(fast.decoder) == 1
    out = fast.generate(long_ids, attention_mask=long_mask, max_new_tokens=NEW_TOKENS)
    step = fast.decoder.verify_step
    graphs = list(step.graphs.values())
    assert fast.decoder.target_cache is not first_cache
    assert len(graphs) == 1 and graphs[0].args[1] is fast.decoder.target_cache  # the new cache's, captured anew
    assert not any(arg is first_cache for args in step.objects.values() for arg in args)
    assert torch.equal(out, reference(model, long_ids, long_mask))


@needs_cuda
def test_linear_attention_steps_replay_from_graphs(tiny):
    """Qwen3.5's verify steps replay from graphs too: the linear-attention states they leave are their outputs
    (a replay redoes no Python side effect), committed per row after a partly accepted block, and a second
    generation's states reuse the first one's buffers, which the graphs read."""
    model = tiny("qwen3_5_moe").cuda()
    ids, mask = (t.cuda() for t in prompts(3))
    expected = reference(model, ids, mask)
    oracle = dflash_compile.optimize(model, OracleDrafter(expected.cpu(), mask.cpu(), block_size=6, corruption=0.3,
                                                          vocab_size=128), adaptive=False)
    assert isinstance(oracle.decoder.verify_step, StepGraphs)

    def states():
        cache = oracle.decoder.target_cache
        return [cache, *cache.conv.values(), *cache.recurrent.values()]

    first = None
    for _ in range(2):
        assert torch.equal(oracle.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)
        assert 1 < oracle.last_stats.tau < 6  # some blocks kept in part
        first = first or states()
    assert captured(oracle.decoder) == 1
    assert len(first) > 1 and all(a is b for a, b in zip(first, states(), strict=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA graph capture of CPU work would succeed (empty)")
def test_a_signature_whose_capture_fails_runs_as_compiled(caplog):
    """Without CUDA the capture fails: the call runs the function, warns once for the signature, and does not try
    again; another state is another signature."""
    state, module = ["greedy"], torch.nn.Identity()
    steps = StepGraphs(lambda x, layer: layer(x) * 2, lambda: state[0])
    with caplog.at_level(logging.WARNING, logger="dflash_compile.step_graphs"):
        for i in range(4):
            assert torch.equal(steps(torch.full((3,), float(i)), module), torch.full((3,), 2.0 * i))
        assert len(caplog.records) == 1 and "capture failed" in caplog.records[0].getMessage()
        state[0] = "sampled"
        for i in range(3):
            assert torch.equal(steps(torch.full((2,), float(i)), module), torch.full((2,), 2.0 * i))
    assert len(caplog.records) == 2 and len(steps.failed) == 2 and not steps.graphs
    steps.clear()
    assert not steps.failed and not steps.objects
