"""Golden graph of the compiled verify-commit step: the target over the block with its KV writes, one moe_dispatch
per MoE layer, acceptance and commit, as the dflash ops in graph order (the rest is the model's own math)."""

import torch
from expecttest import TestCase

import dflash_compile
from dflash_compile.cache import TargetCache
from dflash_compile.testing import OracleDrafter, load_tiny_model


def verify_step_ops(family: str, batch: int = 2, block: int = 4) -> str:
    model = load_tiny_model(family)
    decoder = dflash_compile.optimize(model, adaptive=False, drafter=OracleDrafter(torch.zeros(batch, 1), None, block),
                                      compile=False).decoder
    decoder.layer_ids = (0, 1)  # capture two layers' hidden states, as a DFlash drafter would ask
    cache = TargetCache(batch, 32, torch.float32, "cpu")
    prompt = torch.randint(0, 128, (batch, 5))
    with torch.no_grad():
        decoder._target_forward(prompt, cache)
    cache.rows.commit(torch.full((batch,), 5))
    report = dflash_compile.explain(decoder._verify_step, torch.randint(0, 128, (batch, block)), cache,
                                    torch.ones(batch, dtype=torch.int64))
    assert report.graph_break_count == 0 and len(report.graphs) == 1
    lines = report.graphs[0].after.splitlines()
    return "\n".join(line for line in lines if "torch.ops.dflash" in line or line.startswith("return")) + "\n"


class TestVerifyStepGraph(TestCase):
    def test_gpt_oss_verify_step(self):
        self.assertExpectedInline(verify_step_ops("gpt_oss"), """\
%linear_1: f32[2, 4, 32] = torch.ops.dflash.split_k_linear.default(%hidden_states_2, %arg.self_model.model.layers.0.self_attn.k_proj.weight, %arg.self_model.model.layers.0.self_attn.k_proj.bias)
%linear_2: f32[2, 4, 32] = torch.ops.dflash.split_k_linear.default(%hidden_states_2, %arg.self_model.model.layers.0.self_attn.v_proj.weight, %arg.self_model.model.layers.0.self_attn.v_proj.bias)
%kv_write = torch.ops.dflash.kv_write(%arg.cache_rows_keys_0, %arg.cache_rows_values_0, %k_embed, %value_states, %arg.cache_rows_lengths)
%router_logits: f32[8, 4] = torch.ops.dflash.split_k_linear.default(%hidden_states_9, %arg.self_model.model.layers.0.mlp.router.weight, %arg.self_model.model.layers.0.mlp.router.bias)
%top_k_default: (f32[8, 2], i64[8, 2]) = torch.ops.dflash.top_k.default(%router_logits, 2)
%moe_dispatch_default: f32[8, 64] = torch.ops.dflash.moe_dispatch.default(%hidden_states_9, %router_indices, %router_scores, store, 0)
%linear_6: f32[2, 4, 32] = torch.ops.dflash.split_k_linear.default(%hidden_states_15, %arg.self_model.model.layers.1.self_attn.k_proj.weight, %arg.self_model.model.layers.1.self_attn.k_proj.bias)
%linear_7: f32[2, 4, 32] = torch.ops.dflash.split_k_linear.default(%hidden_states_15, %arg.self_model.model.layers.1.self_attn.v_proj.weight, %arg.self_model.model.layers.1.self_attn.v_proj.bias)
%kv_write_1 = torch.ops.dflash.kv_write(%arg.cache_rows_keys_1, %arg.cache_rows_values_1, %k_embed_1, %value_states_2, %arg.cache_rows_lengths)
%router_logits_1: f32[8, 4] = torch.ops.dflash.split_k_linear.default(%hidden_states_22, %arg.self_model.model.layers.1.mlp.router.weight, %arg.self_model.model.layers.1.mlp.router.bias)
%top_k_default_1: (f32[8, 2], i64[8, 2]) = torch.ops.dflash.top_k.default(%router_logits_1, 2)
%moe_dispatch_default_1: f32[8, 64] = torch.ops.dflash.moe_dispatch.default(%hidden_states_22, %router_indices_1, %router_scores_1, store, 1)
%greedy_accept: (i64[2], i64[2, 4]) = torch.ops.dflash.greedy_accept(%arg.block, %logits)
%kv_commit = torch.ops.dflash.kv_commit(%arg.cache_rows_lengths, %mul_39)
return (%accepted, %tokens, %features)
""")
