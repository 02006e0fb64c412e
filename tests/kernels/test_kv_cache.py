"""The CUDA kernel of `dflash::kv_write` (kernels/kv_cache.py) against the op's tensor form on the CPU."""

import pytest
import torch

from dflash_compile.kernels.kv_cache import write_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("cache_dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEVICE == "cpu", reason="the interpreter rounds to bf16 "
                                                                                  "wrongly"))])
def test_kernel_writes_what_the_tensor_form_writes(cache_dtype):
    """Rows at different lengths, one wrapping around a ring of 8 slots; value head_dim unlike the keys'; keys as a
    transposed view (how attention produces them); on a GPU also fp32 written into bf16 caches."""
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(3, 2, 8, d, generator=generator).to(cache_dtype) for d in (16, 24)]
    key = torch.randn(3, 5, 2, 16, generator=generator).transpose(1, 2)  # [B, H, N, D], strided
    value = torch.randn(3, 2, 5, 24, generator=generator)
    lengths = torch.tensor([0, 2, 6])  # the last row wraps: slots 6, 7, 0, 1, 2
    expected = [cache.clone() for cache in caches]
    torch.ops.dflash.kv_write(*expected, key, value, lengths)  # the tensor form (CPU)
    on_device = [cache.clone().to(DEVICE) for cache in caches]
    write_kv(*on_device, key.to(DEVICE), value.to(DEVICE), lengths.to(DEVICE))
    for actual, wanted in zip(on_device, expected):
        assert torch.equal(actual.cpu(), wanted)
    assert not torch.equal(expected[0], caches[0])  # something was written
    keys_alone = caches[0].clone().to(DEVICE)  # a DSA indexer's keys: no value cache
    write_kv(keys_alone, None, key.to(DEVICE), None, lengths.to(DEVICE))
    assert torch.equal(keys_alone.cpu(), expected[0])


def test_values_of_no_width_write_only_the_keys():
    """GLM-5-Next's latent attention caches its rotary keys, of no width without rotary positions, as values: the
    kernel writes the keys and nothing else (an empty block would not compile)."""
    generator = torch.Generator().manual_seed(0)
    key_cache, value_cache = torch.zeros(2, 1, 8, 16, device=DEVICE), torch.zeros(2, 1, 8, 0, device=DEVICE)
    key = torch.randn(2, 1, 3, 16, generator=generator).to(DEVICE)
    write_kv(key_cache, value_cache, key, torch.zeros(2, 1, 3, 0, device=DEVICE), torch.tensor([0, 4], device=DEVICE))
    assert torch.equal(key_cache[0, :, :3], key[0]) and torch.equal(key_cache[1, :, 4:7], key[1])
