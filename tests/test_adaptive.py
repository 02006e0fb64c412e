"""Adaptive verify width: a drafter that does not pay is switched off, one that does keeps its full block, and the
tokens never change."""

import random

import pytest
import torch

import dflash_compile
from dflash_compile.adaptive import WidthChooser
from dflash_compile.testing import OracleDrafter, random_drafter_weights, save_drafter, tiny_drafter_config
from tests.conftest import token_ids

GPU_LIKE = {1: 1.0, 4: 1.3}.__getitem__


def test_chooser_prefers_the_width_with_the_most_tokens_per_second():
    chooser = WidthChooser(4)
    assert chooser.choose() == 4  # untimed widths first, widest first
    for _ in range(3):
        chooser.observe(4, [3, 3], seconds=2.0)  # every draft accepted: 4 tokens per 2 s
    for _ in range(3):
        chooser.observe(1, [0, 0], seconds=1.0)  # 1 token per 1 s
    assert chooser.expected_tokens(4) > 3 and chooser.choose() == 4
    for _ in range(40):
        chooser.observe(4, [0, 0], seconds=2.0)  # now nothing is accepted
    assert chooser.expected_tokens(4) < 1.5
    widths = []
    for _ in range(112):
        widths.append(chooser.choose())
        chooser.observe(widths[-1], [0, 0], seconds=2.0 if widths[-1] == 4 else 1.0)
    probes = [step for step, width in enumerate(widths) if width == 4]  # two steps each, backing off
    assert probes[1::2] == [p + 1 for p in probes[::2]] and len(probes) == 6
    assert probes[2] - probes[0] == 16 and probes[4] - probes[2] == 32


def test_unlucky_first_blocks_do_not_switch_a_good_drafter_off():
    """Three steps of a drafter accepting 70% per draft happen to fail at the first draft (p = 2.7%). Choosing by the
    posterior means then decoded plainly for the rest of the generation (0.64x of block 8 at H200 step times); drawn
    from the posteriors, the chooser keeps trying block 8 and keeps it."""
    times = {1: 6.7, 8: 13.7}.__getitem__  # gpt-oss-20b decode and verify-8 steps on the H200 (ms)
    chooser, acceptance = WidthChooser(8, step_time=times), random.Random(0)
    for _ in range(3):
        chooser.observe(8, [0], seconds=0.0)
    tokens = seconds = 0.0
    for _ in range(200):
        width = chooser.choose()
        accepted = 0
        while accepted < width - 1 and acceptance.random() < 0.7:
            accepted += 1
        chooser.observe(width, [accepted], seconds=0.0)
        tokens, seconds = tokens + accepted + 1, seconds + times(width)
    block_8 = sum(0.7**k for k in range(8)) / times(8)  # expected tokens per ms of the fixed block
    assert tokens / seconds > 0.9 * block_8


def test_first_steps_of_a_width_and_steps_after_a_switch_are_not_timed():
    chooser = WidthChooser(4)
    chooser.observe(4, [1], seconds=100.0)  # compiling
    chooser.observe(4, [1], seconds=10.0)  # recording CUDA graphs
    assert len(chooser.times[4]) == 0
    chooser.observe(4, [1], seconds=1.0)
    assert list(chooser.times[4]) == [1.0]
    for _ in range(3):
        chooser.observe(1, [0], seconds=0.5)
    chooser.observe(4, [1], seconds=50.0)  # right after a switch: pays for it (pending context, cold caches)
    chooser.observe(4, [1], seconds=2.0)
    assert list(chooser.times[1]) == [0.5] and list(chooser.times[4]) == [1.0, 2.0]
    with pytest.raises(ValueError, match="must lie in 1 .. block_size 4"):
        WidthChooser(4, widths=(1, 8))


def test_one_lucky_fast_step_does_not_make_a_width_look_cheap():
    """CPU timings are noisy both ways: block-8 steps of 6-8 ms with ~2.9 tokens against 2.2 ms decode steps do
    not pay (the bundled pair compiled on a 2-core CPU; pricing them at their fastest speculated at 0.79x)."""
    chooser = WidthChooser(8)
    for seconds in (1.0, 1.0, 6.0, 7.5, 7.6, 7.4, 7.5):
        chooser.observe(8, [2], seconds=seconds * 1e-3)
    for _ in range(8):
        chooser.observe(1, [0], seconds=2.2e-3)
    assert [chooser.choose() for _ in range(10)].count(8) <= 1  # a probe at most


