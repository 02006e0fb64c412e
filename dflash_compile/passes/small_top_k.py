"""Pass `small_top_k`: torch.topk over a short last dimension (a router's scores) becomes one `dflash::top_k` node.

Before (gpt-oss's router; Inductor has no lowering for topk and calls aten.topk, two kernels on CUDA):

    %router_logits: f32[3, 4] = torch._C._nn.linear(%hidden, %router.weight, %router.bias)
    %topk: (f32[3, 2], i64[3, 2]) = torch.topk(%router_logits, 2, dim=-1)
    %router_top_value = operator.getitem(%topk, 0)

After (one Triton launch on CUDA, `kernels.top_k`; torch.topk elsewhere):

    %top_k: (f32[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%router_logits, 2)
    %router_top_value = operator.getitem(%top_k, 0)

A softmax over the same dimension whose only use is the topk (the routers of Qwen3-MoE, Qwen3.5-MoE, OLMoE and
Mixtral choose among probabilities) joins the node, with an fp32 cast of its input, and the kernel computes it in
the same launch:

    %router_probs: f32[3, 4] = torch.nn.functional.softmax(%router_logits, dtype=torch.float32, dim=-1)
    %topk: (f32[3, 2], i64[3, 2]) = torch.topk(%router_probs, 2, dim=-1)
->
    %top_k: (f32[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%router_logits, 2, torch.float32)

and so do a renormalization of the chosen values by their sum and a cast of them, where nothing else reads the
values (`_values_tail`; Qwen3-MoE's, for one):

    %sum_1: f32[3, 1] = .sum(%router_top_value, dim=-1, keepdim=True)
    %router_top_value_1: f32[3, 2] = operator.itruediv(%router_top_value, %sum_1)
    %router_top_value_2: bf16[3, 2] = .to(%router_top_value_1, torch.bfloat16)
->
    %top_k: (bf16[3, 2], i64[3, 2]) = torch.ops.dflash.top_k.default(%router_logits, 2, torch.float32,
                                                                     renormalize=True, values_dtype=torch.bfloat16)

Matched: `torch.topk(x, k, ...)` and `x.topk(k, ...)` taking the largest k (a constant, at most
`ops.TOP_K_MAX_K`) along the last dimension, that dimension static and at most `ops.TOP_K_MAX_WIDTH` long,
floating-point values, every use an index into the result. `sorted=False` (DeepSeek's and GLM's group and expert
choice) is matched too: sorted is one of the orders it allows. No family knowledge: any such topk qualifies, a
sampler's over the vocabulary does not.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from ..ops import TOP_K_MAX_K, TOP_K_MAX_WIDTH
from .context import PassContext

_PARAMETERS = ("input", "k", "dim", "largest", "sorted")


def _arguments(node: Node) -> dict | None:
    """torch.topk's arguments of a topk call by name, else None."""
    if node.op == "call_function" and node.target is torch.topk or node.op == "call_method" and node.target == "topk":
        return dict(zip(_PARAMETERS, node.args)) | node.kwargs
    return None


def _small(node: Node) -> tuple[Node, int] | None:
    """(input, k) of a topk call the pass rewrites, else None."""
    arguments = _arguments(node)
    if arguments is None or set(arguments) - set(_PARAMETERS) or arguments.get("largest", True) is not True:
        return None
    x, k = arguments["input"], arguments["k"]
    example = x.meta.get("example_value") if isinstance(x, Node) else None
    if (not isinstance(example, torch.Tensor) or not isinstance(k, int) or k > TOP_K_MAX_K
            or not example.dtype.is_floating_point):
        return None
    width = example.shape[-1] if example.dim() else None
    small = (isinstance(width, int) and width <= TOP_K_MAX_WIDTH and arguments.get("dim", -1) in (-1, example.dim() - 1)
             and all(user.op == "call_function" and user.target is operator.getitem for user in node.users))
    return (x, k) if small else None


_SOFTMAX_FUNCTIONS = (torch.nn.functional.softmax, torch.softmax)


