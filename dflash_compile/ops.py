"""Custom ops of the `dflash` namespace (torch.library). Each has a fake implementation and exact `mutates_args`.

`moe_dispatch` is opaque to Inductor: the graph sees activations in, activations out, and the expert store decides
how the experts run (today: the reference math on the model's own weights).
"""

from __future__ import annotations

import torch

from .expert_store import get_store


@torch.library.custom_op("dflash::moe_dispatch", mutates_args=())
def moe_dispatch(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, store: int, layer: int
) -> torch.Tensor:
    """Routed experts of one MoE layer: hidden [T, H], top_k_index [T, K], top_k_weights [T, K] -> [T, H].

    `store` and `layer` name the weights in the expert store (see `dflash_compile.expert_store`).
    """
    return get_store(store).dispatch(layer, hidden, top_k_index, top_k_weights)


@moe_dispatch.register_fake
def _moe_dispatch_fake(hidden, top_k_index, top_k_weights, store, layer):
    torch._check(top_k_index.shape == top_k_weights.shape, lambda: "top_k_index and top_k_weights differ in shape")
    torch._check(top_k_index.shape[0] == hidden.shape[0], lambda: "one routing row per token expected")
    return torch.empty_like(hidden)