def test_mean_timing_for_steps_that_vary_by_themselves(tiny, tmp_path):
    """Offloaded experts: a verify step whose experts are usually cached still pays for its misses now and then.
    With the same times, "median" (the resident default: a stray slow step is noise there) speculates and "mean"
    does not; optimize picks "mean" for offloaded models."""
    choosers = {timing: WidthChooser(4, timing=timing) for timing in ("median", "mean")}
    for chooser in choosers.values():
        for seconds in (100.0, 10.0, 1.0, 1.0, 1.0, 9.0):  # ~2 tokens per step; the first two are not timed
            chooser.observe(4, [1], seconds=seconds)
        for _ in range(5):
            chooser.observe(1, [0], seconds=1.2)
    assert choosers["median"].choose() == 4 and choosers["mean"].choose() == 1
    with pytest.raises(ValueError, match="timing must be 'median' or 'mean'"):
        WidthChooser(4, timing="min")
    from dflash_compile.offload import plan_offload

    model = tiny("olmoe")
    config = tiny_drafter_config(model.config, block_size=4)
    drafter = save_drafter(tmp_path / "d", config, random_drafter_weights(config))
    assert dflash_compile.optimize(tiny("olmoe"), drafter).decoder.chooser.timing == "median"
    offloaded = dflash_compile.optimize(model, drafter, gpu_memory=plan_offload(model).minimum_budget, device="cpu")
    assert offloaded.decoder.chooser.timing == "mean"


def test_random_drafter_is_switched_off_with_the_same_tokens(tiny, tmp_path):
    model = tiny("qwen3_moe")
    ids = token_ids(batch=1)
    expected = model.generate(ids, max_new_tokens=60, do_sample=False)
    config = tiny_drafter_config(model.config, block_size=4)
    drafter = save_drafter(tmp_path / "d", config, random_drafter_weights(config))
    # GPU-like costs (a 4-token verify step 1.3x a decode step) instead of this machine's noisy timings
    fast = dflash_compile.optimize(model, drafter=drafter, compile=False, adaptive=WidthChooser(4, step_time=GPU_LIKE))
    assert torch.equal(fast.generate(ids, max_new_tokens=60), expected)
    widths, committed = fast.last_stats.widths, fast.last_stats.new_tokens[0] - 1  # the first came from the prefill
    assert widths[0] == 4 and widths.count(1) > 0.7 * len(widths)  # plain decoding after the first steps
    assert committed / sum(map(GPU_LIKE, widths)) > 0.9 / GPU_LIKE(1)  # within 10% of plain decoding's tokens/s
    measured = dflash_compile.optimize(model, drafter=drafter, compile=False)  # measured times: same tokens
    assert torch.equal(measured.generate(ids, max_new_tokens=60), expected)
    fixed = dflash_compile.optimize(model, drafter=drafter, compile=False, adaptive=False)
    assert torch.equal(fixed.generate(ids, max_new_tokens=60), expected)
    assert set(fixed.last_stats.widths) == {4}


def test_an_accurate_drafter_keeps_its_full_block(tiny):
    model = tiny("mixtral")
    ids = token_ids(batch=1)
    expected = model.generate(ids, max_new_tokens=60, do_sample=False)
    fast = dflash_compile.optimize(model, drafter=OracleDrafter(expected, None, block_size=4), compile=False,
                                   adaptive=WidthChooser(4, step_time=GPU_LIKE))
    assert torch.equal(fast.generate(ids, max_new_tokens=60), expected)
    assert fast.last_stats.widths.count(4) > 0.8 * len(fast.last_stats.widths)
    assert fast.last_stats.tau > 3


def test_chooser_must_match_the_drafter(tiny):
    model = tiny("olmoe")
    with pytest.raises(ValueError, match="WidthChooser is for block size 8, the drafter's is 4"):
        dflash_compile.optimize(model, drafter=OracleDrafter(torch.zeros(1, 4, dtype=torch.long), None, 4),
                                compile=False, adaptive=WidthChooser(8))


def test_deferred_drafter_context_equals_adding_each_step(tiny, tmp_path):
    """Steps without drafting leave their tokens pending; one later add_context gives the same drafter cache."""
    from dflash_compile.drafter import load_drafter
    from dflash_compile.speculative import _left_aligned

    model = tiny("qwen3_moe")
    config = tiny_drafter_config(model.config, block_size=4)
    drafter, ids = load_drafter(save_drafter(tmp_path / "d", config, random_drafter_weights(config)), model)
    generator = torch.Generator().manual_seed(3)
    chunks = [(torch.randn(2, w, 2 * 64, generator=generator), torch.tensor(kept))
              for w, kept in ((1, [1, 0]), (4, [3, 1]), (1, [1, 1]), (4, [0, 4]))]
    one_by_one, at_once = (drafter.new_cache(2, 16, torch.float32, "cpu") for _ in range(2))
    with torch.no_grad():
        for features, kept in chunks:
            drafter.add_context(one_by_one, features, kept)
        drafter.add_context(at_once, *_left_aligned(chunks))
    assert torch.equal(one_by_one.lengths, at_once.lengths) and one_by_one.lengths.tolist() == [5, 6]
    for layer in range(2):
        for mine, theirs in zip(one_by_one.kv(layer), at_once.kv(layer)):
            for row, length in enumerate(one_by_one.lengths.tolist()):
                torch.testing.assert_close(mine[row, :, :length], theirs[row, :, :length])
