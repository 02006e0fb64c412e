"""A stable, readable text form of an FX graph, for golden-graph tests and `explain()`.

One line per node: `%name: dtype[shape] = target(args)`. Targets get qualified names (no object addresses) and
Dynamo's placeholder names are shortened to the module path they come from
(`l_self_modules_experts_parameters_gate_up_proj_` -> `experts.gate_up_proj`, `l_input_ids_` -> `arg.input_ids`).
"""

from __future__ import annotations

import re

import torch
from torch.fx.node import Node, _get_qualified_name

_DTYPES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8",
}
_PLACEHOLDER_PARTS = (
    (r"^l_self_modules_", ""),  # the module's own parameters and buffers: a module path
    (r"_(modules|parameters|buffers)_", "."),
    (r"^l_", "arg."),  # a frame input (hidden states, input ids)
    (r"_$", ""),
)


def _placeholder_name(name: str) -> str:
    for pattern, replacement in _PLACEHOLDER_PARTS:
        name = re.sub(pattern, replacement, name)
    return name


def _names(graph: torch.fx.Graph) -> dict[Node, str]:
    return {n: _placeholder_name(n.name) if n.op == "placeholder" else n.name for n in graph.nodes}


def _value_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{_DTYPES.get(value.dtype, str(value.dtype))}[{', '.join(str(d) for d in value.shape)}]"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_value_type(v) for v in value) + ")"
    return type(value).__name__ if value is not None else ""


def _format_arg(arg, names: dict[Node, str]) -> str:
    if isinstance(arg, Node):
        return "%" + names[arg]
    if isinstance(arg, (tuple, list)):
        inner = ", ".join(_format_arg(a, names) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k!r}: {_format_arg(v, names)}" for k, v in arg.items()) + "}"
    return str(arg)


def _args(node: Node, names: dict[Node, str]) -> list[str]:
    args = [_format_arg(a, names) for a in node.args]
    if node.target is torch.ops.dflash.moe_dispatch.default:
        args[3] = "store"  # the expert store's id depends on how many models this process compiled before
    return args + [f"{k}={_format_arg(v, names)}" for k, v in node.kwargs.items()]


def _target(node: Node) -> str:
    if node.op == "call_method":
        return "." + node.target
    if node.op == "call_function":
        return _get_qualified_name(node.target).replace("_operator.", "operator.")
    return str(node.target)


def graph_text(gm: torch.fx.GraphModule) -> str:
    names = _names(gm.graph)
    lines = []
    for node in gm.graph.nodes:
        if node.op == "output":
            lines.append(f"return {_format_arg(node.args[0], names)}")
            continue
        meta = _value_type(node.meta.get("example_value", node.meta.get("val")))
        head = f"%{names[node]}" + (f": {meta}" if meta else "")
        if node.op == "placeholder":
            lines.append(f"{head} = input")
        elif node.op == "get_attr":
            lines.append(f"{head} = self.{node.target}")
        else:
            lines.append(f"{head} = {_target(node)}({', '.join(_args(node, names))})")
    return "\n".join(lines) + "\n"
