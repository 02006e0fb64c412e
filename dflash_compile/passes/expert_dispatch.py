"""Pass `expert_dispatch`: every routed-expert region becomes one `dflash::moe_dispatch` node.

Before (one MoE layer as Dynamo traces transformers' grouped_mm experts; ~35 nodes):

    %top_k_weights ... %top_k_index ... %hidden          <- from the router and the MoE block
    %sample_weights = .reshape(%top_k_weights, -1)
    %sort = torch.sort(%expert_ids) ... torch.histc ... torch.cumsum
    %out = torch.ops.transformers.grouped_mm_fallback(%hidden_g, %experts.gate_up_proj, %offsets)
    ... act(gate) * up ... grouped_mm(%experts.down_proj) ... * weights ... scatter back ... .sum(dim=1)

After:

    %moe_dispatch = torch.ops.dflash.moe_dispatch.default(%hidden, %top_k_index, %top_k_weights, store, layer)

(`dflash::moe_dispatch_offloaded`, tagged cudagraph_unsafe, for experts that `offload_experts` moved to host
memory behind the host-managed cache, which reads each layer's routing: Inductor's graph partitioning then captures
everything around it in CUDA graphs. The device-managed cache reads nothing back and keeps `moe_dispatch`.)

A region is the set of nodes whose `nn_module_stack` passes through a routed-experts module that the family
registry recognises by class. Its activation inputs are the hidden states, the integer expert ids and the routing
weights (the ids' shape); its parameter inputs (`gate_up_proj`, `down_proj`, biases) become unused placeholders,
since the weights now belong to the expert store. Router, shared experts and dense MLPs are left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from ..families import FamilySpec, spec_for_experts_class
from .context import PassContext


# what a size-arithmetic node computes (Dynamo traced the shapes as dynamic)
_SIZES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _is_size(node: Node) -> bool:
    """Size arithmetic, which Dynamo reuses for the same size further down the graph, outside the region that
    computed it first: not a region output, and kept where later nodes still use it."""
    return isinstance(node.meta.get("example_value"), _SIZES)


@dataclass
class ExpertRegion:
    path: str  # Dynamo's module path, e.g. "L['self'].model.layers.1.mlp.experts"
    spec: FamilySpec
    nodes: list[Node] = field(default_factory=list)


def find_expert_regions(graph: torch.fx.Graph) -> list[ExpertRegion]:
    """Routed-expert regions in graph order, keyed by the call of the outermost experts module on each node's stack:
    a module called more than once a forward (Inkling 2's looped layers) makes a region per call (Dynamo's stack
    keys its later calls `@1`, `@2`, ...)."""
    regions: dict[str, ExpertRegion] = {}
    for node in graph.nodes:
        if node.op != "call_function" and node.op != "call_method":
            continue  # placeholders carry a module stack too, but stay: the caller still passes them
        for call, (path, module_class) in (node.meta.get("nn_module_stack") or {}).items():
            spec = spec_for_experts_class(module_class)
            if spec is not None:
                regions.setdefault(call, ExpertRegion(path, spec)).nodes.append(node)
                break
    return list(regions.values())


def _value(node: Node, ctx: PassContext):
    if node.op == "placeholder":
        return ctx.input_value(node)
    return node.meta.get("example_value", node.meta.get("val"))


def _activation_inputs(region: ExpertRegion, experts: torch.nn.Module, ctx: PassContext) -> tuple[Node, Node, Node]:
    """(hidden, top_k_index, top_k_weights) among the region's tensor inputs. Dropped: the experts' own tensors,
    sizes (SymInts, where Dynamo traced the shapes as dynamic: they only size the region's reshapes) and scalars
    (0-d tensors: the module's float attributes under dynamic=True, e.g. gpt-oss's alpha and limit, which the
    store reads from the module itself)."""
    members = set(region.nodes)
    owned = {id(t) for t in (*experts.parameters(), *experts.buffers())}
    inputs: dict[Node, None] = {}
    for node in region.nodes:
        for arg in node.all_input_nodes:
            value = _value(arg, ctx)
            if arg not in members and isinstance(value, torch.Tensor) and value.dim() and id(value) not in owned:
                inputs[arg] = None
    index = [n for n in inputs if not _value(n, ctx).is_floating_point()]
    floats = [n for n in inputs if _value(n, ctx).is_floating_point()]
    weights = [n for n in floats if index and _value(n, ctx).shape == _value(index[0], ctx).shape]
    hidden = [n for n in floats if n not in weights]
    if (len(index), len(weights), len(hidden)) != (1, 1, 1):
        raise RuntimeError(
            f"expert_dispatch: expected the experts at {region.path} to take (hidden, top_k_index, top_k_weights), "
            f"found inputs {[n.name for n in inputs]}"
        )
    return hidden[0], index[0], weights[0]


def _region_output(region: ExpertRegion) -> Node:
    members = set(region.nodes)
    escaping = [n for n in region.nodes if not _is_size(n) and any(user not in members for user in n.users)]
    if len(escaping) != 1:
        raise RuntimeError(f"expert_dispatch: the experts at {region.path} have {len(escaping)} outputs, expected 1")
    return escaping[0]


def _replace(gm: GraphModule, region: ExpertRegion, ctx: PassContext) -> None:
    root, experts = ctx.resolve(region.path)
    hidden, top_k_index, top_k_weights = _activation_inputs(region, experts, ctx)
    output = _region_output(region)
    store = ctx.store(root)
    layer = store.add_layer(experts, region.spec, region.path, fused=ctx.fused_experts)
    # Offloaded experts whose cache the host manages sync on the routing: their op is tagged to stay out of CUDA
    # graphs. The device-managed cache reads nothing back, so its layers stay in the graph.
    offload = getattr(experts, "dflash_offload", None)
    host_managed = offload is not None and offload[0].manager == "host"
    op = torch.ops.dflash.moe_dispatch_offloaded if host_managed else torch.ops.dflash.moe_dispatch
    with gm.graph.inserting_before(output):
        dispatch = gm.graph.call_function(op.default, (hidden, top_k_index, top_k_weights, store.id, layer))
    dispatch.meta.update({k: v for k, v in output.meta.items() if k in ("example_value", "val", "stack_trace")})
    stack = output.meta.get("nn_module_stack", {})
    keys = list(stack)
    outer = [k for k in keys if stack[k][0] == region.path]
    dispatch.meta["nn_module_stack"] = {k: stack[k] for k in keys[: keys.index(outer[0]) + 1]} if outer else stack
    output.replace_all_uses_with(dispatch)
    for node in reversed(region.nodes):
        if not node.users:  # all but the sizes used further down (and what they are computed from)
            gm.graph.erase_node(node)


def expert_dispatch(gm: GraphModule, ctx: PassContext) -> int:
    regions = find_expert_regions(gm.graph)
    for region in regions:
        _replace(gm, region, ctx)
    return len(regions)
