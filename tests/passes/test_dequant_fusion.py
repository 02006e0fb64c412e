"""Golden graphs of `dequant_fusion`: an FP8 linear layer before and after the pass."""

import torch
from expecttest import TestCase

import dflash_compile
from dflash_compile.checkpoint import FP8Linear
from dflash_compile.quant import quantize_fp8_block


def fp8_linear(out_features=200, in_features=160, bias=True):
    generator = torch.Generator().manual_seed(0)
    weight, scale = quantize_fp8_block(torch.randn(out_features, in_features, generator=generator))
    return FP8Linear(weight.view(torch.uint8), scale, torch.randn(out_features, generator=generator) if bias else None)


class WeightToo(torch.nn.Module):
    """Uses the dequantized weight outside the linear as well: nothing to fuse."""

    def __init__(self):
        super().__init__()
        self.linear = fp8_linear()

    def forward(self, x):
        weight = torch.ops.dflash.fp8_block_dequantize(self.linear.weight, self.linear.weight_scale_inv, 128, 128,
                                                       x.dtype)
        return torch.nn.functional.linear(x, weight), weight.sum()


class TestDequantFusionGolden(TestCase):
    def test_fp8_linear(self):
        layer = fp8_linear()
        x = torch.randn(3, 160)
        report = dflash_compile.explain(layer, x)
        self.assertEqual(report.matches, {"expert_dispatch": 0, "dequant_fusion": 1, "projection_fusion": 0,
                                          "small_top_k": 0, "split_k_linear": 0})
        self.assertExpectedInline(report.graphs[0].before, """\
%arg.x: f32[3, 160] = input
%arg.self.weight: u8[200, 160] = input
%arg.self.weight_scale_inv: f32[2, 2] = input
%arg.self.bias: f32[200] = input
%fp8_block_dequantize: f32[200, 160] = torch.ops.dflash.fp8_block_dequantize(%arg.self.weight, %arg.self.weight_scale_inv, 128, 128, torch.float32)
%linear: f32[3, 200] = torch._C._nn.linear(%arg.x, %fp8_block_dequantize, %arg.self.bias)
return (%linear,)
""")
        self.assertExpectedInline(report.graphs[0].after, """\
%arg.x: f32[3, 160] = input
%arg.self.weight: u8[200, 160] = input
%arg.self.weight_scale_inv: f32[2, 2] = input
%arg.self.bias: f32[200] = input
%fp8_block_linear_default: f32[3, 200] = torch.ops.dflash.fp8_block_linear.default(%arg.x, %arg.self.weight, %arg.self.weight_scale_inv, %arg.self.bias)
return (%fp8_block_linear_default,)
""")
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(layer, backend="dflash")(x), layer(x))

    def test_other_uses_of_the_weight_are_left_alone(self):
        report = dflash_compile.explain(WeightToo(), torch.randn(3, 160))
        self.assertEqual(report.matches["dequant_fusion"], 0)
        self.assertIn("fp8_block_dequantize", report.graphs[0].after)
