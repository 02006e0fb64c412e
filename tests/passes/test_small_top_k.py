"""Golden graph of `small_top_k`: a router's topk over a few experts becomes `dflash::top_k`; a topk over a
vocabulary-sized row, of many values, or along another dimension, stays."""

import torch
from expecttest import TestCase

import dflash_compile


class Router(torch.nn.Module):
    """gpt-oss's routing (topk, then softmax over the chosen), DeepSeek's unsorted choice as a method call, and three
    topk calls the pass leaves alone: one over 2048 values, one of 40 values, one along the first dimension."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router = torch.nn.Linear(16, 8)

    def forward(self, x, vocabulary_logits):
        logits = self.router(x)
        top_value, top_index = torch.topk(logits, 2, dim=-1)
        unsorted_index = logits.sigmoid().topk(3, dim=-1, sorted=False)[1]
        vocabulary_top = torch.topk(vocabulary_logits, 4)[0]
        many_top = torch.topk(vocabulary_logits[:, :64], 40)[0]
        first_dimension_top = torch.topk(logits, 1, dim=0)[1]
        return (top_value.softmax(dim=-1), top_index, unsorted_index.sort(dim=-1)[0], vocabulary_top, many_top,
                first_dimension_top)


class TestSmallTopKGolden(TestCase):
    def test_router_top_k(self):
        router, inputs = Router().eval(), (torch.randn(3, 16), torch.randn(3, 2048))
        expected = router(*inputs)
        report = dflash_compile.explain(router, *inputs)
        self.assertEqual(report.matches["small_top_k"], 2)
        self.assertExpectedInline(report.graphs[0].after, """\
%router.weight: f32[8, 16] = input
%router.bias: f32[8] = input
%arg.x: f32[3, 16] = input
%arg.vocabulary_logits: f32[3, 2048] = input
%logits: f32[3, 8] = torch.ops.dflash.split_k_linear.default(%arg.x, %router.weight, %router.bias)
%top_k_default: (f32[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%logits, 2)
%top_value: f32[3, 2] = operator.getitem(%top_k_default, 0)
%top_index: i64[3, 2] = operator.getitem(%top_k_default, 1)
%sigmoid: f32[3, 8] = .sigmoid(%logits)
%top_k_default_1: (f32[3, 3], i64[3, 3]) = torch.ops.dflash.top_k.default(%sigmoid, 3)
%unsorted_index: i64[3, 3] = operator.getitem(%top_k_default_1, 1)
%topk_2: (f32[3, 4], i64[3, 4]) = torch.topk(%arg.vocabulary_logits, 4)
%vocabulary_top: f32[3, 4] = operator.getitem(%topk_2, 0)
%getitem_6: f32[3, 64] = operator.getitem(%arg.vocabulary_logits, (slice(None, None, None), slice(None, 64, None)))
%topk_3: (f32[3, 40], i64[3, 40]) = torch.topk(%getitem_6, 40)
%many_top: f32[3, 40] = operator.getitem(%topk_3, 0)
%topk_4: (f32[1, 8], i64[1, 8]) = torch.topk(%logits, 1, dim=0)
%first_dimension_top: i64[1, 8] = operator.getitem(%topk_4, 1)
%softmax: f32[3, 2] = .softmax(%top_value, dim=-1)
%sort: (i64[3, 3], i64[3, 3]) = .sort(%unsorted_index, dim=-1)
%getitem_11: i64[3, 3] = operator.getitem(%sort, 0)
return (%softmax, %top_index, %getitem_11, %vocabulary_top, %many_top, %first_dimension_top)
""")
        with torch.no_grad():
            for actual, reference in zip(torch.compile(router, backend="dflash")(*inputs), expected):
                assert torch.equal(actual, reference)
