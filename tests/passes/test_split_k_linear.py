"""Golden graph of `split_k_linear`: linears of a few rows with more weight columns than rows (a router, o_proj)
become `dflash::split_k_linear`; a linear with K <= N (q/k/v, lm_head) or of more rows (a prefill) stays."""

import torch
from expecttest import TestCase

import dflash_compile


class Block(torch.nn.Module):
    """An attention output projection (32 -> 16) and a router (16 -> 4, biased), which the pass takes; an up
    projection (16 -> 64) and a square one (16 -> 16), which it leaves; the same router on 17 rows, which it
    leaves."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.o_proj = torch.nn.Linear(32, 16, bias=False)
        self.router = torch.nn.Linear(16, 4)
        self.up_proj = torch.nn.Linear(16, 64, bias=False)
        self.square = torch.nn.Linear(16, 16, bias=False)

    def forward(self, attention_out, prefill):
        hidden = self.o_proj(attention_out)
        logits = torch.nn.functional.linear(hidden, self.router.weight, bias=self.router.bias)
        return logits, self.up_proj(hidden), self.square(hidden), self.router(prefill)


class TestSplitKLinearGolden(TestCase):
    def test_decode_rows_with_k_above_n(self):
        block, inputs = Block().eval(), (torch.randn(2, 8, 32), torch.randn(17, 16))
        expected = block(*inputs)
        report = dflash_compile.explain(block, *inputs)
        self.assertEqual(report.matches["split_k_linear"], 2)
        self.assertExpectedInline(report.graphs[0].after, """\
%o_proj.weight: f32[16, 32] = input
%arg.attention_out: f32[2, 8, 32] = input
%router.weight: f32[4, 16] = input
%router.bias: f32[4] = input
%up_proj.weight: f32[64, 16] = input
%square.weight: f32[16, 16] = input
%arg.prefill: f32[17, 16] = input
%hidden: f32[2, 8, 16] = torch.ops.dflash.split_k_linear.default(%arg.attention_out, %o_proj.weight, None)
%logits: f32[2, 8, 4] = torch.ops.dflash.split_k_linear.default(%hidden, %router.weight, %router.bias)
%linear_2: f32[2, 8, 64] = torch._C._nn.linear(%hidden, %up_proj.weight, None)
%linear_3: f32[2, 8, 16] = torch._C._nn.linear(%hidden, %square.weight, None)
%linear_4: f32[17, 4] = torch._C._nn.linear(%arg.prefill, %router.weight, %router.bias)
return (%logits, %linear_2, %linear_3, %linear_4)
""")
        with torch.no_grad():
            for actual, reference in zip(torch.compile(block, backend="dflash")(*inputs), expected):
                assert torch.equal(actual, reference)
