"""Reference MXFP4 / FP8-block quantizers against transformers' own dequantizers and the formats' rules."""

import subprocess
import sys

import pytest
import torch
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
from transformers.integrations.mxfp4 import FP4_VALUES, _convert_moe_packed_tensors

from dflash_compile.packed import PackedWeight
from dflash_compile.quant import dequantize_fp8_block, dequantize_mxfp4, quantize_fp8_block, quantize_mxfp4


def random_mxfp4(shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(110, 140, shape, generator=generator, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantize_matches_transformers():
    blocks, scales = random_mxfp4((3, 10, 90))  # E=3 experts, 10 rows, K = 90 * 32 = 2880
    expected = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales), expected)
    assert torch.tensor(FP4_VALUES)[8:].neg().tolist() == list(FP4_VALUES[:8])  # codes 8-15 are 0-7 negated


def test_mxfp4_rules():
    blocks = torch.tensor([[[0x21] + [0x00] * 15]], dtype=torch.uint8)  # element 0 = code 1, element 1 = code 2
    values = dequantize_mxfp4(blocks, torch.tensor([[128]], dtype=torch.uint8))
    assert values[0, :2].tolist() == [1.0, 2.0]  # 2^(128-127) * (0.5, 1.0): low nibble is the even element
    assert dequantize_mxfp4(blocks, torch.tensor([[0xFF]], dtype=torch.uint8)).isnan().all()
    with pytest.raises(ValueError, match=r"MXFP4 blocks \[1, 1, 16\] and scales \[2\] do not match"):
        dequantize_mxfp4(blocks, torch.zeros(2, dtype=torch.uint8))


def test_mxfp4_round_trip():
    x = torch.randn(6, 2880, generator=torch.Generator().manual_seed(1)) * 3
    blocks, scales = quantize_mxfp4(x)
    assert blocks.shape == (6, 90, 16) and scales.shape == (6, 90)
    y = dequantize_mxfp4(blocks, scales)
    # the OCP scale puts each group's largest magnitude in [4, 8) * scale: values up to 6 are off by at most half
    # the widest E2M1 gap (1), values in (6, 8) saturate to 6 (off by < 2); re-quantizing the output is exact
    group_scale = torch.ldexp(torch.ones(6, 90), scales.int() - 127).repeat_interleave(32, dim=1)
    error = (x - y).abs() / group_scale
    assert (error <= 1.0 + 1e-6).logical_or(x.abs() / group_scale > 6).all() and error.max() < 2
    assert all(torch.equal(a, b) for a, b in zip(quantize_mxfp4(y), (blocks, scales)))
    transposed_view = x.T.contiguous().T  # as gpt-oss's [E, in, out] experts are read output-major
    assert all(torch.equal(a, b) for a, b in zip(quantize_mxfp4(transposed_view), (blocks, scales)))
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.0] * 4])  # halfway points, amax 5 -> scale 1
    assert dequantize_mxfp4(*quantize_mxfp4(ties))[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="divisible by 32, got 30"):
        quantize_mxfp4(torch.zeros(2, 30))
    for bad in (torch.nan, torch.inf):
        with pytest.raises(ValueError, match="holds NaN or infinite values, which MXFP4 cannot represent"):
            quantize_mxfp4(x.index_put((torch.tensor([3]), torch.tensor([100])), torch.tensor(bad)))


def test_fp8_block_dequantize_matches_transformers_on_full_blocks():
    weight = (torch.randn(256, 384) * 100).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3) + 0.5
    expected = _dequantize_fp8_weight(weight, scale_inv, [128, 128], torch.float32)
    torch.testing.assert_close(dequantize_fp8_block(weight, scale_inv), expected)


def test_fp8_block_partial_blocks():
    """DeepSeek-V3's kv_a_proj_with_mqa is [576, 7168] with a [5, 56] grid: the last block row is partial."""
    weight = (torch.randn(200, 300) * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3) + 0.5
    out = dequantize_fp8_block(weight, scale_inv)
    for (r, c) in [(0, 0), (127, 127), (128, 128), (199, 299), (150, 260)]:
        assert out[r, c] == weight[r, c].float() * scale_inv[r // 128, c // 128]
    grid = r"FP8 weight \[200, 300\] with block \[128, 128\] needs a scale grid \[2, 3\]"
    with pytest.raises(ValueError, match=grid):
        dequantize_fp8_block(weight, torch.ones(1, 3))


def test_fp8_block_round_trip_saturates_and_bounds_error():
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(2))
    w[5, 7] = 1e6  # one huge value: its block's scale follows it, nothing overflows
    q, scale_inv = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 3)
    y = dequantize_fp8_block(q, scale_inv)
    assert torch.isfinite(y).all() and y[5, 7] == pytest.approx(1e6, rel=0.07)
    relative = (w - y).abs() / (scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260] * 448)
    assert relative.max() <= 2 ** -4  # e4m3: 3 mantissa bits, error <= half an ULP of the block's range
    for bad in (torch.nan, -torch.inf):
        with pytest.raises(ValueError, match="holds NaN or infinite values, which FP8 cannot represent"):
            quantize_fp8_block(w.index_put((torch.tensor([299]), torch.tensor([259])), torch.tensor(bad)))


