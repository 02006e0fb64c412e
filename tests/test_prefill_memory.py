import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import dflash_compile
from dflash_compile import speculative
from dflash_compile.checkpoint import load_packed, quantize
from dflash_compile.offload import plan_offload
from dflash_compile.prefill_memory import PrefillActivations, RoutedExperts
from dflash_compile.testing import load_tiny_model, save_tiny_model
from tests.conftest import FAMILIES
from tests.test_speculative import NEW_TOKENS, reference


class PeakBytes(TorchDispatchMode):
    """The most bytes of storages made by ops under it that were alive at once (the activations of what runs)."""

    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in self.live and storage.nbytes():
                    self.live[storage.data_ptr()] = storage.nbytes()
                    self.current += storage.nbytes()
                    weakref.finalize(storage, self._free, storage.data_ptr())
        self.peak = max(self.peak, self.current)
        return out

    def _free(self, pointer):
        self.current -= self.live.pop(pointer, 0)


def measured_prefill(decoder, ids, mask, chunk) -> int:
    """Peak bytes of `decoder`'s prefill of `ids` (after a first one, so that lazily made state is not counted)."""
    pad = speculative._left_padding(ids, mask)
    max_len = speculative.cache_capacity(ids.shape[1] + NEW_TOKENS + decoder.block_size)
    with speculative.generation_context(decoder.model):
        for _ in range(2):
            cache = decoder._cache(ids.shape[0], max_len, decoder.model.dtype, ids.device, pad)
            with PeakBytes() as peak:
                decoder._prefill(ids, cache, bool(pad.any()), chunk)
    return peak.peak


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["one forward", "masked chunks, drafter"])
def test_the_estimate_bounds_the_prefills_measured_peak(tiny, random_drafter, family, case):
    """On each family's CPU prefill (transformers' experts, every attention path of `_prefill`), the estimate holds
    the activations at their peak, and is not far above them: a bound, not a guess off by an order."""
    model = tiny(family)
    ids = torch.randint(3, 127, (2, 100), generator=torch.Generator().manual_seed(0))
    mask, chunk, drafter = None, None, None
    if case != "one forward":
        mask, chunk, drafter = torch.ones_like(ids), 32, random_drafter(model)
        mask[1, :5] = 0
    decoder = dflash_compile.optimize(model, drafter, adaptive=False, compile=False).decoder
    peak = measured_prefill(decoder, ids, mask, chunk)
    estimate = PrefillActivations.of(model, len(decoder.layer_ids), drafter is not None)
    bound = estimate.bytes(2, chunk or 100, 100, masked=mask is not None)
    assert peak <= bound <= 2.5 * peak  # 1.02-2.07x (gpt-oss masked: two kinds of masks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
