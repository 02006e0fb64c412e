"""The pass pipeline, in order. Each pass takes (GraphModule, PassContext), rewrites the graph and returns how many
places it rewrote; the pipeline lints and recompiles a graph after every pass that rewrote something.

1. expert_dispatch  routed-expert regions -> one dflash::moe_dispatch node per MoE layer
2. dequant_fusion   linear(x, fp8_block_dequantize(w, s)) -> one dflash::fp8_block_linear node
3. projection_fusion  linears on one input over adjacent rows of one buffer (q/k/v, gate/up) -> one linear + split
4. small_top_k      torch.topk over a short last dimension (a router's scores, or its softmax) -> one dflash::top_k
5. split_k_linear   linear of a few rows with K > N (routers, o_proj) -> one dflash::split_k_linear node
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch.fx import GraphModule

from .context import PassContext
from .dequant_fusion import dequant_fusion
from .expert_dispatch import expert_dispatch
from .projection_fusion import projection_fusion
from .small_top_k import small_top_k
from .split_k_linear import split_k_linear

GraphPass = Callable[[GraphModule, PassContext], int]

PIPELINE: dict[str, GraphPass] = {
    "expert_dispatch": expert_dispatch,
    "dequant_fusion": dequant_fusion,
    "projection_fusion": projection_fusion,
    "small_top_k": small_top_k,
    "split_k_linear": split_k_linear,
}


def check_pass_names(names: Sequence[str]) -> None:
    unknown = [name for name in names if name not in PIPELINE]
    if unknown:
        raise ValueError(f"unknown dflash pass(es) {unknown}; available passes, in pipeline order: {list(PIPELINE)}")


def run_pipeline(gm: GraphModule, ctx: PassContext, enabled: Sequence[str] | None = None) -> dict[str, int]:
    """Run the enabled passes (all by default) in pipeline order; returns {pass name: match count}."""
    enabled = list(PIPELINE) if enabled is None else list(enabled)
    check_pass_names(enabled)
    matches = {}
    for name, pass_fn in PIPELINE.items():
        if name in enabled:
            matches[name] = pass_fn(gm, ctx)
            if matches[name]:
                gm.graph.lint()
                gm.recompile()
    return matches


__all__ = ["PIPELINE", "PassContext", "run_pipeline", "check_pass_names"]
