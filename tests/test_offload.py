"""Expert offload on the CPU ("device" and host both CPU memory): the cache logic, budgets, and token identity."""

from pathlib import Path

import pytest
import torch

import dflash_compile
import dflash_compile.testing
from dflash_compile.families import experts_modules, router_of, routing_of, spec_for_config
from dflash_compile.offload import (PREFETCH_TRIAL, BlobLayout, ExpertCache, MissCosts, choose_manager,
                                    offload_experts, parse_size, plan_offload, predict_experts)
from dflash_compile.testing import random_drafter_weights, save_drafter, tiny_config, tiny_drafter_config
from tests.conftest import FAMILIES, needs_interpreter, token_ids
from tests.test_speculative import IDENTITY_CASES

CPU_MANAGERS = ["host", pytest.param("device", marks=needs_interpreter)]  # "device" is CPU memory here


def _every_key(family) -> dict:
    """Load settings letting an indexed family's indexers pick every key (DSA's and Kolibri 1.1's `index_topk`,
    MiniMax-M3's blocks, DeepSeek-V4's compressed entries). Which of two keys whose scores tie (the ReLU's zeros) or
    swap by a rounding a top-k keeps differs between a verify block and one token's step, and with the threads,
    compiled graph or expert kernel's tiles: not placement's to decide (the identity tests in test_speculative.py
    check the indexers' choice, on prompts where it matters). DeepSeek-V4's picked 2 of its entries and parted from
    the reference on an H100 (session 76)."""
    config = tiny_config(family)
    return {name: 64 for name in ("index_topk_blocks", "index_topk") if hasattr(config, name)}


def _offloaded(tiny, family, policy="lru", extra_slots=0, every_key=False, **options):
    model = tiny(family, **(_every_key(family) if every_key else {}))
    plan = plan_offload(model)
    budget = plan.minimum_budget + extra_slots * plan.blob_bytes  # one layer of experts: every layer evicts
    return offload_experts(model, budget, device="cpu", policy=policy, **options)


def _drafter(config, tmp_path) -> Path:
    """A saved random DFlash drafter (block 4) for a target with `config`."""
    drafter_config = tiny_drafter_config(config, block_size=4)
    return save_drafter(tmp_path / "d", drafter_config, random_drafter_weights(drafter_config))


def test_the_auto_manager_is_the_device_on_cuda_where_the_options_allow_it(tiny):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose_manager(cuda, "lru", "off") == "device"
    assert choose_manager(cuda, "lfu", "off") == choose_manager(cuda, "lru", "auto") == "host"
    assert choose_manager(cpu, "lru", "off") == "host"
    assert _offloaded(tiny, "qwen3_moe").dflash_offload.manager == "host"  # the default, on a CPU


