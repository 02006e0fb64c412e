"""Make transformers' eager experts traceable under torch.compile, whatever `experts_implementation` was loaded.

The eager Experts forward loops over `nonzero()` of the routing mask: Dynamo cannot trace that without a graph
break, so `expert_dispatch` would never see the region. When dflash_compile is imported (which
`torch.compile(backend="dflash")` does through its entry point), the `"eager"` experts implementation keeps its own
code outside compilation and traces transformers' `grouped_mm` formulation of the same math inside it.
`expert_dispatch` then replaces the region with `dflash::moe_dispatch`. Other backends also stop breaking the
graph there; the outputs agree to rounding. Every transformers implementation is wrapped so that a traced region
is guarded on its experts module's identity (`_bound_to_module`).

It also registers `"dflash_packed"`: the implementation of experts modules whose weights `load_packed` kept as
MXFP4 / FP8 (`dflash_compile.packed.attach_packed`); it runs `dflash::packed_moe` on them. And `"dflash_offload"`
for experts that `offload_experts` moved to host memory: `dflash::moe_dispatch_offloaded` on the model's
offload store.
"""

from __future__ import annotations

import functools

import torch
from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

from .offload import OFFLOAD_IMPLEMENTATION
from .packed import PACKED_IMPLEMENTATION


def _eager_experts_forward(self, *args, **kwargs):
    if torch.compiler.is_compiling():
        return grouped_mm_experts_forward(self, *args, **kwargs)
    return _undecorated_forward(type(self))(self, *args, **kwargs)


def _undecorated_forward(cls: type):
    """The decorated experts class's own forward, found along `cls`'s bases: a subclass may define a forward of its
    own that calls the decorated one (Ergo's `ErgoExperts` around `ErgoExpertProjections`)."""
    return next(forward.__wrapped__ for forward in (vars(base).get("forward") for base in cls.__mro__)
                if hasattr(forward, "__wrapped__"))


def _bound_to_module(forward):
    """`forward` (an experts implementation) guarded on its module's identity when traced. `expert_dispatch` binds
    the region to this module's expert store, so the graph is valid for this module only: id() makes Dynamo guard
    on the module (and drop the graph when it dies). Without it another model of the same class would reuse the
    graph, and with it the first model's experts."""

    @functools.wraps(forward)
    def bound(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            id(self)
        return forward(self, *args, **kwargs)

    bound.dflash_bound = True
    return bound


def _packed_experts_forward(self, hidden, top_k_index, top_k_weights):
    """Experts whose weights `attach_packed` replaced by MXFP4 / FP8 ones: one `dflash::packed_moe` call."""
    from .expert_store import Gate
    from .families import spec_for_experts_class

    gate = Gate.of(spec_for_experts_class(type(self)).layout, self)
    return torch.ops.dflash.packed_moe(
        hidden, top_k_index, top_k_weights, self.packed_format,
        self.packed_gate_up_data, self.packed_gate_up_scales, self.packed_gate_up_bias,
        self.packed_down_data, self.packed_down_scales, self.packed_down_bias,
        gate.interleaved, gate.activation, gate.alpha, gate.limit)


def _offloaded_experts_forward(self, hidden, top_k_index, top_k_weights):
    """Experts whose weights `offload_experts` moved to host blobs: `dflash::moe_dispatch_offloaded` on the
    model's offload store, which fetches them into the slot pool (compiled with the dflash backend, the same node
    remains, outside CUDA graphs)."""
    store, layer = self.dflash_dispatch
    return torch.ops.dflash.moe_dispatch_offloaded(hidden, top_k_index, top_k_weights, store, layer)


def install() -> None:
    mapping = ExpertsInterface._global_mapping
    ours = {"eager": _eager_experts_forward, PACKED_IMPLEMENTATION: _packed_experts_forward,
            OFFLOAD_IMPLEMENTATION: _offloaded_experts_forward}
    for name, forward in ours.items():
        if name not in mapping:
            ExpertsInterface.register(name, forward)
    for name, forward in list(mapping.items()):  # every implementation's region is what expert_dispatch rebinds
        if not getattr(forward, "dflash_bound", False):
            ExpertsInterface.register(name, _bound_to_module(forward))
