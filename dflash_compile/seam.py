"""Make transformers' eager experts traceable under torch.compile, whatever `experts_implementation` was loaded.

The eager Experts forward loops over `nonzero()` of the routing mask: Dynamo cannot trace that without a graph
break, so `expert_dispatch` would never see the region. When dflash_compile is imported (which
`torch.compile(backend="dflash")` does through its entry point), the `"eager"` experts implementation keeps its own
code outside compilation and traces transformers' `grouped_mm` formulation of the same math inside it.
`expert_dispatch` then replaces the region with `dflash::moe_dispatch`. Other backends also stop breaking the
graph there; the outputs agree to rounding.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward


def _eager_experts_forward(self, *args, **kwargs):
    if torch.compiler.is_compiling():
        return grouped_mm_experts_forward(self, *args, **kwargs)
    return type(self).forward.__wrapped__(self, *args, **kwargs)  # the class's own (undecorated) forward


def install() -> None:
    if "eager" not in ExpertsInterface._global_mapping:
        ExpertsInterface.register("eager", _eager_experts_forward)