@pytest.mark.parametrize("manager", CPU_MANAGERS)
def test_stale_slots_names_a_slot_whose_bytes_are_not_its_experts_blob(tiny, manager):
    """The check the GPU tests and bench/offload.py run after generating: a slot whose copy was lost is named."""
    model = _offloaded(tiny, "qwen3_moe", extra_slots=4, manager=manager)
    model.generate(token_ids(batch=1), max_new_tokens=4, do_sample=False)
    offloaded = model.dflash_offload
    assert offloaded.stale_slots() == [] and len(offloaded.placements()) >= 4
    (layer, expert), slot = max(offloaded.placements().items())
    offloaded.pool[slot, 0] += 1
    assert offloaded.stale_slots() == [(layer, expert, slot)]


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
        # the routed experts' parameter (MiniMax-M3's shared expert has a linear `shared_experts.gate_up_proj`)
        assert not any(name.endswith("experts.gate_up_proj") for name, _ in model.named_parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_offload_with_compiled_dflash_speculative_decoding(tiny, family, tmp_path, compiled_steps):
    """Every family with a DFlash drafter at its full block (verify blocks fetch the union of their tokens'
    experts, and the next layer's route-ahead) gives the resident model's greedy tokens (a DSA family's indexers
    picking every key: `_every_key`; dots.llm3's verify blocks parted from its one-token steps at a near-tie on
    the 16-core GPU machine's CPU under 8 workers). Compiled where test_speculative.py's padded-batch identity test
    does not compile the family already (IDENTITY_CASES), eager where it does: every family's steps are compiled in
    one of the two. On a CPU they are lowered by AOT eager (`compiled_steps`): Dynamo captures each step whole and the
    passes rewrite it, every MoE call into the offloaded dispatch (kept out of CUDA graphs; the pass picks it for
    any family's offloaded experts, test_backend.py counts each family's dispatches), and Inductor compiles the
    attention and router each family shares with one of IDENTITY_CASES (COVERED_ELSEWHERE says which) in that
    family's test (with an empty compile cache Inductor's C++ compile doubled this test's time)."""
    ids = token_ids(batch=1)
    reference = tiny(family, **_every_key(family))
    expected = reference.generate(ids, max_new_tokens=12, do_sample=False)
    drafter = _drafter(reference.config, tmp_path)
    model = _offloaded(tiny, family, extra_slots=2, every_key=True)
    compiled_elsewhere = any(family == case for case, _ in IDENTITY_CASES)
    fast = dflash_compile.optimize(model, drafter=drafter, adaptive=False, compile=not compiled_elsewhere)
    assert torch.equal(fast.generate(ids, max_new_tokens=12), expected)
    assert model.dflash_offload.stats.misses > 0  # experts were copied in (the tiny routers of some families use
    # too few experts to evict)
    calls = len(spec_for_config(model.config).moe_layers(model.config))  # looped Inkling 2's: a call per pass
    dispatches = {report.after.count("torch.ops.dflash.moe_dispatch_offloaded.default(") for report in compiled_steps}
    assert dispatches == (set() if compiled_elsewhere else {calls})
    assert not any("torch.ops.dflash.moe_dispatch.default(" in report.after for report in compiled_steps)


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
    assert events.count("prefetch") == stats.prefetched
    assert stats.per_layer_calls == 2 and stats.routing_wait_s > 0  # one routing read per MoE layer call
    placement = dflash_compile.explain(model, token_ids()).expert_placement
    assert placement.startswith("2 layers offloaded to host memory (dense") and "8 slots on cpu" in placement
    assert placement.endswith("lru cache managed on the host, prefetch 1 layer(s) ahead, CPU compute of misses off")


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
    with pytest.raises(ValueError, match=r"too small: the dense weights take .* MiB, one MoE layer's 4 experts"):
        offload_experts(model, plan.minimum_budget - 1, device="cpu")
    with pytest.raises(ValueError, match="cannot read '20 parsecs' as a memory size"):
        offload_experts(model, "20 parsecs", device="cpu")
    assert any("experts.gate_up_proj" in name for name, _ in model.named_parameters())  # untouched
    with pytest.raises(ValueError, match="has no routed experts to offload"):
        offload_experts(torch.nn.Linear(2, 2), "1GiB", device="cpu")


def test_the_cuda_plan_reserves_the_runtimes_memory(tiny):
    plan, cuda_plan = plan_offload(tiny("mixtral")), plan_offload(tiny("mixtral"), "cuda")
    assert cuda_plan.minimum_budget - plan.minimum_budget == 64 * 2**20
    assert cuda_plan.slots(cuda_plan.minimum_budget) == plan.slots(plan.minimum_budget) == plan.experts_per_layer
    with pytest.raises(ValueError, match=r"and the runtime 64.00 MiB; give at least"):
        cuda_plan.slots(plan.minimum_budget)


def test_parse_size():
    assert parse_size("20GiB") == 20 * 2**30 and parse_size("1.5 GB") == 1_500_000_000
    assert parse_size(1024) == 1024 and parse_size({0: "2MiB", "cpu": "1GiB"}) == 2 * 2**20
    with pytest.raises(ValueError, match="no GPU entry"):
        parse_size({"cpu": "1GiB"})


def test_blob_layout_views_are_strided_slots():
    weights = {"a": torch.randn(3, 4, 5), "b": torch.randint(0, 255, (3, 7), dtype=torch.uint8), "c": None}
    layout = BlobLayout.of(weights)
    pool = layout.blobs(weights)
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
    drafter = _drafter(reference.config, tmp_path)
    budget = plan_offload(reference).minimum_budget
    fast = dflash_compile.from_pretrained(directory, drafter, gpu_memory=budget, dtype=torch.float32, device="cpu")
    assert fast.model.dflash_offload.slots == plan_offload(reference).experts_per_layer
    assert torch.equal(fast.generate(ids, max_new_tokens=10), expected)


@pytest.mark.parametrize("manager", CPU_MANAGERS)
def test_generate_command_with_a_gpu_memory_budget(capsys, manager):
    from dflash_compile.cli import main

    arguments = ["generate", "--max-new-tokens", "16", "--repeats", "1", "--gpu-memory", "12MB", "--device", "cpu",
                 "--offload-manager", manager, "--no-compile"]
    assert main(arguments) == 0
    out = capsys.readouterr().out
    assert "same tokens: True" in out and f"cache managed on the {manager}" in out
    arguments[arguments.index("12MB")] = "1MB"  # a budget too small: the check's message, no traceback
    with pytest.raises(SystemExit, match=r"^dflash-compile generate: .* is too small"):
        main(arguments)


def test_each_poor_prefetch_window_drops_only_the_farthest_layer(tiny):
    """The rule on its own: a window of PREFETCH_TRIAL prefetches with fewer than half used drops one layer of depth;
    a good window keeps the depth; each window is judged on its own counts."""
    offloaded = offload_experts(tiny("qwen3_moe"), plan_offload(tiny("qwen3_moe")).minimum_budget, device="cpu",
                                prefetch=3).dflash_offload
    stats = offloaded.stats
    for used, depth in [(10, 2), (60, 2), (31, 1), (40, 1), (0, 0)]:
        stats.prefetched += PREFETCH_TRIAL
        stats.prefetch_hits += used
        offloaded._judge_prefetch()
        assert offloaded.prefetch == depth, (used, depth)


@pytest.mark.parametrize("family, settings", [(family, {}) for family in FAMILIES]
                         + [("lfm2_moe", {"use_expert_bias": False})], ids=[*FAMILIES, "lfm2_moe-no_expert_bias"])
def test_predicted_experts_are_the_routers_own_choice_on_its_own_input(tiny, family, settings):
    """Prefetch applies a layer's router to another layer's input; on the router's own input the guess must be
    exactly its choice (DeepSeek's group-limited routing included), also after the model's buffers were replaced, as
    a move to the GPU replaces them, and a bias the MoE block keeps (MiniMax-M2's, Hunyuan 3's) changed, or does not
    keep (LFM2-MoE without `use_expert_bias`). DeepSeek-V4's first layers route by token id: nothing to predict
    from hidden states (`routing_of` gives them none), its first routing by them is predicted."""
    model = tiny(family, **settings)
    routings = {name: routing_of(model, name) for name in experts_modules(model)}
    by_token_id = [name for name, routing in routings.items() if routing is None]
    assert by_token_id == (["model.layers.0.mlp.experts"] if family == "deepseek_v4" else [])
    name, router = next((name, routing) for name, routing in routings.items() if routing is not None)
    block = model.get_submodule(name.rpartition(".")[0])
    model._apply(torch.clone)
    for bias in block.buffers(recurse=False):
        bias.copy_(torch.randperm(bias.numel(), generator=torch.Generator().manual_seed(0)).view_as(bias))
    captured = []  # the router module's own input (Gemma 4's router reads the layer's residual, not the experts')
    router_of(model, name).register_forward_hook(lambda module, args, output: captured.append(args[0]))
    experts = model.get_submodule(name)
    chosen = []
    experts.register_forward_hook(lambda module, args, output: chosen.append(args[1]))
    model(token_ids(batch=1))
    hidden = captured[0].reshape(-1, model.config.hidden_size)
    assert torch.equal(predict_experts(router, hidden), chosen[0].reshape(hidden.shape[0], -1))


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_prefetch_accounting_and_identity(tiny, family):
    """With room beyond one layer, each layer's call copies the next layer's predicted experts ahead: every
    needed expert is a hit (a prefetched one counted in coverage) or a miss, every prefetched expert is used or
    wasted or still waiting, and tokens do not change. prefetch=False copies nothing ahead."""
    ids = token_ids()
    expected = tiny(family).generate(ids, max_new_tokens=10, do_sample=False)
    model = _offloaded(tiny, family, extra_slots=plan_offload(tiny(family)).experts_per_layer)
    offloaded = model.dflash_offload
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), expected)
    stats = offloaded.stats
    assert stats.prefetched > 0 and stats.prefetch_hits > 0
    assert stats.prefetched == stats.prefetch_hits + stats.prefetch_wasted + len(offloaded.unused_prefetches)
    assert stats.prefetch_hits <= stats.hits and 0 < stats.coverage <= 1 and 0 <= stats.waste < 1
    if offloaded.stats.prefetched >= 64:  # a poor guess gives up after its trial
        assert offloaded.prefetch == (offloaded.stats.prefetch_hits >= 0.5 * offloaded.stats.prefetched)
    plain = offload_experts(tiny(family), offloaded.pool_bytes + plan_offload(tiny(family)).dense_bytes,
                            device="cpu", prefetch=False)
    assert torch.equal(plain.generate(ids, max_new_tokens=10, do_sample=False), expected)
    assert plain.dflash_offload.stats.prefetched == 0