@pytest.mark.parametrize("rows", [1, 4])
def test_the_estimate_bounds_the_prefills_peak_on_cuda(tmp_path, experts, rows):
    """The CUDA allocator's peak over `_prefill` (the caches made before) against the estimate: gpt-oss with
    transformers' experts on bf16 weights, or packed MXFP4 experts, whose 4 experts (top-2) get 100 pairs each from
    one 200-token row (fused launches) and 400 from four (dequantized, with the experts' buffer)."""
    directory = save_tiny_model("gpt_oss", tmp_path / "bf16", hidden_size=512, intermediate_size=512)
    model = load_tiny_model("gpt_oss", torch.bfloat16, directory)
    if experts == "mxfp4":
        model = load_packed(quantize(model, tmp_path / "mxfp4", "mxfp4"), dtype=torch.bfloat16)
    model = model.cuda()
    decoder = dflash_compile.optimize(model, adaptive=False, compile=False).decoder
    ids = torch.randint(3, 127, (rows, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pad = torch.zeros(rows, dtype=torch.int64, device="cuda")
    max_len = speculative.cache_capacity(200 + NEW_TOKENS + 1)
    with speculative.generation_context(model):
        for _ in range(2):  # the second: lazily made state (rotary tables, workspaces) made by the first
            cache = decoder._cache(rows, max_len, model.dtype, ids.device, pad)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            decoder._prefill(ids, cache, False)
            torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    bound = PrefillActivations.of(model, 0, False).bytes(rows, 200, 200, masked=False)
    assert 0 < peak <= bound <= 2.5 * peak


def test_the_experts_path_follows_the_pairs_per_expert():
    """Packed experts: the fused launches' rows below DEQUANTIZE_PAIRS pairs per routed expert, above them the
    dequantizing path with its buffer of at most DEQUANTIZE_EXPERT_ELEMENTS values (gpt-oss-20b: 32 experts, top-4,
    MXFP4 from 384 pairs: 3072 tokens)."""
    experts = RoutedExperts("mxfp4", 32, 2880, 2880, 4, grouped_mm=False)
    assert experts.bytes(3071, 2) == (4 * (2880 * 2 + 2880 * 4) + 2 * 2880 * 2, 0)
    per_token, buffer = experts.bytes(3072, 2)
    assert per_token == 4 * 6 * 2880 * 2 + 2880 * 2 + 3 * 8 * 4 and buffer == 32 * 5760 * 2880 * 2


def budget(decoder, ids, chunk, masked=False, extra=0):
    """Free bytes (as `device_free_bytes` would report them) for the caches and a prefill in chunks of `chunk`."""
    max_len = speculative.cache_capacity(ids.shape[1] + NEW_TOKENS + decoder.block_size)
    activations = PrefillActivations.of(decoder.model, len(decoder.layer_ids), decoder.drafter is not None)
    prefill = activations.bytes(ids.shape[0], chunk, ids.shape[1], masked)
    return decoder._cache_bytes(ids.shape[0], max_len, decoder.model.dtype) + prefill + extra


@pytest.mark.parametrize("experts", ["resident", "offloaded"])
def test_a_prefill_that_would_not_fit_goes_in_chunks_that_do(tiny, monkeypatch, experts):
    """With room for the caches and a prefill in chunks of 64 tokens only, a 200-token prompt goes in chunks of 64
    (the whole prompt, then 128, would not fit): same tokens as `model.generate`. Offloaded experts (here to a
    "device" that is the CPU) are estimated from their host blobs."""
    model = tiny("qwen3_moe")
    ids = torch.randint(3, 127, (1, 200), generator=torch.Generator().manual_seed(1))
    expected = reference(model, ids, None)
    budget_options = dict(gpu_memory=plan_offload(model).minimum_budget, device="cpu") if experts == "offloaded" else {}
    fast = dflash_compile.optimize(model, adaptive=False, compile=False, **budget_options)
    monkeypatch.setattr(speculative, "device_free_bytes", lambda device: budget(fast.decoder, ids, 64))
    widths = []
    forward = fast.decoder._target_forward
    monkeypatch.setattr(fast.decoder, "_target_forward", lambda ids, *a, **k: widths.append(ids.shape[1]) or
                        forward(ids, *a, **k))
    out = fast.generate(ids, max_new_tokens=NEW_TOKENS)
    assert fast.last_stats.prefill_chunk == 64 and widths[:4] == [64, 64, 64, 8]
    assert torch.equal(out, expected)


def test_a_prompt_whose_prefill_cannot_fit_is_refused_before_anything_is_made(tiny, monkeypatch):
    model = tiny("qwen3_moe")
    ids = torch.randint(3, 127, (1, 200), generator=torch.Generator().manual_seed(1))
    fast = dflash_compile.optimize(model, adaptive=False, compile=False)
    monkeypatch.setattr(speculative, "device_free_bytes", lambda device: budget(fast.decoder, ids, 64, extra=-1))
    with pytest.raises(ValueError, match=r"^a prompt of 200 tokens in 1 row\(s\) needs about 0.00 GiB of activations "
                                         r"to prefill, in chunks of 64 tokens, but 0.00 GiB of cpu is free beside the "
                                         r"caches: shorten the prompt or run fewer rows at once$"):
        fast.generate(ids, max_new_tokens=NEW_TOKENS)
    assert fast.decoder.target_cache is None
