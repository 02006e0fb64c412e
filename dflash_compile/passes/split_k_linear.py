"""Pass `split_k_linear`: a linear of a few rows whose weight has more columns than rows becomes one
`dflash::split_k_linear` node.

Before (gpt-oss's router in a decode step, one token; likewise o_proj, 4096 -> 2880):

    %router_logits: bf16[1, 32] = torch._C._nn.linear(%hidden, %router.weight, %router.bias)

After (on CUDA in bf16 one Triton launch, `kernels.moe.packed_linear` on the weight as it is; torch's linear
elsewhere):

    %router_logits: bf16[1, 32] = torch.ops.dflash.split_k_linear.default(%hidden, %router.weight, %router.bias)

Why: for one row and K > N cuBLAS splits K and adds the shares in a second launch (gpt-oss-20b per layer, session
32's profile: the router 4.4 + 1.9 us, o_proj 9.3 + 1.9 us); the kernel splits K to fill the GPU and its last
program to arrive adds the shares. One row runs on the CUDA cores (`kernels.moe.DENSE_ROW_TILES`, session 46:
Qwen3-30B-A3B's o_proj 6.8 us against the tensor-core tiles' 9.4 and cuBLAS's 9.7). Projections with K <= N
(q/k/v, gate/up, lm_head) keep cuBLAS, which runs them without a reduce (q/k/v at 69% of the copy bandwidth) and
beat the kernel there (session 33).

Matched: linear calls (`context.LINEAR_CALLS`) of a 2-D floating-point weight with K > N, on an input whose rows
(all dimensions but the last) are static and at most `ops.SPLIT_K_LINEAR_MAX_ROWS`: decode and verify steps, not
prefills. No family knowledge: every such linear qualifies.
"""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from ..ops import SPLIT_K_LINEAR_MAX_ROWS
from .context import LINEAR_CALLS, PassContext


def _parts(node: Node) -> tuple[Node, Node, Node | None] | None:
    """(input, weight, bias) of a linear call the pass rewrites, else None."""
    if node.op != "call_function" or node.target not in LINEAR_CALLS or set(node.kwargs) - {"bias"}:
        return None
    x, weight, *rest = node.args
    bias = rest[0] if rest else node.kwargs.get("bias")
    x_value, weight_value = (part.meta.get("example_value") if isinstance(part, Node) else None for part in (x, weight))
    if not (isinstance(x_value, torch.Tensor) and isinstance(weight_value, torch.Tensor)
            and weight_value.dim() == 2 and weight_value.is_floating_point()):
        return None
    rows = x_value.shape[:-1]
    few_rows = all(isinstance(size, int) for size in rows) and math.prod(rows) <= SPLIT_K_LINEAR_MAX_ROWS
    n, k = weight_value.shape
    return (x, weight, bias) if few_rows and isinstance(k, int) and isinstance(n, int) and k > n else None


def split_k_linear(gm: GraphModule, ctx: PassContext) -> int:
    matches = [(node, parts) for node in gm.graph.nodes if (parts := _parts(node)) is not None]
    for node, parts in matches:  # the call changes in place: its name and uses stay
        node.target, node.args, node.kwargs = torch.ops.dflash.split_k_linear.default, parts, {}
    return len(matches)