def test_prefetch_two_layers_ahead(tmp_path):
    """prefetch=2: each layer's call also copies in the experts predicted for the layer after next (queued while
    the next layer still computes), with the same tokens and the same accounting. A negative depth is refused
    before the model changes."""
    from dflash_compile.testing import load_tiny_model, save_tiny_model

    directory = save_tiny_model("qwen3_moe", tmp_path, num_hidden_layers=4)
    ids = token_ids()
    expected = load_tiny_model("qwen3_moe", directory=directory).generate(ids, max_new_tokens=10, do_sample=False)
    model = load_tiny_model("qwen3_moe", directory=directory)
    plan = plan_offload(model)
    with pytest.raises(ValueError, match="prefetch is a number of layers ahead .0 turns it off., got -1"):
        offload_experts(model, plan.minimum_budget, device="cpu", prefetch=-1)
    assert not hasattr(model, "dflash_offload")
    model = offload_experts(model, plan.minimum_budget + 2 * plan.experts_per_layer * plan.blob_bytes, device="cpu",
                            prefetch=2)
    events = []  # (event, layer) in the order the cache decided them
    model.dflash_offload.add_hook(lambda event, layer, expert, slot: events.append((event, layer)))
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), expected)
    current, depths = None, set()  # a call's fetches and hits come before its prefetches
    for event, layer in events:
        if event == "prefetch":
            depths.add(layer - current)
        else:
            current = layer
    assert depths == {1, 2}
    stats = model.dflash_offload.stats
    assert stats.prefetched == stats.prefetch_hits + stats.prefetch_wasted + len(model.dflash_offload.unused_prefetches)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_5_moe", "deepseek_v3"])
