"""Golden graphs of `expert_dispatch`: one MoE block of every family, before and after the pass.

The block is compiled on its own (hidden states [1, 3, 64] in fp32) so the graph shows just the router, the routed
experts region that the pass swaps for one `dflash.moe_dispatch`, and whatever the family adds (shared experts).
Refresh with `EXPECTTEST_ACCEPT=1 pytest tests/passes/test_expert_dispatch.py` and review the diff.
"""

import tempfile

import torch
from expecttest import TestCase

import dflash_compile
from dflash_compile.families import FAMILIES
from dflash_compile.testing import load_tiny_model, save_tiny_model


def moe_block_graphs(family: str):
    with tempfile.TemporaryDirectory() as tmp:
        model = load_tiny_model(family, directory=save_tiny_model(family, tmp))
    block = model.model.layers[FAMILIES[family].moe_layers(model.config)[0]].mlp
    hidden = torch.randn(1, 3, model.config.hidden_size)
    report = dflash_compile.explain(block, hidden)
    assert report.graph_break_count == 0 and len(report.graphs) == 1
    return report.graphs[0]


class TestExpertDispatchGolden(TestCase):
    def test_mixtral(self):
        graph = moe_block_graphs("mixtral")
        self.assertExpectedInline(graph.before, """\
%arg.hidden_states: f32[1, 3, 64] = input
%gate.weight: f32[4, 64] = input
%experts.gate_up_proj: f32[4, 96, 64] = input
%experts.down_proj: f32[4, 64, 48] = input
%hidden_states: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%hidden_states_1: f32[3, 64] = .reshape(%hidden_states, -1, 64)
%router_logits: f32[3, 4] = torch._C._nn.linear(%hidden_states_1, %gate.weight)
%float_1: f32[3, 4] = .float(%router_logits)
%router_probs: f32[3, 4] = torch.nn.functional.softmax(%float_1, dim=-1)
%topk: (f32[3, 2], i64[3, 2]) = torch.topk(%router_probs, 2, dim=-1)
%router_top_value: f32[3, 2] = operator.getitem(%topk, 0)
%router_indices: i64[3, 2] = operator.getitem(%topk, 1)
%sum_1: f32[3, 1] = .sum(%router_top_value, dim=-1, keepdim=True)
%router_top_value_1: f32[3, 2] = operator.itruediv(%router_top_value, %sum_1)
%sample_weights: f32[6] = .reshape(%router_top_value_1, -1)
%expert_ids: i64[6] = .reshape(%router_indices, -1)
%sort: (i64[6], i64[6]) = torch.sort(%expert_ids)
%expert_ids_g: i64[6] = operator.getitem(%sort, 0)
%perm: i64[6] = operator.getitem(%sort, 1)
%floordiv: i64[6] = operator.floordiv(%perm, 2)
%selected_hidden_states_g: f32[6, 64] = operator.getitem(%hidden_states, %floordiv)
%sample_weights_g: f32[6] = operator.getitem(%sample_weights, %perm)
%histc_input: f32[6] = .float(%expert_ids_g)
%tokens_per_expert: f32[4] = torch.histc(%histc_input, bins=4, min=0, max=3)
%offsets: i32[4] = torch.cumsum(%tokens_per_expert, dim=0, dtype=torch.int32)
%transpose: f32[4, 64, 96] = .transpose(%experts.gate_up_proj, -2, -1)
%to: f32[6, 64] = .to(%selected_hidden_states_g, torch.float32)
%out: f32[6, 96] = torch.ops.transformers.grouped_mm_fallback(%to, %transpose, offs=%offsets)
%chunk: (f32[6, 48], f32[6, 48]) = .chunk(%out, 2, dim=-1)
%gate: f32[6, 48] = operator.getitem(%chunk, 0)
%up: f32[6, 48] = operator.getitem(%chunk, 1)
%silu: f32[6, 48] = torch.nn.functional.silu(%gate)
%proj_out: f32[6, 48] = operator.mul(%silu, %up)
%transpose_1: f32[4, 48, 64] = .transpose(%experts.down_proj, -2, -1)
%to_1: f32[6, 48] = .to(%proj_out, torch.float32)
%out_1: f32[6, 64] = torch.ops.transformers.grouped_mm_fallback(%to_1, %transpose_1, offs=%offsets)
%unsqueeze: f32[6, 1] = .unsqueeze(%sample_weights_g, -1)
%weighted_out: f32[6, 64] = operator.mul(%out_1, %unsqueeze)
%inv_perm: i64[6] = torch.empty_like(%perm)
%arange: i64[6] = torch.arange(6, device=cpu)
%setitem = operator.setitem(%inv_perm, %perm, %arange)
%weighted_out_1: f32[6, 64] = operator.getitem(%weighted_out, %inv_perm)
%view_1: f32[3, 2, 64] = .view(%weighted_out_1, 3, 2, 64)
%final_hidden_states: f32[3, 64] = .sum(%view_1, dim=1)
%hidden_states_2: f32[3, 64] = .to(%final_hidden_states, torch.float32)
%hidden_states_3: f32[1, 3, 64] = .reshape(%hidden_states_2, 1, 3, 64)
return (%hidden_states_3,)
""")
        self.assertExpectedInline(graph.after, """\
%arg.hidden_states: f32[1, 3, 64] = input
%gate.weight: f32[4, 64] = input
%experts.gate_up_proj: f32[4, 96, 64] = input
%experts.down_proj: f32[4, 64, 48] = input
%hidden_states: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%hidden_states_1: f32[3, 64] = .reshape(%hidden_states, -1, 64)
%router_logits: f32[3, 4] = torch.ops.dflash.split_k_linear.default(%hidden_states_1, %gate.weight, None)
%top_k_default: (f32[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%router_logits, 2, torch.float32, renormalize=True)
%router_top_value: f32[3, 2] = operator.getitem(%top_k_default, 0)
%router_indices: i64[3, 2] = operator.getitem(%top_k_default, 1)
%moe_dispatch_default: f32[3, 64] = torch.ops.dflash.moe_dispatch.default(%hidden_states, %router_indices, %router_top_value, store, 0)
%hidden_states_3: f32[1, 3, 64] = .reshape(%moe_dispatch_default, 1, 3, 64)
return (%hidden_states_3,)
""")

    def test_qwen3_moe(self):
        graph = moe_block_graphs("qwen3_moe")
        self.assertExpectedInline(graph.before, """\
%arg.hidden_states: f32[1, 3, 64] = input
%gate.weight: f32[8, 64] = input
%experts.gate_up_proj: f32[8, 64, 64] = input
%experts.down_proj: f32[8, 64, 32] = input
%hidden_states_reshaped: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%hidden_states: f32[3, 64] = .reshape(%hidden_states_reshaped, -1, 64)
%router_logits: f32[3, 8] = torch._C._nn.linear(%hidden_states, %gate.weight)
%router_probs: f32[3, 8] = torch.nn.functional.softmax(%router_logits, dtype=torch.float32, dim=-1)
%topk: (f32[3, 2], i64[3, 2]) = torch.topk(%router_probs, 2, dim=-1)
%router_top_value: f32[3, 2] = operator.getitem(%topk, 0)
%router_indices: i64[3, 2] = operator.getitem(%topk, 1)
%sum_1: f32[3, 1] = .sum(%router_top_value, dim=-1, keepdim=True)
%router_top_value_1: f32[3, 2] = operator.itruediv(%router_top_value, %sum_1)
%router_top_value_2: f32[3, 2] = .to(%router_top_value_1, torch.float32)
%sample_weights: f32[6] = .reshape(%router_top_value_2, -1)
%expert_ids: i64[6] = .reshape(%router_indices, -1)
%sort: (i64[6], i64[6]) = torch.sort(%expert_ids)
%expert_ids_g: i64[6] = operator.getitem(%sort, 0)
%perm: i64[6] = operator.getitem(%sort, 1)
%floordiv: i64[6] = operator.floordiv(%perm, 2)
%selected_hidden_states_g: f32[6, 64] = operator.getitem(%hidden_states_reshaped, %floordiv)
%sample_weights_g: f32[6] = operator.getitem(%sample_weights, %perm)
%histc_input: f32[6] = .float(%expert_ids_g)
%tokens_per_expert: f32[8] = torch.histc(%histc_input, bins=8, min=0, max=7)
%offsets: i32[8] = torch.cumsum(%tokens_per_expert, dim=0, dtype=torch.int32)
%transpose: f32[8, 64, 64] = .transpose(%experts.gate_up_proj, -2, -1)
%to_1: f32[6, 64] = .to(%selected_hidden_states_g, torch.float32)
%out: f32[6, 64] = torch.ops.transformers.grouped_mm_fallback(%to_1, %transpose, offs=%offsets)
%chunk: (f32[6, 32], f32[6, 32]) = .chunk(%out, 2, dim=-1)
%gate: f32[6, 32] = operator.getitem(%chunk, 0)
%up: f32[6, 32] = operator.getitem(%chunk, 1)
%silu: f32[6, 32] = torch.nn.functional.silu(%gate)
%proj_out: f32[6, 32] = operator.mul(%silu, %up)
%transpose_1: f32[8, 32, 64] = .transpose(%experts.down_proj, -2, -1)
%to_2: f32[6, 32] = .to(%proj_out, torch.float32)
%out_1: f32[6, 64] = torch.ops.transformers.grouped_mm_fallback(%to_2, %transpose_1, offs=%offsets)
%unsqueeze: f32[6, 1] = .unsqueeze(%sample_weights_g, -1)
%weighted_out: f32[6, 64] = operator.mul(%out_1, %unsqueeze)
%inv_perm: i64[6] = torch.empty_like(%perm)
%arange: i64[6] = torch.arange(6, device=cpu)
%setitem = operator.setitem(%inv_perm, %perm, %arange)
%weighted_out_1: f32[6, 64] = operator.getitem(%weighted_out, %inv_perm)
%view_1: f32[3, 2, 64] = .view(%weighted_out_1, 3, 2, 64)
%final_hidden_states: f32[3, 64] = .sum(%view_1, dim=1)
%final_hidden_states_1: f32[3, 64] = .to(%final_hidden_states, torch.float32)
%reshape_3: f32[1, 3, 64] = .reshape(%final_hidden_states_1, 1, 3, 64)
return (%reshape_3,)
""")
        self.assertExpectedInline(graph.after, """\
%arg.hidden_states: f32[1, 3, 64] = input
%gate.weight: f32[8, 64] = input
%experts.gate_up_proj: f32[8, 64, 64] = input
%experts.down_proj: f32[8, 64, 32] = input
%hidden_states_reshaped: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%hidden_states: f32[3, 64] = .reshape(%hidden_states_reshaped, -1, 64)
%router_logits: f32[3, 8] = torch.ops.dflash.split_k_linear.default(%hidden_states, %gate.weight, None)
%top_k_default: (f32[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%router_logits, 2, torch.float32, renormalize=True, values_dtype=torch.float32)
%router_top_value: f32[3, 2] = operator.getitem(%top_k_default, 0)
%router_indices: i64[3, 2] = operator.getitem(%top_k_default, 1)
%moe_dispatch_default: f32[3, 64] = torch.ops.dflash.moe_dispatch.default(%hidden_states_reshaped, %router_indices, %router_top_value, store, 0)
%reshape_3: f32[1, 3, 64] = .reshape(%moe_dispatch_default, 1, 3, 64)
return (%reshape_3,)
""")

    def test_qwen3_5_moe(self):
        graph = moe_block_graphs("qwen3_5_moe")
        self.assertExpectedInline(graph.before, """\
%arg.hidden_states: f32[1, 3, 64] = input
%shared_expert.gate_proj.weight: f32[48, 64] = input
%shared_expert.up_proj.weight: f32[48, 64] = input
%shared_expert.down_proj.weight: f32[64, 48] = input
%gate.weight: f32[8, 64] = input
%experts.gate_up_proj: f32[8, 64, 64] = input
%experts.down_proj: f32[8, 64, 32] = input
%shared_expert_gate.weight: f32[1, 64] = input
%hidden_states_reshaped: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%linear: f32[3, 48] = torch._C._nn.linear(%hidden_states_reshaped, %shared_expert.gate_proj.weight, None)
%silu: f32[3, 48] = torch.nn.functional.silu(%linear)
%linear_1: f32[3, 48] = torch._C._nn.linear(%hidden_states_reshaped, %shared_expert.up_proj.weight, None)
%mul: f32[3, 48] = operator.mul(%silu, %linear_1)
%down_proj: f32[3, 64] = torch._C._nn.linear(%mul, %shared_expert.down_proj.weight, None)
%hidden_states: f32[3, 64] = .reshape(%hidden_states_reshaped, -1, 64)
%router_logits: f32[3, 8] = torch._C._nn.linear(%hidden_states, %gate.weight)
%router_probs: f32[3, 8] = torch.nn.functional.softmax(%router_logits, dtype=torch.float32, dim=-1)
%topk: (f32[3, 2], i64[3, 2]) = torch.topk(%router_probs, 2, dim=-1)
%router_top_value: f32[3, 2] = operator.getitem(%topk, 0)
%router_indices: i64[3, 2] = operator.getitem(%topk, 1)
%sum_1: f32[3, 1] = .sum(%router_top_value, dim=-1, keepdim=True)
%router_top_value_1: f32[3, 2] = operator.itruediv(%router_top_value, %sum_1)
%router_top_value_2: f32[3, 2] = .to(%router_top_value_1, torch.float32)
%sample_weights: f32[6] = .reshape(%router_top_value_2, -1)
%expert_ids: i64[6] = .reshape(%router_indices, -1)
%sort: (i64[6], i64[6]) = torch.sort(%expert_ids)
%expert_ids_g: i64[6] = operator.getitem(%sort, 0)
%perm: i64[6] = operator.getitem(%sort, 1)
%floordiv: i64[6] = operator.floordiv(%perm, 2)
%selected_hidden_states_g: f32[6, 64] = operator.getitem(%hidden_states_reshaped, %floordiv)
%sample_weights_g: f32[6] = operator.getitem(%sample_weights, %perm)
%histc_input: f32[6] = .float(%expert_ids_g)
%tokens_per_expert: f32[8] = torch.histc(%histc_input, bins=8, min=0, max=7)
%offsets: i32[8] = torch.cumsum(%tokens_per_expert, dim=0, dtype=torch.int32)
%transpose: f32[8, 64, 64] = .transpose(%experts.gate_up_proj, -2, -1)
%to_1: f32[6, 64] = .to(%selected_hidden_states_g, torch.float32)
%out: f32[6, 64] = torch.ops.transformers.grouped_mm_fallback(%to_1, %transpose, offs=%offsets)
%chunk: (f32[6, 32], f32[6, 32]) = .chunk(%out, 2, dim=-1)
%gate: f32[6, 32] = operator.getitem(%chunk, 0)
%up: f32[6, 32] = operator.getitem(%chunk, 1)
%silu_1: f32[6, 32] = torch.nn.functional.silu(%gate)
%proj_out: f32[6, 32] = operator.mul(%silu_1, %up)
%transpose_1: f32[8, 32, 64] = .transpose(%experts.down_proj, -2, -1)
%to_2: f32[6, 32] = .to(%proj_out, torch.float32)
%out_1: f32[6, 64] = torch.ops.transformers.grouped_mm_fallback(%to_2, %transpose_1, offs=%offsets)
%unsqueeze: f32[6, 1] = .unsqueeze(%sample_weights_g, -1)
%weighted_out: f32[6, 64] = operator.mul(%out_1, %unsqueeze)
%inv_perm: i64[6] = torch.empty_like(%perm)
%arange: i64[6] = torch.arange(6, device=cpu)
%setitem = operator.setitem(%inv_perm, %perm, %arange)
%weighted_out_1: f32[6, 64] = operator.getitem(%weighted_out, %inv_perm)
%view_1: f32[3, 2, 64] = .view(%weighted_out_1, 3, 2, 64)
%final_hidden_states: f32[3, 64] = .sum(%view_1, dim=1)
%expert_output: f32[3, 64] = .to(%final_hidden_states, torch.float32)
%linear_4: f32[3, 1] = torch._C._nn.linear(%hidden_states_reshaped, %shared_expert_gate.weight, None)
%sigmoid: f32[3, 1] = torch.nn.functional.sigmoid(%linear_4)
%shared_expert_output: f32[3, 64] = operator.mul(%sigmoid, %down_proj)
%expert_output_1: f32[3, 64] = operator.add(%expert_output, %shared_expert_output)
%expert_output_2: f32[1, 3, 64] = .reshape(%expert_output_1, 1, 3, 64)
return (%expert_output_2,)
""")
        self.assertExpectedInline(graph.after, """\
%arg.hidden_states: f32[1, 3, 64] = input
%shared_expert.gate_proj.weight: f32[48, 64] = input
%shared_expert.up_proj.weight: f32[48, 64] = input
%shared_expert.down_proj.weight: f32[64, 48] = input
%gate.weight: f32[8, 64] = input
%experts.gate_up_proj: f32[8, 64, 64] = input
%experts.down_proj: f32[8, 64, 32] = input
%shared_expert_gate.weight: f32[1, 64] = input
%hidden_states_reshaped: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%linear: f32[3, 48] = torch.ops.dflash.split_k_linear.default(%hidden_states_reshaped, %shared_expert.gate_proj.weight, None)
%silu: f32[3, 48] = torch.nn.functional.silu(%linear)
%linear_1: f32[3, 48] = torch.ops.dflash.split_k_linear.default(%hidden_states_reshaped, %shared_expert.up_proj.weight, None)
%mul: f32[3, 48] = operator.mul(%silu, %linear_1)
%down_proj: f32[3, 64] = torch._C._nn.linear(%mul, %shared_expert.down_proj.weight, None)
%hidden_states: f32[3, 64] = .reshape(%hidden_states_reshaped, -1, 64)
%router_logits: f32[3, 8] = torch.ops.dflash.split_k_linear.default(%hidden_states, %gate.weight, None)
%top_k_default: (f32[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%router_logits, 2, torch.float32, renormalize=True, values_dtype=torch.float32)
%router_top_value: f32[3, 2] = operator.getitem(%top_k_default, 0)
%router_indices: i64[3, 2] = operator.getitem(%top_k_default, 1)
%moe_dispatch_default: f32[3, 64] = torch.ops.dflash.moe_dispatch.default(%hidden_states_reshaped, %router_indices, %router_top_value, store, 0)
%linear_4: f32[3, 1] = torch.ops.dflash.split_k_linear.default(%hidden_states_reshaped, %shared_expert_gate.weight, None)
%sigmoid: f32[3, 1] = torch.nn.functional.sigmoid(%linear_4)
%shared_expert_output: f32[3, 64] = operator.mul(%sigmoid, %down_proj)
%expert_output_1: f32[3, 64] = operator.add(%moe_dispatch_default, %shared_expert_output)
%expert_output_2: f32[1, 3, 64] = .reshape(%expert_output_1, 1, 3, 64)
return (%expert_output_2,)
""")

    def test_gpt_oss(self):
        graph = moe_block_graphs("gpt_oss")
        self.assertExpectedInline(graph.before, """\
%arg.hidden_states: f32[1, 3, 64] = input
%router.weight: f32[4, 64] = input
%router.bias: f32[4] = input
%experts.gate_up_proj: f32[4, 64, 96] = input
%experts.gate_up_proj_bias: f32[4, 96] = input
%experts.down_proj: f32[4, 48, 64] = input
%experts.down_proj_bias: f32[4, 64] = input
%hidden_states: f32[3, 64] = .reshape(%arg.hidden_states, -1, 64)
%router_logits: f32[3, 4] = torch._C._nn.linear(%hidden_states, %router.weight, %router.bias)
%topk: (f32[3, 2], i64[3, 2]) = torch.topk(%router_logits, 2, dim=-1)
%router_top_value: f32[3, 2] = operator.getitem(%topk, 0)
%router_indices: i64[3, 2] = operator.getitem(%topk, 1)
%router_scores: f32[3, 2] = torch.nn.functional.softmax(%router_top_value, dim=1, dtype=torch.float32)
%sample_weights: f32[6] = .reshape(%router_scores, -1)
%expert_ids: i64[6] = .reshape(%router_indices, -1)
%sort: (i64[6], i64[6]) = torch.sort(%expert_ids)
%expert_ids_g: i64[6] = operator.getitem(%sort, 0)
%perm: i64[6] = operator.getitem(%sort, 1)
%floordiv: i64[6] = operator.floordiv(%perm, 2)
%selected_hidden_states_g: f32[6, 64] = operator.getitem(%hidden_states, %floordiv)
%sample_weights_g: f32[6] = operator.getitem(%sample_weights, %perm)
%histc_input: f32[6] = .float(%expert_ids_g)
%tokens_per_expert: f32[4] = torch.histc(%histc_input, bins=4, min=0, max=3)
%offsets: i32[4] = torch.cumsum(%tokens_per_expert, dim=0, dtype=torch.int32)
%selected_biases: f32[6, 96] = operator.getitem(%experts.gate_up_proj_bias, %expert_ids_g)
%to: f32[6, 64] = .to(%selected_hidden_states_g, torch.float32)
%out: f32[6, 96] = torch.ops.transformers.grouped_mm_fallback(%to, %experts.gate_up_proj, offs=%offsets)
%add_: f32[6, 96] = .add_(%out, %selected_biases)
%gate: f32[6, 48] = operator.getitem(%out, (Ellipsis, slice(None, None, 2)))
%up: f32[6, 48] = operator.getitem(%out, (Ellipsis, slice(1, None, 2)))
%gate_1: f32[6, 48] = .clamp(%gate, min=None, max=7.0)
%up_1: f32[6, 48] = .clamp(%up, min=-7.0, max=7.0)
%mul: f32[6, 48] = operator.mul(%gate_1, 1.702)
%sigmoid: f32[6, 48] = torch.sigmoid(%mul)
%glu: f32[6, 48] = operator.mul(%gate_1, %sigmoid)
%add: f32[6, 48] = operator.add(%up_1, 1)
%gated_output: f32[6, 48] = operator.mul(%add, %glu)
%selected_biases_1: f32[6, 64] = operator.getitem(%experts.down_proj_bias, %expert_ids_g)
%to_1: f32[6, 48] = .to(%gated_output, torch.float32)
%out_1: f32[6, 64] = torch.ops.transformers.grouped_mm_fallback(%to_1, %experts.down_proj, offs=%offsets)
%add__1: f32[6, 64] = .add_(%out_1, %selected_biases_1)
%unsqueeze: f32[6, 1] = .unsqueeze(%sample_weights_g, -1)
%weighted_out: f32[6, 64] = operator.mul(%out_1, %unsqueeze)
%inv_perm: i64[6] = torch.empty_like(%perm)
%arange: i64[6] = torch.arange(6, device=cpu)
%setitem = operator.setitem(%inv_perm, %perm, %arange)
%weighted_out_1: f32[6, 64] = operator.getitem(%weighted_out, %inv_perm)
%view: f32[3, 2, 64] = .view(%weighted_out_1, 3, 2, 64)
%final_hidden_states: f32[3, 64] = .sum(%view, dim=1)
%hidden_states_1: f32[3, 64] = .to(%final_hidden_states, torch.float32)
%hidden_states_2: f32[1, 3, 64] = .reshape(%hidden_states_1, 1, 3, 64)
return (%hidden_states_2, %router_scores)
""")
        self.assertExpectedInline(graph.after, """\
%arg.hidden_states: f32[1, 3, 64] = input
%router.weight: f32[4, 64] = input
%router.bias: f32[4] = input
%experts.gate_up_proj: f32[4, 64, 96] = input
%experts.gate_up_proj_bias: f32[4, 96] = input
%experts.down_proj: f32[4, 48, 64] = input
%experts.down_proj_bias: f32[4, 64] = input
%hidden_states: f32[3, 64] = .reshape(%arg.hidden_states, -1, 64)
%router_logits: f32[3, 4] = torch.ops.dflash.split_k_linear.default(%hidden_states, %router.weight, %router.bias)
%top_k_default: (f32[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%router_logits, 2)
%router_top_value: f32[3, 2] = operator.getitem(%top_k_default, 0)
%router_indices: i64[3, 2] = operator.getitem(%top_k_default, 1)
%router_scores: f32[3, 2] = torch.nn.functional.softmax(%router_top_value, dim=1, dtype=torch.float32)
%moe_dispatch_default: f32[3, 64] = torch.ops.dflash.moe_dispatch.default(%hidden_states, %router_indices, %router_scores, store, 0)
%hidden_states_2: f32[1, 3, 64] = .reshape(%moe_dispatch_default, 1, 3, 64)
return (%hidden_states_2, %router_scores)
""")

    def test_glm4_moe(self):
        graph = moe_block_graphs("glm4_moe")
        self.assertExpectedInline(graph.before, """\
%arg.hidden_states: f32[1, 3, 64] = input
%gate.weight: f32[8, 64] = input
%gate.e_score_correction_bias: f32[8] = input
%experts.gate_up_proj: f32[8, 64, 64] = input
%experts.down_proj: f32[8, 64, 32] = input
%shared_experts.gate_proj.weight: f32[32, 64] = input
%shared_experts.up_proj.weight: f32[32, 64] = input
%shared_experts.down_proj.weight: f32[64, 32] = input
%hidden_states: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%type_1: f32[3, 64] = .type(%hidden_states, torch.float32)
%type_2: f32[8, 64] = .type(%gate.weight, torch.float32)
%router_logits: f32[3, 8] = torch._C._nn.linear(%type_1, %type_2)
%scores: f32[3, 8] = .sigmoid(%router_logits)
%scores_for_choice: f32[3, 8] = operator.add(%scores, %gate.e_score_correction_bias)
%view_1: f32[3, 2, 4] = .view(%scores_for_choice, -1, 2, 4)
%topk: (f32[3, 2, 2], i64[3, 2, 2]) = .topk(%view_1, 2, dim=-1)
%getitem: f32[3, 2, 2] = operator.getitem(%topk, 0)
%group_scores: f32[3, 2] = .sum(%getitem, dim=-1)
%topk_1: (f32[3, 1], i64[3, 1]) = torch.topk(%group_scores, k=1, dim=-1, sorted=False)
%group_idx: i64[3, 1] = operator.getitem(%topk_1, 1)
%group_mask: f32[3, 2] = torch.zeros_like(%group_scores)
%scatter_: f32[3, 2] = .scatter_(%group_mask, 1, %group_idx, 1)
%unsqueeze: f32[3, 2, 1] = .unsqueeze(%group_mask, -1)
%expand: f32[3, 2, 4] = .expand(%unsqueeze, -1, 2, 4)
%score_mask: f32[3, 8] = .reshape(%expand, -1, 8)
%bool_1: b8[3, 8] = .bool(%score_mask)
%invert: b8[3, 8] = operator.invert(%bool_1)
%scores_for_choice_1: f32[3, 8] = .masked_fill(%scores_for_choice, %invert, -inf)
%topk_2: (f32[3, 2], i64[3, 2]) = torch.topk(%scores_for_choice_1, k=2, dim=-1, sorted=False)
%topk_indices: i64[3, 2] = operator.getitem(%topk_2, 1)
%topk_weights: f32[3, 2] = .gather(%scores, 1, %topk_indices)
%sum_2: f32[3, 1] = .sum(%topk_weights, dim=-1, keepdim=True)
%denominator: f32[3, 1] = operator.add(%sum_2, 1e-20)
%topk_weights_1: f32[3, 2] = operator.itruediv(%topk_weights, %denominator)
%topk_weights_2: f32[3, 2] = operator.mul(%topk_weights_1, 2.5)
%hidden_states_1: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%sample_weights: f32[6] = .reshape(%topk_weights_2, -1)
%expert_ids: i64[6] = .reshape(%topk_indices, -1)
%sort: (i64[6], i64[6]) = torch.sort(%expert_ids)
%expert_ids_g: i64[6] = operator.getitem(%sort, 0)
%perm: i64[6] = operator.getitem(%sort, 1)
%floordiv: i64[6] = operator.floordiv(%perm, 2)
%selected_hidden_states_g: f32[6, 64] = operator.getitem(%hidden_states_1, %floordiv)
%sample_weights_g: f32[6] = operator.getitem(%sample_weights, %perm)
%histc_input: f32[6] = .float(%expert_ids_g)
%tokens_per_expert: f32[8] = torch.histc(%histc_input, bins=8, min=0, max=7)
%offsets: i32[8] = torch.cumsum(%tokens_per_expert, dim=0, dtype=torch.int32)
%transpose: f32[8, 64, 64] = .transpose(%experts.gate_up_proj, -2, -1)
%to: f32[6, 64] = .to(%selected_hidden_states_g, torch.float32)
%out: f32[6, 64] = torch.ops.transformers.grouped_mm_fallback(%to, %transpose, offs=%offsets)
%chunk: (f32[6, 32], f32[6, 32]) = .chunk(%out, 2, dim=-1)
%gate: f32[6, 32] = operator.getitem(%chunk, 0)
%up: f32[6, 32] = operator.getitem(%chunk, 1)
%silu: f32[6, 32] = torch.nn.functional.silu(%gate)
%proj_out: f32[6, 32] = operator.mul(%silu, %up)
%transpose_1: f32[8, 32, 64] = .transpose(%experts.down_proj, -2, -1)
%to_1: f32[6, 32] = .to(%proj_out, torch.float32)
%out_1: f32[6, 64] = torch.ops.transformers.grouped_mm_fallback(%to_1, %transpose_1, offs=%offsets)
%unsqueeze_1: f32[6, 1] = .unsqueeze(%sample_weights_g, -1)
%weighted_out: f32[6, 64] = operator.mul(%out_1, %unsqueeze_1)
%inv_perm: i64[6] = torch.empty_like(%perm)
%arange: i64[6] = torch.arange(6, device=cpu)
%setitem = operator.setitem(%inv_perm, %perm, %arange)
%weighted_out_1: f32[6, 64] = operator.getitem(%weighted_out, %inv_perm)
%view_3: f32[3, 2, 64] = .view(%weighted_out_1, 3, 2, 64)
%final_hidden_states: f32[3, 64] = .sum(%view_3, dim=1)
%to_2: f32[3, 64] = .to(%final_hidden_states, torch.float32)
%hidden_states_2: f32[1, 3, 64] = .view(%to_2, 1, 3, 64)
%linear_1: f32[1, 3, 32] = torch._C._nn.linear(%arg.hidden_states, %shared_experts.gate_proj.weight, None)
%silu_1: f32[1, 3, 32] = torch.nn.functional.silu(%linear_1)
%linear_2: f32[1, 3, 32] = torch._C._nn.linear(%arg.hidden_states, %shared_experts.up_proj.weight, None)
%mul_3: f32[1, 3, 32] = operator.mul(%silu_1, %linear_2)
%down_proj: f32[1, 3, 64] = torch._C._nn.linear(%mul_3, %shared_experts.down_proj.weight, None)
%hidden_states_3: f32[1, 3, 64] = operator.add(%hidden_states_2, %down_proj)
return (%hidden_states_3,)
""")
        self.assertExpectedInline(graph.after, """\
%arg.hidden_states: f32[1, 3, 64] = input
%gate.weight: f32[8, 64] = input
%gate.e_score_correction_bias: f32[8] = input
%experts.gate_up_proj: f32[8, 64, 64] = input
%experts.down_proj: f32[8, 64, 32] = input
%shared_experts.gate_proj.weight: f32[32, 64] = input
%shared_experts.up_proj.weight: f32[32, 64] = input
%shared_experts.down_proj.weight: f32[64, 32] = input
%hidden_states: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%type_1: f32[3, 64] = .type(%hidden_states, torch.float32)
%type_2: f32[8, 64] = .type(%gate.weight, torch.float32)
%router_logits: f32[3, 8] = torch.ops.dflash.split_k_linear.default(%type_1, %type_2, None)
%scores: f32[3, 8] = .sigmoid(%router_logits)
%scores_for_choice: f32[3, 8] = operator.add(%scores, %gate.e_score_correction_bias)
%view_1: f32[3, 2, 4] = .view(%scores_for_choice, -1, 2, 4)
%top_k_default: (f32[3, 2, 2], i64[3, 2, 2]) = torch.ops.dflash.top_k.default(%view_1, 2)
%getitem: f32[3, 2, 2] = operator.getitem(%top_k_default, 0)
%group_scores: f32[3, 2] = .sum(%getitem, dim=-1)
%top_k_default_1: (f32[3, 1], i64[3, 1]) = torch.ops.dflash.top_k.default(%group_scores, 1)
%group_idx: i64[3, 1] = operator.getitem(%top_k_default_1, 1)
%group_mask: f32[3, 2] = torch.zeros_like(%group_scores)
%scatter_: f32[3, 2] = .scatter_(%group_mask, 1, %group_idx, 1)
%unsqueeze: f32[3, 2, 1] = .unsqueeze(%group_mask, -1)
%expand: f32[3, 2, 4] = .expand(%unsqueeze, -1, 2, 4)
%score_mask: f32[3, 8] = .reshape(%expand, -1, 8)
%bool_1: b8[3, 8] = .bool(%score_mask)
%invert: b8[3, 8] = operator.invert(%bool_1)
%scores_for_choice_1: f32[3, 8] = .masked_fill(%scores_for_choice, %invert, -inf)
%top_k_default_2: (f32[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%scores_for_choice_1, 2)
%topk_indices: i64[3, 2] = operator.getitem(%top_k_default_2, 1)
%topk_weights: f32[3, 2] = .gather(%scores, 1, %topk_indices)
%sum_2: f32[3, 1] = .sum(%topk_weights, dim=-1, keepdim=True)
%denominator: f32[3, 1] = operator.add(%sum_2, 1e-20)
%topk_weights_1: f32[3, 2] = operator.itruediv(%topk_weights, %denominator)
%topk_weights_2: f32[3, 2] = operator.mul(%topk_weights_1, 2.5)
%hidden_states_1: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%moe_dispatch_default: f32[3, 64] = torch.ops.dflash.moe_dispatch.default(%hidden_states_1, %topk_indices, %topk_weights_2, store, 0)
%hidden_states_2: f32[1, 3, 64] = .view(%moe_dispatch_default, 1, 3, 64)
%linear_1: f32[1, 3, 32] = torch.ops.dflash.split_k_linear.default(%arg.hidden_states, %shared_experts.gate_proj.weight, None)
%silu_1: f32[1, 3, 32] = torch.nn.functional.silu(%linear_1)
%linear_2: f32[1, 3, 32] = torch.ops.dflash.split_k_linear.default(%arg.hidden_states, %shared_experts.up_proj.weight, None)
%mul_3: f32[1, 3, 32] = operator.mul(%silu_1, %linear_2)
%down_proj: f32[1, 3, 64] = torch._C._nn.linear(%mul_3, %shared_experts.down_proj.weight, None)
%hidden_states_3: f32[1, 3, 64] = operator.add(%hidden_states_2, %down_proj)
return (%hidden_states_3,)
""")

    def test_deepseek_v3(self):
        graph = moe_block_graphs("deepseek_v3")
        self.assertExpectedInline(graph.before, """\
%arg.hidden_states: f32[1, 3, 64] = input
%gate.weight: f32[8, 64] = input
%gate.e_score_correction_bias: f32[8] = input
%experts.gate_up_proj: f32[8, 64, 64] = input
%experts.down_proj: f32[8, 64, 32] = input
%shared_experts.gate_proj.weight: f32[32, 64] = input
%shared_experts.up_proj.weight: f32[32, 64] = input
%shared_experts.down_proj.weight: f32[64, 32] = input
%hidden_states: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%type_1: f32[3, 64] = .type(%hidden_states, torch.float32)
%type_2: f32[8, 64] = .type(%gate.weight, torch.float32)
%router_logits: f32[3, 8] = torch._C._nn.linear(%type_1, %type_2)
%scores: f32[3, 8] = .sigmoid(%router_logits)
%scores_for_choice: f32[3, 8] = operator.add(%scores, %gate.e_score_correction_bias)
%view_1: f32[3, 2, 4] = .view(%scores_for_choice, -1, 2, 4)
%topk: (f32[3, 2, 2], i64[3, 2, 2]) = .topk(%view_1, 2, dim=-1)
%getitem: f32[3, 2, 2] = operator.getitem(%topk, 0)
%group_scores: f32[3, 2] = .sum(%getitem, dim=-1)
%topk_1: (f32[3, 1], i64[3, 1]) = torch.topk(%group_scores, k=1, dim=-1, sorted=False)
%group_idx: i64[3, 1] = operator.getitem(%topk_1, 1)
%group_mask: f32[3, 2] = torch.zeros_like(%group_scores)
%scatter_: f32[3, 2] = .scatter_(%group_mask, 1, %group_idx, 1)
%unsqueeze: f32[3, 2, 1] = .unsqueeze(%group_mask, -1)
%expand: f32[3, 2, 4] = .expand(%unsqueeze, -1, 2, 4)
%score_mask: f32[3, 8] = .reshape(%expand, -1, 8)
%bool_1: b8[3, 8] = .bool(%score_mask)
%invert: b8[3, 8] = operator.invert(%bool_1)
%scores_for_choice_1: f32[3, 8] = .masked_fill(%scores_for_choice, %invert, -inf)
%topk_2: (f32[3, 2], i64[3, 2]) = torch.topk(%scores_for_choice_1, k=2, dim=-1, sorted=False)
%topk_indices: i64[3, 2] = operator.getitem(%topk_2, 1)
%topk_weights: f32[3, 2] = .gather(%scores, 1, %topk_indices)
%sum_2: f32[3, 1] = .sum(%topk_weights, dim=-1, keepdim=True)
%denominator: f32[3, 1] = operator.add(%sum_2, 1e-20)
%topk_weights_1: f32[3, 2] = operator.itruediv(%topk_weights, %denominator)
%topk_weights_2: f32[3, 2] = operator.mul(%topk_weights_1, 2.5)
%hidden_states_1: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%sample_weights: f32[6] = .reshape(%topk_weights_2, -1)
%expert_ids: i64[6] = .reshape(%topk_indices, -1)
%sort: (i64[6], i64[6]) = torch.sort(%expert_ids)
%expert_ids_g: i64[6] = operator.getitem(%sort, 0)
%perm: i64[6] = operator.getitem(%sort, 1)
%floordiv: i64[6] = operator.floordiv(%perm, 2)
%selected_hidden_states_g: f32[6, 64] = operator.getitem(%hidden_states_1, %floordiv)
%sample_weights_g: f32[6] = operator.getitem(%sample_weights, %perm)
%histc_input: f32[6] = .float(%expert_ids_g)
%tokens_per_expert: f32[8] = torch.histc(%histc_input, bins=8, min=0, max=7)
%offsets: i32[8] = torch.cumsum(%tokens_per_expert, dim=0, dtype=torch.int32)
%transpose: f32[8, 64, 64] = .transpose(%experts.gate_up_proj, -2, -1)
%to: f32[6, 64] = .to(%selected_hidden_states_g, torch.float32)
%out: f32[6, 64] = torch.ops.transformers.grouped_mm_fallback(%to, %transpose, offs=%offsets)
%chunk: (f32[6, 32], f32[6, 32]) = .chunk(%out, 2, dim=-1)
%gate: f32[6, 32] = operator.getitem(%chunk, 0)
%up: f32[6, 32] = operator.getitem(%chunk, 1)
%silu: f32[6, 32] = torch.nn.functional.silu(%gate)
%proj_out: f32[6, 32] = operator.mul(%silu, %up)
%transpose_1: f32[8, 32, 64] = .transpose(%experts.down_proj, -2, -1)
%to_1: f32[6, 32] = .to(%proj_out, torch.float32)
%out_1: f32[6, 64] = torch.ops.transformers.grouped_mm_fallback(%to_1, %transpose_1, offs=%offsets)
%unsqueeze_1: f32[6, 1] = .unsqueeze(%sample_weights_g, -1)
%weighted_out: f32[6, 64] = operator.mul(%out_1, %unsqueeze_1)
%inv_perm: i64[6] = torch.empty_like(%perm)
%arange: i64[6] = torch.arange(6, device=cpu)
%setitem = operator.setitem(%inv_perm, %perm, %arange)
%weighted_out_1: f32[6, 64] = operator.getitem(%weighted_out, %inv_perm)
%view_3: f32[3, 2, 64] = .view(%weighted_out_1, 3, 2, 64)
%final_hidden_states: f32[3, 64] = .sum(%view_3, dim=1)
%to_2: f32[3, 64] = .to(%final_hidden_states, torch.float32)
%hidden_states_2: f32[1, 3, 64] = .view(%to_2, 1, 3, 64)
%linear_1: f32[1, 3, 32] = torch._C._nn.linear(%arg.hidden_states, %shared_experts.gate_proj.weight, None)
%silu_1: f32[1, 3, 32] = torch.nn.functional.silu(%linear_1)
%linear_2: f32[1, 3, 32] = torch._C._nn.linear(%arg.hidden_states, %shared_experts.up_proj.weight, None)
%mul_3: f32[1, 3, 32] = operator.mul(%silu_1, %linear_2)
%down_proj: f32[1, 3, 64] = torch._C._nn.linear(%mul_3, %shared_experts.down_proj.weight, None)
%hidden_states_3: f32[1, 3, 64] = operator.add(%hidden_states_2, %down_proj)
return (%hidden_states_3,)
""")
        self.assertExpectedInline(graph.after, """\
%arg.hidden_states: f32[1, 3, 64] = input
%gate.weight: f32[8, 64] = input
%gate.e_score_correction_bias: f32[8] = input
%experts.gate_up_proj: f32[8, 64, 64] = input
%experts.down_proj: f32[8, 64, 32] = input
%shared_experts.gate_proj.weight: f32[32, 64] = input
%shared_experts.up_proj.weight: f32[32, 64] = input
%shared_experts.down_proj.weight: f32[64, 32] = input
%hidden_states: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%type_1: f32[3, 64] = .type(%hidden_states, torch.float32)
%type_2: f32[8, 64] = .type(%gate.weight, torch.float32)
%router_logits: f32[3, 8] = torch.ops.dflash.split_k_linear.default(%type_1, %type_2, None)
%scores: f32[3, 8] = .sigmoid(%router_logits)
%scores_for_choice: f32[3, 8] = operator.add(%scores, %gate.e_score_correction_bias)
%view_1: f32[3, 2, 4] = .view(%scores_for_choice, -1, 2, 4)
%top_k_default: (f32[3, 2, 2], i64[3, 2, 2]) = torch.ops.dflash.top_k.default(%view_1, 2)
%getitem: f32[3, 2, 2] = operator.getitem(%top_k_default, 0)
%group_scores: f32[3, 2] = .sum(%getitem, dim=-1)
%top_k_default_1: (f32[3, 1], i64[3, 1]) = torch.ops.dflash.top_k.default(%group_scores, 1)
%group_idx: i64[3, 1] = operator.getitem(%top_k_default_1, 1)
%group_mask: f32[3, 2] = torch.zeros_like(%group_scores)
%scatter_: f32[3, 2] = .scatter_(%group_mask, 1, %group_idx, 1)
%unsqueeze: f32[3, 2, 1] = .unsqueeze(%group_mask, -1)
%expand: f32[3, 2, 4] = .expand(%unsqueeze, -1, 2, 4)
%score_mask: f32[3, 8] = .reshape(%expand, -1, 8)
%bool_1: b8[3, 8] = .bool(%score_mask)
%invert: b8[3, 8] = operator.invert(%bool_1)
%scores_for_choice_1: f32[3, 8] = .masked_fill(%scores_for_choice, %invert, -inf)
%top_k_default_2: (f32[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%scores_for_choice_1, 2)
%topk_indices: i64[3, 2] = operator.getitem(%top_k_default_2, 1)
%topk_weights: f32[3, 2] = .gather(%scores, 1, %topk_indices)
%sum_2: f32[3, 1] = .sum(%topk_weights, dim=-1, keepdim=True)
%denominator: f32[3, 1] = operator.add(%sum_2, 1e-20)
%topk_weights_1: f32[3, 2] = operator.itruediv(%topk_weights, %denominator)
%topk_weights_2: f32[3, 2] = operator.mul(%topk_weights_1, 2.5)
%hidden_states_1: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%moe_dispatch_default: f32[3, 64] = torch.ops.dflash.moe_dispatch.default(%hidden_states_1, %topk_indices, %topk_weights_2, store, 0)
%hidden_states_2: f32[1, 3, 64] = .view(%moe_dispatch_default, 1, 3, 64)
%linear_1: f32[1, 3, 32] = torch.ops.dflash.split_k_linear.default(%arg.hidden_states, %shared_experts.gate_proj.weight, None)
%silu_1: f32[1, 3, 32] = torch.nn.functional.silu(%linear_1)
%linear_2: f32[1, 3, 32] = torch.ops.dflash.split_k_linear.default(%arg.hidden_states, %shared_experts.up_proj.weight, None)
%mul_3: f32[1, 3, 32] = operator.mul(%silu_1, %linear_2)
%down_proj: f32[1, 3, 64] = torch._C._nn.linear(%mul_3, %shared_experts.down_proj.weight, None)
%hidden_states_3: f32[1, 3, 64] = operator.add(%hidden_states_2, %down_proj)
return (%hidden_states_3,)
""")

    def test_olmoe(self):
        graph = moe_block_graphs("olmoe")
        self.assertExpectedInline(graph.before, """\
%arg.hidden_states: f32[1, 3, 64] = input
%gate.weight: f32[8, 64] = input
%experts.gate_up_proj: f32[8, 64, 64] = input
%experts.down_proj: f32[8, 64, 32] = input
%hidden_states: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%hidden_states_1: f32[3, 64] = .reshape(%hidden_states, -1, 64)
%router_logits: f32[3, 8] = torch._C._nn.linear(%hidden_states_1, %gate.weight)
%router_probs: f32[3, 8] = torch.nn.functional.softmax(%router_logits, dtype=torch.float32, dim=-1)
%topk: (f32[3, 2], i64[3, 2]) = torch.topk(%router_probs, 2, dim=-1)
%router_top_value: f32[3, 2] = operator.getitem(%topk, 0)
%router_indices: i64[3, 2] = operator.getitem(%topk, 1)
%router_top_value_1: f32[3, 2] = .to(%router_top_value, torch.float32)
%sample_weights: f32[6] = .reshape(%router_top_value_1, -1)
%expert_ids: i64[6] = .reshape(%router_indices, -1)
%sort: (i64[6], i64[6]) = torch.sort(%expert_ids)
%expert_ids_g: i64[6] = operator.getitem(%sort, 0)
%perm: i64[6] = operator.getitem(%sort, 1)
%floordiv: i64[6] = operator.floordiv(%perm, 2)
%selected_hidden_states_g: f32[6, 64] = operator.getitem(%hidden_states, %floordiv)
%sample_weights_g: f32[6] = operator.getitem(%sample_weights, %perm)
%histc_input: f32[6] = .float(%expert_ids_g)
%tokens_per_expert: f32[8] = torch.histc(%histc_input, bins=8, min=0, max=7)
%offsets: i32[8] = torch.cumsum(%tokens_per_expert, dim=0, dtype=torch.int32)
%transpose: f32[8, 64, 64] = .transpose(%experts.gate_up_proj, -2, -1)
%to_1: f32[6, 64] = .to(%selected_hidden_states_g, torch.float32)
%out: f32[6, 64] = torch.ops.transformers.grouped_mm_fallback(%to_1, %transpose, offs=%offsets)
%chunk: (f32[6, 32], f32[6, 32]) = .chunk(%out, 2, dim=-1)
%gate: f32[6, 32] = operator.getitem(%chunk, 0)
%up: f32[6, 32] = operator.getitem(%chunk, 1)
%silu: f32[6, 32] = torch.nn.functional.silu(%gate)
%proj_out: f32[6, 32] = operator.mul(%silu, %up)
%transpose_1: f32[8, 32, 64] = .transpose(%experts.down_proj, -2, -1)
%to_2: f32[6, 32] = .to(%proj_out, torch.float32)
%out_1: f32[6, 64] = torch.ops.transformers.grouped_mm_fallback(%to_2, %transpose_1, offs=%offsets)
%unsqueeze: f32[6, 1] = .unsqueeze(%sample_weights_g, -1)
%weighted_out: f32[6, 64] = operator.mul(%out_1, %unsqueeze)
%inv_perm: i64[6] = torch.empty_like(%perm)
%arange: i64[6] = torch.arange(6, device=cpu)
%setitem = operator.setitem(%inv_perm, %perm, %arange)
%weighted_out_1: f32[6, 64] = operator.getitem(%weighted_out, %inv_perm)
%view_1: f32[3, 2, 64] = .view(%weighted_out_1, 3, 2, 64)
%final_hidden_states: f32[3, 64] = .sum(%view_1, dim=1)
%to_3: f32[3, 64] = .to(%final_hidden_states, torch.float32)
%final_hidden_states_1: f32[1, 3, 64] = .reshape(%to_3, 1, 3, 64)
return (%final_hidden_states_1,)
""")
        self.assertExpectedInline(graph.after, """\
%arg.hidden_states: f32[1, 3, 64] = input
%gate.weight: f32[8, 64] = input
%experts.gate_up_proj: f32[8, 64, 64] = input
%experts.down_proj: f32[8, 64, 32] = input
%hidden_states: f32[3, 64] = .view(%arg.hidden_states, -1, 64)
%hidden_states_1: f32[3, 64] = .reshape(%hidden_states, -1, 64)
%router_logits: f32[3, 8] = torch.ops.dflash.split_k_linear.default(%hidden_states_1, %gate.weight, None)
%top_k_default: (f32[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%router_logits, 2, torch.float32, values_dtype=torch.float32)
%router_top_value: f32[3, 2] = operator.getitem(%top_k_default, 0)
%router_indices: i64[3, 2] = operator.getitem(%top_k_default, 1)
%moe_dispatch_default: f32[3, 64] = torch.ops.dflash.moe_dispatch.default(%hidden_states, %router_indices, %router_top_value, store, 0)
%final_hidden_states_1: f32[1, 3, 64] = .reshape(%moe_dispatch_default, 1, 3, 64)
return (%final_hidden_states_1,)
""")
