"""Pass `projection_fusion`: linear layers on one input whose weights are adjacent rows of one buffer become one.

Before (a gpt-oss attention block after `optimize` laid q/k/v out in one buffer, `projections.share_storage`):

    %q = torch._C._nn.linear(%hidden, %self_attn.q_proj.weight, %self_attn.q_proj.bias)
    %k = torch._C._nn.linear(%hidden, %self_attn.k_proj.weight, %self_attn.k_proj.bias)
    %v = torch._C._nn.linear(%hidden, %self_attn.v_proj.weight, %self_attn.v_proj.bias)

After (one GEMM over the buffer, a view of the parameters' storage held by the graph module; its output split):

    %fused_weight_0 = get_attr[fused_weight_0]
    %fused_bias_0 = get_attr[fused_bias_0]
    %linear = torch._C._nn.linear(%hidden, %fused_weight_0, %fused_bias_0)
    %split = torch.functional.split(%linear, [Nq, Nk, Nv], dim=-1)
    %q = operator.getitem(%split, 0) ...

Weights are matched by where they live (`projections.rows_adjacent` on the real parameters), not by name: the pass
needs no family knowledge, and layers that `share_storage` did not lay out are left alone. Runs on the Dynamo graph
before lowering, so Inductor's graph cache keys on the rewritten graph.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch._dynamo.source import AttrSource
from torch.fx import GraphModule, Node

from ..projections import rows_adjacent
from .context import PassContext

_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)


def _parts(node: Node) -> tuple[Node, Node, Node | None] | None:
    """(input, weight, bias) of a linear call whose weight and bias are graph inputs, else None."""
    if node.op != "call_function" or node.target not in _LINEARS or set(node.kwargs) - {"bias"} or len(node.args) < 2:
        return None
    x, weight, *rest = node.args
    bias = rest[0] if rest else node.kwargs.get("bias")
    if not all(isinstance(part, Node) and part.op == "placeholder" for part in (weight, bias) if part is not None):
        return None
    return x, weight, bias


def _runs(linears: list[Node], ctx: PassContext) -> list[list[Node]]:
    """The linears (all on one input) in runs of two or more whose weights, and biases, are adjacent rows."""
    value = lambda node, part: ctx.input_value(_parts(node)[part]) if _parts(node)[part] is not None else None  # noqa: E731
    ordered = sorted(linears, key=lambda node: (value(node, 1).untyped_storage().data_ptr(),
                                                value(node, 1).storage_offset()))
    runs, run = [], [ordered[0]]
    for node in ordered[1:]:
        candidate = run + [node]
        biases = [value(n, 2) for n in candidate]
        together = rows_adjacent([value(n, 1) for n in candidate]) and (
            all(b is None for b in biases) or (None not in biases and rows_adjacent(biases)))
        if together:
            run = candidate
        else:
            runs.append(run)
            run = [node]
    runs.append(run)
    return [run for run in runs if len(run) > 1]


def _buffer(gm: GraphModule, name: str, parts: list[Node], ctx: PassContext) -> Node:
    """A graph-module attribute viewing the parts' storage as their concatenation, and its get_attr node. In a
    Dynamo graph AOTAutograd lifts each attribute by its source, as Dynamo registers its own: here one under the
    first part's (guards are never made from it: the attribute is no graph input)."""
    first = ctx.input_value(parts[0])
    shape = (sum(ctx.input_value(part).shape[0] for part in parts), *first.shape[1:])
    gm.register_buffer(name, first.detach().as_strided(shape, first.stride(), first.storage_offset()))
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is not None:
        sources[name] = AttrSource(parts[0]._dynamo_source, name)
    return gm.graph.get_attr(name)


def _fuse(gm: GraphModule, run: list[Node], ctx: PassContext, index: int) -> None:
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min(run, key=order.__getitem__)
    x, _, bias = _parts(first)
    weights = [_parts(node)[1] for node in run]
    with graph.inserting_before(first):
        weight = _buffer(gm, f"fused_weight_{index}", weights, ctx)
        bias = _buffer(gm, f"fused_bias_{index}", [_parts(node)[2] for node in run], ctx) if bias else None
        fused = graph.call_function(torch._C._nn.linear, (x, weight, bias))
        rows = [ctx.input_value(w).shape[0] for w in weights]
        split = graph.call_function(torch.split, (fused, rows), {"dim": -1})
        examples = [node.meta.get("example_value") for node in run]  # Dynamo's fake tensors
        fake_mode = getattr(examples[0], "fake_mode", None)
        if fake_mode is not None:
            with fake_mode:
                fused.meta["example_value"] = torch.cat(examples, dim=-1)
        for i, node in enumerate(run):
            part = graph.call_function(operator.getitem, (split, i))
            part.meta.update(node.meta)
            node.replace_all_uses_with(part)
    for node in run:
        graph.erase_node(node)


def projection_fusion(gm: GraphModule, ctx: PassContext) -> int:
    by_input: dict[Node, list[Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        parts = _parts(node)
        if parts is not None and isinstance(ctx.input_value(parts[1]), torch.Tensor):
            by_input[parts[0]].append(node)
    runs = [run for linears in by_input.values() if len(linears) > 1 for run in _runs(linears, ctx)]
    for index, run in enumerate(runs):
        _fuse(gm, run, ctx, index)
    if runs:
        gm.graph.lint()
        gm.recompile()
    return len(runs)