def test_misses_computed_on_the_cpu_give_the_same_tokens(tiny, family):
    """cpu_compute="always": every expert not in a slot runs on the CPU on its host blob. First with an empty
    cache (all on the host), then with the cache warm from a fetching run (device and host experts mixed in one
    call)."""
    ids = token_ids()
    expected = tiny(family).generate(ids, max_new_tokens=10, do_sample=False)
    model = offload_experts(tiny(family), plan_offload(tiny(family)).minimum_budget, device="cpu",
                            cpu_compute="always")
    offloaded = model.dflash_offload
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), expected)
    assert offloaded.stats.computed_on_host > 0 and offloaded.stats.misses == 0
    offloaded.cpu_compute = "off"
    model.generate(ids[:, :4], max_new_tokens=2, do_sample=False)  # fills the slots with a layer's experts
    offloaded.cpu_compute, before = "always", offloaded.stats.hits
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), expected)
    assert offloaded.stats.hits > before  # cached experts ran on the device next to host ones


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_stops_when_its_guesses_are_not_used(tiny, monkeypatch, depth):
    """Guesses replaced by the router's choice for random inputs: right about as often as chance (2 of 8). Each
    poor trial drops the farthest layer ahead, down to none."""
    import dflash_compile.offload

    generator = torch.Generator().manual_seed(0)
    monkeypatch.setattr(dflash_compile.offload, "predict_experts", lambda router, hidden: predict_experts(
        router, torch.randn(hidden.shape, generator=generator)))
    model = offload_experts(tiny("qwen3_moe"), plan_offload(tiny("qwen3_moe")).minimum_budget, device="cpu",
                            prefetch=depth)
    model.generate(token_ids(), max_new_tokens=60 * depth, do_sample=False)  # a trial per depth
    stats = model.dflash_offload.stats
    assert stats.prefetched >= 64 and stats.prefetch_hits < 0.5 * stats.prefetched
    assert not model.dflash_offload.prefetch


@needs_interpreter
@pytest.mark.parametrize("family", FAMILIES)
def test_device_managed_cache_is_token_identical(tiny, family):
    """manager="device": the cache lives in device tensors, misses are read from the host blobs, predicted experts
    copied in ahead; one layer of experts plus two slots, so the predictions evict."""
    ids = token_ids()
    expected = tiny(family).generate(ids, max_new_tokens=10, do_sample=False)
    model = _offloaded(tiny, family, extra_slots=2, manager="device")
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), expected)
    stats = model.dflash_offload.stats
    assert stats.prefetched > 0 and stats.hits > 0 and stats.misses > 0
    assert stats.routing_wait_s == 0  # nothing read on the host


@needs_interpreter
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_device_managed_prompts_copy_their_experts_into_slots_first(tiny, family, monkeypatch):
    """A prompt's forward (20 pairs per routed expert, past STAGED_PAIRS) copies each layer's routed experts that
    have no slot into slots before its kernel runs (which would read them from host memory once per block of
    pairs); the decode steps keep reading their misses from host memory. The resident model's tokens."""
    from dflash_compile.offload import STAGED_PAIRS, OffloadedExperts

    ids = token_ids(batch=1, length=80)
    expected = tiny(family).generate(ids, max_new_tokens=4, do_sample=False)
    model = _offloaded(tiny, family, manager="device")
    calls = []  # (tokens, routed experts without a slot when the kernel ran)
    run = OffloadedExperts._run_device_managed

    def recorded(self, layer, hidden, top_k_index, top_k_weights, gate):
        out = run(self, layer, hidden, top_k_index, top_k_weights, gate)  # the call's slots are its own till the end
        calls.append((hidden.shape[0], int((self.slot_table.table(layer)[top_k_index.unique()] < 0).sum())))
        return out

    monkeypatch.setattr(OffloadedExperts, "_run_device_managed", recorded)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)
    assert 80 * 2 / 8 > STAGED_PAIRS
    prompt, steps = [missing for tokens, missing in calls if tokens == 80], [m for t, m in calls if t == 1]
    assert len(prompt) == len(model.dflash_offload.layers) and not any(prompt)
    assert any(steps)