def _only_use(node: Node) -> bool:
    return len(node.users) == 1


def _top_k_arguments(x: Node, k: int) -> tuple[tuple, list[Node]]:
    """dflash::top_k's arguments for the topk of x, and the nodes they fold: a softmax over the last dimension whose
    only use is the topk, with an fp32 cast of a floating-point input (Mixtral's `softmax(logits.float())`) whose
    only use is the softmax (the kernel computes in fp32 whatever it reads); none else."""
    if not (x.op == "call_function" and x.target in _SOFTMAX_FUNCTIONS or x.op == "call_method"
            and x.target == "softmax") or not _only_use(x) or not isinstance(x.args[0], Node):
        return (x, k), []
    output, source = x.meta["example_value"], x.args[0]
    if x.kwargs.get("dim", x.args[1] if len(x.args) > 1 else None) not in (-1, output.dim() - 1):
        return (x, k), []
    if (source.op == "call_method" and source.target == "float" and len(source.args) == 1 and _only_use(source)
            and source.args[0].meta["example_value"].is_floating_point()):
        return (source.args[0], k, output.dtype), [x, source]
    return (source, k, output.dtype), [x]


def _is_row_sum_of(node: Node, values: Node) -> bool:
    """Whether node is values.sum(dim=-1, keepdim=True)."""
    return (node.op == "call_method" and node.target == "sum" and node.args == (values,)
            and node.kwargs == {"dim": -1, "keepdim": True})


def _values_tail(values: Node) -> tuple[dict, Node, list[Node]]:
    """What follows a router's chosen values (`values`: the topk's values) that dflash::top_k computes in its launch:
    a renormalization by their sum (`/=` or `/`; Qwen3-MoE's and OLMoE's norm_topk_prob, Mixtral, Qwen3.5-MoE), then
    a cast to a dtype (Qwen3-MoE's, OLMoE's and Qwen3.5-MoE's to the logits' dtype), each optional. Returns top_k's
    keyword arguments for them, the node whose uses take the values instead, and the nodes folded."""
    end, folded, arguments = values, [], {}
    users = list(values.users)
    summed = next((user for user in users if _is_row_sum_of(user, values)), None)
    if summed is not None and len(users) == 2 and _only_use(summed):
        divided = next(iter(summed.users))
        if (divided in users and divided.op == "call_function" and divided.args == (values, summed)
                and divided.target in (operator.truediv, operator.itruediv)):
            end, folded, arguments = divided, [summed, divided], {"renormalize": True}
    cast = next(iter(end.users)) if _only_use(end) else None
    if (cast is not None and cast.op == "call_method" and cast.target == "to" and len(cast.args) == 2
            and isinstance(cast.args[1], torch.dtype) and cast.args[1].is_floating_point and not cast.kwargs):
        end, folded, arguments = cast, folded + [cast], arguments | {"values_dtype": cast.args[1]}
    return arguments, end, folded


def small_top_k(gm: GraphModule, ctx: PassContext) -> int:
    matches = [(node, match) for node in gm.graph.nodes if (match := _small(node)) is not None]
    for node, (x, k) in matches:
        arguments, folded = _top_k_arguments(x, k)
        values = [user for user in node.users if user.args[1] == 0]  # one reader of the values, or no tail
        values = values[0] if len(values) == 1 else None
        tail, end, tail_folded = _values_tail(values) if values is not None else ({}, None, [])
        with gm.graph.inserting_before(node):
            top_k = gm.graph.call_function(torch.ops.dflash.top_k.default, arguments, tail)
        top_k.meta.update(node.meta)
        if tail:  # the values now come out as the tail left them
            values.meta["example_value"] = end.meta["example_value"]
            top_k.meta["example_value"] = (end.meta["example_value"], node.meta["example_value"][1])
            end.replace_all_uses_with(values)
        node.replace_all_uses_with(top_k)
        for erased in [*reversed(tail_folded), node, *folded]:
            gm.graph.erase_node(erased)
    return len(matches)
