"""Pass `dequant_fusion`: a linear layer over a dequantized FP8 block-scaled weight becomes one fused op.

Before (an `FP8Linear` as Dynamo traces it: the full-size weight is materialised, then multiplied):

    %deq = torch.ops.dflash.fp8_block_dequantize.default(%weight, %weight_scale_inv, 128, 128, torch.float32)
    %out = torch._C._nn.linear(%x, %deq, %bias)

After (the packed weight is read tile by tile inside the GEMM: the Triton kernel on CUDA, the reference on a CPU):

    %out = torch.ops.dflash.fp8_block_linear.default(%x, %weight, %weight_scale_inv, %bias)

Routed experts need no rewrite here: `expert_dispatch` turns them into `moe_dispatch`, which runs packed experts
with the fused MoE kernel. The pass runs on the Dynamo graph before lowering, so Inductor's graph cache keys on the
rewritten graph and needs no separate pass hash.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from .context import LINEAR_CALLS, PassContext

_DEQUANTIZE = (torch.ops.dflash.fp8_block_dequantize, torch.ops.dflash.fp8_block_dequantize.default)


def _fusable(dequantize: torch.fx.Node) -> bool:
    """Every use is a linear layer's weight, and the blocks are the 128 x 128 the fused op reads."""
    if len(dequantize.args) != 5 or dequantize.kwargs:
        return False
    _, _, block_n, block_k, _ = dequantize.args
    return (block_n, block_k) == (128, 128) and bool(dequantize.users) and all(
        user.op == "call_function" and user.target in LINEAR_CALLS and len(user.args) >= 2
        and user.args[1] is dequantize
        and dequantize not in (user.args[0], *user.args[2:], *user.kwargs.values())
        for user in dequantize.users)


def dequant_fusion(gm: GraphModule, ctx: PassContext) -> int:
    fused = 0
    for dequantize in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _DEQUANTIZE]:
        if not _fusable(dequantize):
            continue
        weight, scale_inv = dequantize.args[:2]
        for linear in list(dequantize.users):
            bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
            with gm.graph.inserting_before(linear):
                replacement = gm.graph.call_function(torch.ops.dflash.fp8_block_linear.default,
                                                     (linear.args[0], weight, scale_inv, bias))
            replacement.meta.update(linear.meta)
            linear.replace_all_uses_with(replacement)
            gm.graph.erase_node(linear)
            fused += 1
        gm.graph.erase_node(dequantize)
    return fused