@needs_interpreter
@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_device_managed_cache_choosing_victims_in_chunks_is_token_identical(tiny, family, monkeypatch):
    """A pool cut into chunks for the victim choice (as pools above 512 slots are; here chunks of 4-8 of its 10
    slots, one layer of experts and two): the resident model's tokens."""
    from dflash_compile.kernels import slot_table as slot_kernels

    monkeypatch.setattr(slot_kernels, "MIN_CHUNK", 4)
    ids = token_ids()
    expected = tiny(family).generate(ids, max_new_tokens=10, do_sample=False)
    model = _offloaded(tiny, family, extra_slots=2, manager="device")
    assert slot_kernels.victim_chunk(model.dflash_offload.slots, 1) < model.dflash_offload.slots
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), expected)
    stats = model.dflash_offload.stats
    assert stats.prefetched > 0 and stats.hits > 0


@pytest.mark.parametrize("manager", CPU_MANAGERS)
@pytest.mark.parametrize("prefetch", [1, 0])
def test_layers_nothing_predicts_are_pinned(tiny, prefetch, manager):
    """Two layers' worth of slots: the first layer (never predicted) keeps all its experts in slots from the start,
    so it never misses; without prefetch as many layers are pinned as leave a layer's worth of slots free."""
    ids = token_ids()
    expected = tiny("qwen3_moe").generate(ids, max_new_tokens=10, do_sample=False)
    model = tiny("qwen3_moe")
    plan = plan_offload(model)
    model = offload_experts(model, plan.minimum_budget + plan.experts_per_layer * plan.blob_bytes, device="cpu",
                            manager=manager, prefetch=prefetch)
    offloaded = model.dflash_offload
    assert offloaded.stats.bytes_fetched == plan.experts_per_layer * plan.blob_bytes  # layer 0, copied once
    events = []
    if manager == "host":
        offloaded.add_hook(lambda event, layer, expert, slot: events.append((event, layer)))
    assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), expected)
    assert "cache managed on the " + manager + ", layer(s) [0] pinned, prefetch" in dflash_compile.explain(
        model, ids).expert_placement
    if manager == "device":
        assert bool((offloaded.slot_table.table(0) >= 0).all())
    else:
        assert len(offloaded.cache.pinned) == plan.experts_per_layer
        assert {event for event, layer in events if layer == 0} == {"hit"}
    if not prefetch:  # layer 1 is fetched (host) or read from host memory (device) for every call that needs it
        assert offloaded.stats.misses > 0 and offloaded.stats.prefetched == 0


@needs_interpreter
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_device_managed_cache_stays_in_the_compiled_graph(tiny, family, tmp_path):
    """Compiled with a DFlash drafter: the offloaded layers are plain `moe_dispatch` nodes (capturable in CUDA
    graphs), and the tokens are the resident model's."""
    ids = token_ids(batch=1)
    expected = tiny(family).generate(ids, max_new_tokens=12, do_sample=False)
    drafter = _drafter(tiny(family).config, tmp_path)
    model = tiny(family)
    plan = plan_offload(model)
    fast = dflash_compile.optimize(model, drafter=drafter, adaptive=False, device="cpu", offload_manager="device",
                                   gpu_memory=plan.minimum_budget + 2 * plan.blob_bytes)
    after = dflash_compile.explain(model, ids).graphs[0].after
    assert after.count("torch.ops.dflash.moe_dispatch.default(") == len(model.dflash_offload.layers)
    assert "moe_dispatch_offloaded" not in after
    assert torch.equal(fast.generate(ids, max_new_tokens=12), expected)
    assert model.dflash_offload.stats.misses > 0


@needs_interpreter
def test_device_managed_cache_options_are_checked(tiny, monkeypatch):
    budget = plan_offload(tiny("olmoe")).minimum_budget
    for options, message in [(dict(manager="gpu"), "manager must be one of .'auto', 'host', 'device'., got 'gpu'"),
                             (dict(manager="device", policy="lfu"), "the device-managed cache is LRU .* policy 'lfu'"),
                             (dict(manager="device", cpu_compute="auto"), "cpu_compute 'auto' need manager='host'")]:
        model = tiny("olmoe")
        with pytest.raises(ValueError, match=message):
            offload_experts(model, budget, device="cpu", **options)
        assert not hasattr(model, "dflash_offload")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="on cpu only in Triton's interpreter: set TRITON_INTERPRET=1 before"):
        offload_experts(model, budget, device="cpu", manager="device")
    monkeypatch.undo()
    model = offload_experts(tiny("olmoe"), budget, device="cpu", manager="device")
    with pytest.raises(ValueError, match="hooks see the host-managed cache's decisions"):
        model.dflash_offload.add_hook(print)


