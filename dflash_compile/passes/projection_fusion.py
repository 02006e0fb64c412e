"""Pass `projection_fusion`: linear layers on one input whose weights are adjacent rows of one buffer become one.

Before (a gpt-oss attention block after `optimize` laid q/k/v out in one buffer, `projections.share_storage`):

    %q = torch._C._nn.linear(%hidden, %self_attn.q_proj.weight, %self_attn.q_proj.bias)
    %k = torch._C._nn.linear(%hidden, %self_attn.k_proj.weight, %self_attn.k_proj.bias)
    %v = torch._C._nn.linear(%hidden, %self_attn.v_proj.weight, %self_attn.v_proj.bias)

After (one GEMM over the buffer, the first parameter viewed over all their rows; its output split):

    %as_strided = torch.as_strided(%self_attn.q_proj.weight, [Nq + Nk + Nv, H], [H, 1], 0)
    %as_strided_1 = torch.as_strided(%self_attn.q_proj.bias, [Nq + Nk + Nv], [1], 0)
    %linear = torch._C._nn.linear(%hidden, %as_strided, %as_strided_1)
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
from torch.fx import GraphModule, Node

from ..projections import rows_adjacent
from .context import LINEAR_CALLS, PassContext

Parts = tuple[Node, Node, Node | None]  # a linear call's input, weight and bias


def _parts(node: Node) -> Parts | None:
    """(input, weight, bias) of a linear call whose weight and bias are graph inputs, else None."""
    if (node.op != "call_function" or node.target not in LINEAR_CALLS or set(node.kwargs) - {"bias"}
            or len(node.args) < 2):
        return None
    x, weight, *rest = node.args
    bias = rest[0] if rest else node.kwargs.get("bias")
    if not all(isinstance(part, Node) and part.op == "placeholder" for part in (weight, bias) if part is not None):
        return None
    return x, weight, bias


def _runs(linears: dict[Node, Parts], values: dict[Node, object]) -> list[list[Node]]:
    """The linears (all on one input) in runs of two or more whose weights, and biases, are adjacent rows."""
    weight = lambda node: values[linears[node][1]]  # noqa: E731
    bias = lambda node: values.get(linears[node][2])  # noqa: E731  (None for none)
    ordered = sorted(linears, key=lambda node: (weight(node).untyped_storage().data_ptr(),
                                                weight(node).storage_offset()))
    runs, run = [], [ordered[0]]
    for node in ordered[1:]:
        candidate = run + [node]
        biases = [bias(n) for n in candidate]
        together = rows_adjacent([weight(n) for n in candidate]) and (
            all(b is None for b in biases) or (None not in biases and rows_adjacent(biases)))
        if together:
            run = candidate
        else:
            runs.append(run)
            run = [node]
    runs.append(run)
    return [run for run in runs if len(run) > 1]


def _rows_view(graph: torch.fx.Graph, parts: list[Node], values: dict[Node, object]) -> Node:
    """A view of the parts' storage as their concatenation: the first part's placeholder viewed over all their rows.
    A view of the call's own parameter, not a tensor taken now: Dynamo may run one graph of a module's frame (a graph
    break inside a model) for every module of its class, each with its own parameters (laid out alike by
    `share_storage`)."""
    first = values[parts[0]]
    shape = (sum(values[part].shape[0] for part in parts), *first.shape[1:])
    view = graph.call_function(torch.as_strided, (parts[0], shape, first.stride(), first.storage_offset()))
    example = parts[0].meta.get("example_value")
    if example is not None:
        view.meta["example_value"] = torch.as_strided(example, shape, first.stride(), first.storage_offset())
    return view


def _fuse(graph: torch.fx.Graph, run: list[Node], linears: dict[Node, Parts], values: dict[Node, object],
          first: Node) -> None:
    """Replace the run's linears (in storage order; `first` the earliest in the graph) by one linear and a split."""
    x, _, bias = linears[first]
    weights = [linears[node][1] for node in run]
    with graph.inserting_before(first):
        weight = _rows_view(graph, weights, values)
        bias = _rows_view(graph, [linears[node][2] for node in run], values) if bias else None
        fused = graph.call_function(torch._C._nn.linear, (x, weight, bias))
        split = graph.call_function(torch.split, (fused, [values[w].shape[0] for w in weights]), {"dim": -1})
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
    values = ctx.input_values(gm.graph)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    by_input: dict[Node, dict[Node, Parts]] = defaultdict(dict)
    for node in gm.graph.nodes:
        parts = _parts(node)
        if parts is not None and isinstance(values[parts[1]], torch.Tensor):
            by_input[parts[0]][node] = parts
    runs = [(run, linears) for linears in by_input.values() if len(linears) > 1 for run in _runs(linears, values)]
    for run, linears in runs:
        _fuse(gm.graph, run, linears, values, min(run, key=order.__getitem__))
    return len(runs)
