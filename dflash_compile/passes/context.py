"""What a pass may know besides the graph: the modules the graph was traced from, and the expert store."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..expert_store import ExpertStore, store_for

# Dynamo names modules by the frame variable they were reached from: "L['self'].model.layers.0.mlp.experts", or
# "L['args'][0].model.layers.0.mlp.experts" when the traced frame is a decorator's wrapper.
_MODULE_PATH = re.compile(r"^(?P<scope>[LG])\['(?P<name>[^']+)'\](?P<indices>(\[\d+\])*)\.?(?P<rest>.*)$")


# How a linear layer's call appears in a Dynamo graph (nn.Linear's forward, or F.linear called directly).
LINEAR_CALLS = (torch._C._nn.linear, torch.nn.functional.linear)


@dataclass
class PassContext:
    frame_locals: dict
    frame_globals: dict
    example_inputs: list = field(default_factory=list)
    fused_experts: bool = True  # the backend option: resident experts dispatch to dflash's fused kernel

    @classmethod
    def from_dynamo(cls, example_inputs, fused_experts: bool = True) -> PassContext:
        """The context of the frame Dynamo is compiling right now (backends run inside that trace)."""
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        frame_locals, frame_globals = (tx.f_locals, tx.f_globals) if tx is not None else ({}, {})
        return cls(frame_locals, frame_globals, list(example_inputs), fused_experts)

    def resolve(self, path: str) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(root module, submodule) for a Dynamo module path. The root is the outermost nn.Module on the path
        (the model, also when the traced frame is a method of an object holding it); it owns the expert store."""
        match = _MODULE_PATH.match(path)
        scope = self.frame_locals if match and match["scope"] == "L" else self.frame_globals
        root = scope.get(match["name"]) if match else None
        for index in re.findall(r"\d+", match["indices"]) if match else ():
            root = root[int(index)] if isinstance(root, (list, tuple)) else None
        rest = match["rest"].split(".") if match and match["rest"] else []
        while root is not None and not isinstance(root, torch.nn.Module) and rest:
            root = getattr(root, rest.pop(0), None)
        if not isinstance(root, torch.nn.Module):
            raise RuntimeError(
                f"cannot find the module {path!r} that the graph was traced from; dflash passes run inside "
                "torch.compile(..., backend='dflash'), not on a detached graph"
            )
        return root, root.get_submodule(".".join(rest))

    def traced_root(self, graph: torch.fx.Graph) -> torch.nn.Module | None:
        """The outermost module the graph was traced from (the model, for torch.compile(model))."""
        for node in graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if stack:
                return self.resolve(next(iter(stack.values()))[0])[0]
        return None

    def store(self, root: torch.nn.Module) -> ExpertStore:
        return store_for(root)

    def input_values(self, graph: torch.fx.Graph) -> dict[torch.fx.Node, object]:
        """The real value behind each placeholder (a parameter, a buffer or a user input)."""
        return dict(zip([n for n in graph.nodes if n.op == "placeholder"], self.example_inputs))

    def input_value(self, node: torch.fx.Node):
        """The real value behind one placeholder (`input_values` for many)."""
        return self.input_values(node.graph)[node]