def test_auto_cpu_compute_follows_the_measured_costs(tiny):
    costs = MissCosts(fetch_s=1.0, host_s=0.5, host_per_token_s=0.3)
    assert costs.host_cheaper(1) and costs.host_cheaper(2) and not costs.host_cheaper(3)
    model = offload_experts(tiny("olmoe"), plan_offload(tiny("olmoe")).minimum_budget, device="cpu",
                            cpu_compute="auto")
    offloaded = model.dflash_offload
    offloaded.miss_costs = costs
    hidden = torch.zeros(4, model.config.hidden_size)
    assert offloaded._host_side(0, [1, 1, 1, 2, 2, 3], hidden, None) == {2, 3}  # expert 1 has 3 tokens: copy it
    measured = MissCosts.measure(offloaded, 0, dflash_compile.expert_store.Gate(False, "silu"),
                                 model.config.hidden_size)
    assert measured.fetch_s > 0 and measured.host_s > 0 and measured.host_per_token_s >= 0
    with pytest.raises(ValueError, match="cpu_compute must be one of"):
        offload_experts(tiny("olmoe"), "1GiB", device="cpu", cpu_compute="sometimes")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_model(tmp_path, size=512, top_k=2):
    """gpt-oss with experts large next to its activations (3 MiB blobs at size 512): a budget breach would show."""
    from dflash_compile.testing import load_tiny_model, save_tiny_model

    directory = tmp_path / f"m{size}-top{top_k}"
    if not directory.exists():
        save_tiny_model("gpt_oss", directory, hidden_size=size, intermediate_size=size, num_local_experts=16,
                        num_experts_per_tok=top_k, num_hidden_layers=4, layer_types=["full_attention"] * 4)
    return load_tiny_model("gpt_oss", torch.bfloat16, directory=directory)


def _cuda_generate(load, ids, new, extra_slots=None, drafter=None, **options):
    """Compiled generation of a fresh `load()`ed model: offloaded with one layer of experts plus `extra_slots`
    slots, or, for None, resident with dflash's fused experts kernel. The offloaded experts run that same kernel on
    their slots, so the tokens must agree exactly (transformers' grouped_mm would round bf16 differently)."""
    model = load()
    if extra_slots is None:
        fast = dflash_compile.optimize(model.cuda(), drafter, fused_experts=True, **options)
    else:
        plan = plan_offload(model, "cuda")
        budget = plan.minimum_budget + extra_slots * plan.blob_bytes
        fast = dflash_compile.optimize(model, drafter, gpu_memory=budget, device="cuda", **options)
    return fast.generate(ids.cuda(), max_new_tokens=new).cpu(), fast.model


def _resident_and_offloaded(tiny, family, speculative, tmp_path, extra_slots, **options):
    """(offloaded tokens, reference tokens, offloaded model): 16 new tokens of bf16 `family` on the GPU, greedy or
    with a DFlash drafter at its full block (verify blocks use route-ahead). The reference is the same model offloaded
    with a slot for every expert, host-managed: only placement and eviction differ. (Against the resident model a
    tiny random model's bf16 near-ties can flip: Solar Open's resident tokens left model.generate's and the
    offloaded ones at a one-ulp tie, session 53.) A DSA family's indexers pick every key (`_every_key`)."""
    ids = token_ids(batch=1)
    drafter = _drafter(tiny(family).config, tmp_path) if speculative else None
    every_key = _every_key(family)
    load = lambda: tiny(family, torch.bfloat16, **every_key)  # noqa: E731
    plan = plan_offload(load(), "cuda")
    expected, _ = _cuda_generate(load, ids, 16, extra_slots=plan.experts_per_layer * plan.layers, drafter=drafter,
                                 adaptive=False, offload_manager="host")
    tokens, model = _cuda_generate(load, ids, 16, extra_slots=extra_slots, drafter=drafter, adaptive=False, **options)
    return tokens, expected, model


def _where_they_part(tokens, expected):
    """A token mismatch's message: the first position where the two part, and both from there on."""
    length = min(tokens.shape[-1], expected.shape[-1])
    parted = (tokens[..., :length] != expected[..., :length]).nonzero()
    position = int(parted[0, -1]) if len(parted) else length
    return f"part at position {position}: {tokens[..., position:].tolist()} vs {expected[..., position:].tolist()}"


@cuda
@pytest.mark.parametrize("manager", ["host", "device"])
def test_gpu_memory_never_exceeds_the_budget(tmp_path, manager):
    """Allocator statistics over offloading, the prefill and decoding: dense weights + slot pool + activations and
    KV cache stay under the budget (slack of half a blob between the pool and the budget). Peaks per phase, so a
    breach names where it happened."""
    ids = token_ids(batch=1).cuda()
    model = _cuda_model(tmp_path)
    plan = plan_offload(model, "cuda")  # with the runtime's reserve (cuBLAS workspace: 32 MiB of the first run's
    budget = plan.minimum_budget + int(2.5 * plan.blob_bytes)  # 65 MiB peak against a budget that had no reserve)
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    peaks = {}
    offload_experts(model, budget, device="cuda", manager=manager)
    peaks["offload_experts"] = torch.cuda.max_memory_allocated() - baseline
    model(ids)
    peaks["prefill forward"] = torch.cuda.max_memory_allocated() - baseline
    eager = model.generate(ids, max_new_tokens=16, do_sample=False)
    torch.cuda.synchronize()
    peaks["generate"] = torch.cuda.max_memory_allocated() - baseline
    assert all(peak <= budget for peak in peaks.values()), f"budget {budget} bytes, peaks {peaks}"
    stats = model.dflash_offload.stats
    if manager == "host":
        assert stats.misses > model.dflash_offload.slots  # slots reused
    else:  # copies into slots, and experts the budget kept out of them (read from pinned memory)
        assert stats.prefetched > 0 and stats.misses > 0
    # Eager and the same expert kernel, every expert fetched once and kept: placement and eviction change nothing.
    reference = offload_experts(_cuda_model(tmp_path), "100GiB", device="cuda", manager="host")
    reference = reference.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(eager, reference)