def test_fp8_block_power_of_two_scales_are_e8m0_and_bound_the_error_as_exact_ones_do():
    """`scale_fmt` "ue8m0" (DeepSeek-V4's release): each block's scale the power of two at or above amax / 448, so it
    is one float8_e8m0fnu byte, and no value saturates (the block's amax lands at or below 448)."""
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(3)) * 7
    q, scale_inv = quantize_fp8_block(w, power_of_two=True)
    assert torch.equal(scale_inv.to(torch.float8_e8m0fnu).float(), scale_inv)
    exact = quantize_fp8_block(w)[1]
    assert (scale_inv >= exact).all() and (scale_inv < 2 * exact).all()
    y = dequantize_fp8_block(q, scale_inv)
    relative = (w - y).abs() / (scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260] * 448)
    assert relative.max() <= 2 ** -4


def test_dequantize_ops_match_the_reference_and_pass_opcheck():
    blocks, scales = random_mxfp4((4, 3))
    out = torch.ops.dflash.mxfp4_dequantize(blocks, scales, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, dequantize_mxfp4(blocks, scales, torch.bfloat16))
    torch.library.opcheck(torch.ops.dflash.mxfp4_dequantize.default, (blocks, scales, torch.float32))
    weight = (torch.randn(200, 300) * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3) + 0.5
    out = torch.ops.dflash.fp8_block_dequantize(weight, scale_inv, 128, 128, torch.float32)
    assert torch.equal(out, dequantize_fp8_block(weight, scale_inv))
    as_bytes = weight.view(torch.uint8)  # opcheck's schema test cannot do arithmetic on float8 tensors
    assert torch.equal(torch.ops.dflash.fp8_block_dequantize(as_bytes, scale_inv, 128, 128, torch.float32), out)
    torch.library.opcheck(torch.ops.dflash.fp8_block_dequantize.default, (as_bytes, scale_inv, 128, 128, torch.float32))


_PEAK_SCRIPT = """
import resource, sys, torch
from dflash_compile.packed import PackedWeight
weight = torch.randn(64, 512, 1024, dtype=torch.bfloat16)  # 64 experts: one expert's scratch is 1/64 of the layer's
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
PackedWeight.quantize(weight[:2, :64], sys.argv[1]).dequantize()  # the ops' first-call costs apart
before = peak()
packed = PackedWeight.quantize(weight, sys.argv[1])
quantized = peak()
packed.dequantize(torch.float32)
print(quantized - before, peak() - quantized)
"""


@pytest.mark.parametrize("format", ["mxfp4", "fp8_block"])
def test_packing_a_layer_takes_one_experts_scratch_not_the_layers(format):
    """PackedWeight.quantize / dequantize work an expert at a time: quantizing a layer raises a fresh process's peak
    resident memory by less than two fp32 copies of the layer (rounding it whole: ~8, 1032 MiB here for MXFP4; 16
    GiB for gpt-oss-20b's gate/up, 0.9 GiB an expert at a time), dequantizing it by its fp32 result and little more."""
    weight = torch.randn(4, 256, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    packed = PackedWeight.quantize(weight, format)
    whole = [quantize_mxfp4(weight)] if format == "mxfp4" else [quantize_fp8_block(w) for w in weight]
    assert torch.equal(packed.data, torch.cat([q.view(torch.uint8) for q, _ in whole]).view(packed.data.shape))
    expected = (dequantize_mxfp4(*whole[0]) if format == "mxfp4"
                else torch.stack([dequantize_fp8_block(q, s) for q, s in whole]))
    assert torch.equal(packed.dequantize(torch.float32), expected)
    run = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, format], capture_output=True, text=True, check=True)
    quantize_growth, dequantize_growth = map(int, run.stdout.split())
    layer_fp32 = 64 * 512 * 1024 * 4
    assert quantize_growth < 2 * layer_fp32, f"quantize grew the peak by {quantize_growth / 2**20:.0f} MiB"
    assert dequantize_growth < 1.5 * layer_fp32, f"dequantize grew the peak by {dequantize_growth / 2**20:.0f} MiB"
