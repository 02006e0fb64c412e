"""Golden graphs of `projection_fusion`: linear layers on one input whose weights `lay_out_together` put in one
buffer become one linear and a split; layers not laid out so stay as they are."""

import torch
from expecttest import TestCase

import dflash_compile
from dflash_compile.projections import lay_out_together


class Projections(torch.nn.Module):
    """q/k/v projections of one input (and an o_proj on q's output, which reads another input)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(16, n) for n in (32, 8, 8))
        self.o_proj = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.o_proj(self.q_proj(x)), self.k_proj(x) * self.v_proj(x)


class BrokenProjections(Projections):
    """Projections whose forward breaks Dynamo's graph: each instance's call runs the graphs of one frame."""

    def forward(self, x):
        torch._dynamo.graph_break()
        return super().forward(x)


class TestProjectionFusionGolden(TestCase):
    def test_q_k_v_in_one_buffer(self):
        layer, x = Projections().eval(), torch.randn(3, 16)
        expected = layer(x)
        assert lay_out_together([layer.q_proj, layer.k_proj, layer.v_proj])
        report = dflash_compile.explain(layer, x)
        self.assertEqual(report.matches["projection_fusion"], 1)
        self.assertExpectedInline(report.graphs[0].after, """\
%q_proj.weight: f32[32, 16] = input
%q_proj.bias: f32[32] = input
%arg.x: f32[3, 16] = input
%o_proj.weight: f32[16, 32] = input
%o_proj.bias: f32[16] = input
%k_proj.weight: f32[8, 16] = input
%k_proj.bias: f32[8] = input
%v_proj.weight: f32[8, 16] = input
%v_proj.bias: f32[8] = input
%as_strided: f32[48, 16] = torch.as_strided(%q_proj.weight, (48, 16), (16, 1), 0)
%as_strided_1: f32[48] = torch.as_strided(%q_proj.bias, (48,), (1,), 0)
%linear_4: f32[3, 48] = torch._C._nn.linear(%arg.x, %as_strided, %as_strided_1)
%split = torch.functional.split(%linear_4, [32, 8, 8], dim=-1)
%getitem: f32[3, 32] = operator.getitem(%split, 0)
%getitem_1: f32[3, 8] = operator.getitem(%split, 1)
%getitem_2: f32[3, 8] = operator.getitem(%split, 2)
%linear_1: f32[3, 16] = torch.ops.dflash.split_k_linear.default(%getitem, %o_proj.weight, %o_proj.bias)
%mul: f32[3, 8] = operator.mul(%getitem_1, %getitem_2)
return (%linear_1, %mul)
""")
        with torch.no_grad():
            for actual, reference in zip(torch.compile(layer, backend="dflash")(x), expected):
                torch.testing.assert_close(actual, reference, rtol=1e-6, atol=1e-6)

    def test_layers_in_their_own_buffers_stay(self):
        report = dflash_compile.explain(Projections().eval(), torch.randn(3, 16))
        self.assertEqual(report.matches["projection_fusion"], 0)
        after = report.graphs[0].after  # one call per projection (k, v and o_proj, of K > N, as split_k_linear)
        self.assertEqual(after.count("torch._C._nn.linear(") + after.count("dflash.split_k_linear.default("), 4)
        self.assertNotIn("as_strided", after)

    def test_only_plain_linears_with_biases_on_all_or_none_are_laid_out(self):
        layer = Projections()
        layer.k_proj.bias = None
        self.assertFalse(lay_out_together([layer.q_proj, layer.k_proj, layer.v_proj]))  # bias on some only
        self.assertTrue(lay_out_together([layer.q_proj, layer.v_proj]))
        self.assertFalse(lay_out_together([layer.q_proj, layer.v_proj]))  # already one buffer

    def test_a_frame_graph_run_for_several_modules_reads_each_ones_parameters(self):
        """A graph break inside a module's forward makes Dynamo compile its frame once and run that graph for every
        module of the class, each call with its own parameters: the fused linear reads the calling module's (a
        buffer taken at compile time gave every layer the first one's)."""
        layers = torch.nn.Sequential(BrokenProjections(), BrokenProjections()).eval()
        with torch.no_grad():
            layers[1].q_proj.weight.mul_(2.0)
        for layer in layers:
            assert lay_out_together([layer.q_proj, layer.k_proj, layer.v_proj])
        x = torch.randn(3, 16)
        with torch.no_grad():
            expected = [layer(x) for layer in layers]
            compiled = [torch.compile(layer, backend="dflash")(x) for layer in layers]
        for actual, reference in zip(compiled, expected):
            for a, r in zip(actual, reference):
                torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)