@cuda
@pytest.mark.parametrize("manager", ["host", "device"])
@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_offloaded_generation_on_the_gpu_is_token_identical(tiny, family, speculative, manager, tmp_path):
    """Real host -> device copies, every layer evicting (two slots above one layer of experts), every family greedy
    and with a DFlash drafter at its full block (verify blocks use route-ahead), either manager (the device one
    inside the CUDA graphs of the default mode: copy kernel on the side stream, misses read from pinned memory):
    the tokens of every expert kept in a slot."""
    tokens, expected, model = _resident_and_offloaded(tiny, family, speculative, tmp_path, extra_slots=2,
                                                      offload_manager=manager)
    stats = model.dflash_offload.stats
    assert (stats.misses if manager == "host" else stats.prefetched) > 0  # copies happened
    assert torch.equal(tokens, expected), _where_they_part(tokens, expected)


@cuda
@pytest.mark.parametrize("family, speculative", [("qwen3_moe", False), ("gpt_oss", True)])
def test_device_managed_offload_with_a_pinned_layer_on_the_gpu_is_token_identical(tiny, family, speculative,
                                                                                  tmp_path):
    """Room to pin the first MoE layer (64 slots above one layer of experts): its experts stay in their slots."""
    tokens, expected, model = _resident_and_offloaded(tiny, family, speculative, tmp_path, extra_slots=64,
                                                      offload_manager="device")
    assert model.dflash_offload.pinned_layers == [0]
    assert torch.equal(tokens, expected)


@cuda
def test_device_managed_copies_land_when_plans_run_far_ahead_of_them(tmp_path, monkeypatch):
    """Prefetching two layers ahead while every copy kernel is held back (a sleep on the side stream before it), so
    each layer is planned twice before its first copies run. Afterwards every slot holds the blob of the expert its
    table names, and the tokens are the resident model's. (When both plans for a layer shared one copy list, the
    second rewrote it under the queued kernel: copies were lost, slots held stale experts; a 25%-resident Qwen3
    bench "ran" at 71 GB/s over a 55 GB/s link.)"""
    from dflash_compile.kernels import blob_copy

    copy = blob_copy.copy_blobs

    def held_back(*args, **kwargs):
        torch.cuda._sleep(2_000_000)  # cycles: ~1 ms
        copy(*args, **kwargs)

    monkeypatch.setattr(blob_copy, "copy_blobs", held_back)
    ids, load = token_ids(batch=1), lambda: _cuda_model(tmp_path)
    expected, _ = _cuda_generate(load, ids, 12)
    tokens, model = _cuda_generate(load, ids, 12, extra_slots=24, offload_manager="device", offload_prefetch=2)
    stale = model.dflash_offload.stale_slots()
    assert not stale, f"(layer, expert, slot)s whose slot holds another blob: {stale[:4]} ({len(stale)} in all)"
    assert model.dflash_offload.stats.prefetched > 0
    assert torch.equal(tokens, expected)


@cuda
@pytest.mark.parametrize("top_k", [2, 4])
def test_device_managed_prompts_stage_their_experts_on_the_gpu(tmp_path, monkeypatch, top_k):
    """A 160-token prompt (top-2 / top-4 of 16 experts: 20 / 40 pairs per routed expert, past STAGED_PAIRS) on real
    streams: each prompt layer's copy of its own experts (every SM's programs, on the side stream) lands before its
    kernel reads the slots, and the copies planned for the layers ahead do not overwrite them. The layer then reads
    the pool as its experts: at top-4 (past DEQUANTIZE_PAIRS["dense"] for the pool's 18 slots and the model's 16
    experts) torch's grouped GEMM runs them on either side, at top-2 the fused kernel. Slots hold the blobs their
    table names; the resident model's tokens."""
    from dflash_compile import offload

    staged = []
    stage = offload.OffloadedExperts._stage

    def recorded(self, layer, top_k_index):
        staged.append(layer)
        stage(self, layer, top_k_index)

    monkeypatch.setattr(offload.OffloadedExperts, "_stage", recorded)
    ids, load = token_ids(batch=1, length=160), lambda: _cuda_model(tmp_path, top_k=top_k)
    expected, _ = _cuda_generate(load, ids, 8)
    tokens, model = _cuda_generate(load, ids, 8, extra_slots=2, offload_manager="device")
    assert staged == list(range(len(model.dflash_offload.layers)))  # the prompt's layers, once each
    assert not model.dflash_offload.stale_slots()
    assert torch.equal(tokens, expected)


