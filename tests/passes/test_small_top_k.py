"""Golden graph of `small_top_k`: a router's topk over a few experts becomes `dflash::top_k`; a topk over a
vocabulary-sized row, of many values, or along another dimension, stays."""

import torch
from expecttest import TestCase

import dflash_compile


class Router(torch.nn.Module):
    """gpt-oss's routing (topk, then softmax over the chosen), DeepSeek's unsorted choice as a method call,
    Qwen3-MoE's, Mixtral's and OLMoE's (softmax in fp32, then topk; the chosen probabilities renormalized by their
    sum and cast to the logits' dtype, renormalized only, cast only: all of it folds into the node, Mixtral's fp32
    cast of the logits too), a softmax with another use (it stays), values used before their renormalization (it
    stays), and three topk calls the pass leaves alone: one over 2048 values, one of 40 values, one along the first
    dimension."""

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
        qwen3_value, qwen3_index = torch.topk(torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1), 2, dim=-1)
        qwen3_value /= qwen3_value.sum(dim=-1, keepdim=True)
        qwen3_value = qwen3_value.to(torch.bfloat16)
        mixtral_value, mixtral_index = torch.topk(torch.nn.functional.softmax(logits.float(), dim=-1), 2, dim=-1)
        mixtral_value /= mixtral_value.sum(dim=-1, keepdim=True)
        olmoe_value = torch.topk(torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1), 3, dim=-1)[0]
        shared_probabilities = logits.softmax(-1)
        shared_top = shared_probabilities.topk(2)[0]
        early_value = torch.topk(logits, 2)[0]
        late_value = early_value / early_value.sum(dim=-1, keepdim=True)
        return (top_value.softmax(dim=-1), top_index, unsorted_index.sort(dim=-1)[0], vocabulary_top, many_top,
                first_dimension_top, qwen3_value, qwen3_index, mixtral_value, mixtral_index,
                olmoe_value.to(torch.bfloat16), shared_probabilities, shared_top, early_value, late_value)


class TestSmallTopKGolden(TestCase):
    def test_router_top_k(self):
        router, inputs = Router().eval(), (torch.randn(3, 16), torch.randn(3, 2048))
        expected = router(*inputs)
        report = dflash_compile.explain(router, *inputs)
        self.assertEqual(report.matches["small_top_k"], 7)
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
%top_k_default_2: (bf16[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%logits, 2, torch.float32, renormalize=True, values_dtype=torch.bfloat16)
%qwen3_value: bf16[3, 2] = operator.getitem(%top_k_default_2, 0)
%qwen3_index: i64[3, 2] = operator.getitem(%top_k_default_2, 1)
%top_k_default_3: (f32[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%logits, 2, torch.float32, renormalize=True)
%mixtral_value: f32[3, 2] = operator.getitem(%top_k_default_3, 0)
%mixtral_index: i64[3, 2] = operator.getitem(%top_k_default_3, 1)
%top_k_default_4: (bf16[3, 3], i64[3, 3]) = torch.ops.dflash.top_k.default(%logits, 3, torch.float32, values_dtype=torch.bfloat16)
%olmoe_value: bf16[3, 3] = operator.getitem(%top_k_default_4, 0)
%shared_probabilities: f32[3, 8] = .softmax(%logits, -1)
%top_k_default_5: (f32[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%shared_probabilities, 2)
%shared_top: f32[3, 2] = operator.getitem(%top_k_default_5, 0)
%top_k_default_6: (f32[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%logits, 2)
%early_value: f32[3, 2] = operator.getitem(%top_k_default_6, 0)
%sum_3: f32[3, 1] = .sum(%early_value, dim=-1, keepdim=True)
%late_value: f32[3, 2] = operator.truediv(%early_value, %sum_3)
%softmax_4: f32[3, 2] = .softmax(%top_value, dim=-1)
%sort: (i64[3, 3], i64[3, 3]) = .sort(%unsorted_index, dim=-1)
%getitem_21: i64[3, 3] = operator.getitem(%sort, 0)
return (%softmax_4, %top_index, %getitem_21, %vocabulary_top, %many_top, %first_dimension_top, %qwen3_value, %qwen3_index, %mixtral_value, %mixtral_index, %olmoe_value, %shared_probabilities, %shared_top, %early_value, %late_value)
""")
        with torch.no_grad():
            # Inductor's softmax of the kept node is not eager's to the last bit; the chosen experts are eager's
            torch.testing.assert_close(torch.compile(router, backend="dflash")(*inputs), expected, rtol=1e-6, atol=0)
