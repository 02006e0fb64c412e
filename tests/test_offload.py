"""Expert offload on the CPU ("device" and host both CPU memory): the cache logic, budgets, and token identity."""

import pytest
import torch

import dflash_compile
import dflash_compile.testing
from dflash_compile.offload import BlobLayout, ExpertCache, offload_experts, parse_size, plan_offload
from dflash_compile.testing import TINY_CONFIGS, random_drafter_weights, save_drafter, tiny_drafter_config
from tests.conftest import token_ids

FAMILIES = sorted(TINY_CONFIGS)


def _offloaded(tiny, family, policy="lru", extra_slots=0):
    model = tiny(family)
    plan = plan_offload(model)
    budget = plan.minimum_budget + extra_slots * plan.blob_bytes  # one layer of experts: every layer evicts
    return offload_experts(model, budget, device="cpu", policy=policy)


@pytest.mark.parametrize("family", FAMILIES)
def test_offloaded_generation_is_token_identical(tiny, family):
    ids = token_ids()
    expected = tiny(family).generate(ids, max_new_tokens=10, do_sample=False)
    for policy in ("lru", "lfu"):
        model = _offloaded(tiny, family, policy)
        offloaded = model.dflash_offload
        assert offloaded.slots == plan_offload(tiny(family)).experts_per_layer
        assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), expected)
        assert offloaded.stats.misses > offloaded.slots  # slots were reused: eviction happened
        assert not any("experts.gate_up_proj" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_5_moe"])
def test_offload_with_compiled_dflash_speculative_decoding(tiny, family, tmp_path):
    ids = token_ids(batch=1)
    reference = tiny(family)
    expected = reference.generate(ids, max_new_tokens=12, do_sample=False)
    config = tiny_drafter_config(reference.config, block_size=4)
    drafter = save_drafter(tmp_path / "d", config, random_drafter_weights(config))
    fast = dflash_compile.optimize(_offloaded(tiny, family, extra_slots=2), drafter=drafter)
    assert torch.equal(fast.generate(ids, max_new_tokens=12), expected)


def test_packed_experts_offload_in_their_format(tmp_path):
    from dflash_compile.checkpoint import load_packed, quantize
    from dflash_compile.testing import load_tiny_model, save_tiny_model

    model = load_tiny_model("gpt_oss", directory=save_tiny_model("gpt_oss", tmp_path / "m", intermediate_size=64))
    directory = quantize(model, tmp_path / "q", "mxfp4")
    ids = token_ids()
    expected = load_packed(directory, torch.float32).generate(ids, max_new_tokens=8, do_sample=False)
    packed = load_packed(directory, torch.float32)
    plan = plan_offload(packed)
    assert plan.blob_bytes < 64 * 64 * 3 * 4 / 6  # MXFP4 blobs: about a sixth of fp32 (plus biases)
    offloaded = offload_experts(packed, plan.minimum_budget, device="cpu")
    assert torch.equal(offloaded.generate(ids, max_new_tokens=8, do_sample=False), expected)


def test_hooks_see_every_fetch_and_hit(tiny):
    model = _offloaded(tiny, "olmoe")
    events = []
    model.dflash_offload.add_hook(lambda event, layer, expert, slot: events.append(event))
    model(token_ids())
    stats = model.dflash_offload.stats
    assert events.count("fetch") == stats.misses and events.count("hit") == stats.hits and events
    placement = dflash_compile.explain(model, token_ids()).expert_placement
    assert placement.startswith("2 layers offloaded to host memory (dense") and "8 slots on cpu" in placement


def test_cache_policies():
    lru, lfu = ExpertCache(2, "lru"), ExpertCache(2, "lfu")
    for cache in (lru, lfu):
        cache.assign((0, 0), set())
        cache.assign((0, 1), set())
        cache.lookup((0, 0))
        cache.lookup((0, 0))
        cache.lookup((0, 1))  # (0, 1) most recent, (0, 0) most frequent
    assert lru.assign((0, 2), set())[1] == (0, 0)
    assert lfu.assign((0, 2), set())[1] == (0, 1)
    assert lru.assign((0, 3), keep={(0, 1)})[1] == (0, 2)  # a slot the call needs is never given up
    with pytest.raises(RuntimeError, match="every cache slot holds an expert this call needs"):
        lru.assign((0, 4), keep={(0, 1), (0, 3)})
    with pytest.raises(ValueError, match="cache policy must be 'lru' or 'lfu'"):
        ExpertCache(2, "fifo")


def test_budgets_are_checked_before_anything_moves(tiny):
    model = tiny("mixtral")
    plan = plan_offload(model)
    with pytest.raises(ValueError, match=r"too small: the dense weights take .* MiB and one MoE layer's 4 experts"):
        offload_experts(model, plan.minimum_budget - 1, device="cpu")
    with pytest.raises(ValueError, match="cannot read '20 parsecs' as a memory size"):
        offload_experts(model, "20 parsecs", device="cpu")
    assert any("experts.gate_up_proj" in name for name, _ in model.named_parameters())  # untouched
    with pytest.raises(ValueError, match="has no routed experts to offload"):
        offload_experts(torch.nn.Linear(2, 2), "1GiB", device="cpu")


def test_parse_size():
    assert parse_size("20GiB") == 20 * 2**30 and parse_size("1.5 GB") == 1_500_000_000
    assert parse_size(1024) == 1024 and parse_size({0: "2MiB", "cpu": "1GiB"}) == 2 * 2**20
    with pytest.raises(ValueError, match="no GPU entry"):
        parse_size({"cpu": "1GiB"})


def test_blob_layout_views_are_strided_slots():
    weights = {"a": torch.randn(3, 4, 5), "b": torch.randint(0, 255, (3, 7), dtype=torch.uint8), "c": None}
    layout = BlobLayout.of(weights)
    pool = torch.zeros(3, layout.nbytes, dtype=torch.uint8)
    for name, view in layout.views(pool).items():
        view.copy_(weights[name])
    views = layout.views(pool)
    assert torch.equal(views["a"], weights["a"]) and torch.equal(views["b"], weights["b"])
    assert views["a"].stride(0) * 4 == layout.nbytes and layout.nbytes % 64 == 0


def test_optimize_offloads_under_a_budget(tiny):
    ids = token_ids()
    expected = tiny("glm4_moe").generate(ids, max_new_tokens=8, do_sample=False)
    model = tiny("glm4_moe")
    budget = plan_offload(model).minimum_budget
    with pytest.raises(ValueError, match="is too small"):
        dflash_compile.optimize(model, gpu_memory=budget - 1, device="cpu")
    assert model.config._experts_implementation != "dflash_offload"  # nothing changed
    fast = dflash_compile.optimize(model, gpu_memory=budget, device="cpu")
    assert torch.equal(fast.generate(ids, max_new_tokens=8), expected)
    assert model.dflash_offload.stats.misses > 0


def test_from_pretrained_offloads_and_generates_the_same_tokens(tiny_dirs, tmp_path):
    directory = tiny_dirs("deepseek_v3")
    reference = dflash_compile.testing.load_tiny_model("deepseek_v3", directory=directory)
    ids = token_ids(batch=1)
    expected = reference.generate(ids, max_new_tokens=10, do_sample=False)
    config = tiny_drafter_config(reference.config, block_size=4)
    drafter = save_drafter(tmp_path / "d", config, random_drafter_weights(config))
    budget = plan_offload(reference).minimum_budget
    fast = dflash_compile.from_pretrained(directory, drafter, gpu_memory=budget, dtype=torch.float32, device="cpu")
    assert fast.model.dflash_offload.slots == plan_offload(reference).experts_per_layer
    assert torch.equal(fast.generate(ids, max_new_tokens=10), expected)


def test_generate_command_with_a_gpu_memory_budget(capsys):
    from dflash_compile.cli import main

    assert main(["generate", "--max-new-tokens", "16", "--repeats", "1", "--gpu-memory", "12MB"]) == 0
    assert "same tokens: True" in capsys.readouterr().out