@cuda
@pytest.mark.parametrize("manager", ["host", "device"])
def test_expert_copies_overlap_compute(tmp_path, manager):
    """Profiler trace of an offloaded decode whose budget is one layer of experts (every layer misses): expert
    copies (pinned host -> device, on the side stream) run while kernels run on the compute stream, which only
    happens when a layer's prefetch is in flight during the previous layer's work. Blobs of 24 MiB (a 0.45 ms copy):
    with small ones the eager Python between two launches outlasts a copy, so the GPU has nothing to overlap."""
    model = _cuda_model(tmp_path, size=2048)
    offload_experts(model, plan_offload(model, "cuda").minimum_budget, device="cuda", manager=manager)
    ids = token_ids(batch=1).cuda()
    model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        model.generate(ids, max_new_tokens=8, do_sample=False)
        torch.cuda.synchronize()
    events = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copying = ("HtoD", "Pinned") if manager == "host" else ("copy_blobs",)  # the device manager copies by kernel
    copies = [e for e in events if all(word in e.name for word in copying)]
    kernels = [e for e in events if not any(word in e.name for word in ("Memcpy", "Memset", "copy_blobs"))]
    overlapping = [c for c in copies if any(k.time_range.start < c.time_range.end and
                                            c.time_range.start < k.time_range.end for k in kernels)]
    assert model.dflash_offload.stats.prefetched > 0 and copies, model.dflash_offload.stats
    assert overlapping, f"none of {len(copies)} expert copies overlapped a kernel"


@cuda
def test_offloaded_step_captures_cuda_graphs_around_the_offload_ops(tmp_path):
    """mode="reduce-overhead" with the host-managed cache: the verify step is captured except the offloaded
    dispatches (graph partitioning around the cudagraph_unsafe op), and tokens stay those of the resident model."""
    ids = token_ids(batch=1)
    load = lambda: _cuda_model(tmp_path)  # noqa: E731
    expected, _ = _cuda_generate(load, ids, 12, mode="reduce-overhead")
    tokens, _ = _cuda_generate(load, ids, 12, extra_slots=8, mode="reduce-overhead", offload_manager="host")
    assert torch.equal(tokens, expected)


_PEAK_SCRIPT = """
import sys, threading, time, torch
import dflash_compile
from dflash_compile.offload import plan_offload

def anonymous_mib():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon")) / 1024

peak = [0.0]
def watch():
    while True:
        peak[0] = max(peak[0], anonymous_mib())
        time.sleep(0.001)

device = sys.argv[3]
if device == "cuda":
    torch.zeros(1, device=device)  # the CUDA context's own host memory comes before the baseline
base = anonymous_mib()
threading.Thread(target=watch, daemon=True).start()
fast = dflash_compile.from_pretrained(sys.argv[1], gpu_memory=sys.argv[2], dtype=torch.bfloat16, device=device)
time.sleep(0.05)
layers = fast.model.dflash_offload.layers
print(peak[0] - base, anonymous_mib() - base, sum(layer.host.numel() for layer in layers) / 2**20,
      layers[0].host.numel() / 2**20, int(layers[0].host.is_pinned()))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the anonymous RSS from /proc")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_loading_an_offloaded_checkpoint_needs_about_the_experts_host_memory(tmp_path, device):
    """from_pretrained(gpu_memory=...): the checkpoint's tensors are memory-mapped, experts move into host blobs
    layer by layer and each layer's parameters are freed as it goes, so the anonymous host memory peaks at about the
    experts' size (plus a layer and the runtime's own), not twice it, and then holds about the experts. The slot
    pool is never touched here. On CUDA the blobs are pinned: anonymous memory registered with CUDA
    (`offload.pinned_zeros`)."""
    import subprocess
    import sys

    import transformers

    config = tiny_config("qwen3_moe", hidden_size=512, moe_intermediate_size=1024, num_experts=32,
                         num_hidden_layers=4)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "m")
    budget = "250MB" if device == "cuda" else "150MB"  # CUDA's runtime reserve on top; the pool stays below 2 layers
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "m"), budget, device],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    peak, held, experts, layer, pinned = map(float, result.stdout.split())
    assert pinned == (device == "cuda")
    assert experts > 250 and held <= experts + layer + 64, f"{held:.0f} MiB held for {experts:.0f} MiB of experts"
    assert peak <= experts + 1.5 * layer + 64, f"peak {peak:.0f} MiB for {experts:.0f} MiB of experts"
