"""`explain(model, example_inputs)`: what the dflash passes did to each graph, and where Dynamo broke the graph."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch._dynamo.utils import counters

from .backend import GraphReport, compile_graph
from .families import adapt_model, experts_modules


@dataclass
class ExplainReport:
    graphs: list[GraphReport] = field(default_factory=list)
    graph_break_count: int = 0
    break_reasons: list[str] = field(default_factory=list)
    expert_placement: str = ""
    outputs: object = None  # what the compiled run returned (the rewritten graphs run eagerly)

    @property
    def matches(self) -> dict[str, int]:
        """Match count of every pass, summed over graphs."""
        total: dict[str, int] = {}
        for graph in self.graphs:
            for name, count in graph.matches.items():
                total[name] = total.get(name, 0) + count
        return total

    def __str__(self) -> str:
        lines = [
            f"graphs: {len(self.graphs)}, graph breaks: {self.graph_break_count}",
            "pass matches: " + ", ".join(f"{name}={count}" for name, count in self.matches.items()),
        ]
        lines += [f"  break: {reason}" for reason in self.break_reasons]
        if self.expert_placement:
            lines.append(f"routed experts: {self.expert_placement}")
        return "\n".join(lines)


def expert_placement(model: torch.nn.Module) -> str:
    """Where the routed experts live and in which format: resident, packed, or offloaded behind a slot pool."""
    if not isinstance(model, torch.nn.Module):  # explain() also takes functions, e.g. the verify step
        return ""
    modules = list(experts_modules(model).values())
    if not modules:
        return ""
    offload = getattr(model, "dflash_offload", None)
    if offload is not None:
        layer = offload.layers[0]
        pinned = f"layer(s) {offload.pinned_layers} pinned, " if offload.pinned_layers else ""
        return (f"{len(modules)} layers offloaded to host memory ({layer.format}, {layer.host.shape[1]} bytes per "
                f"expert), {offload.slots} slots on {offload.device} ({offload.pool_bytes / 2**20:.1f} MiB), "
                f"{offload.policy} cache managed on the {offload.manager}, {pinned}"
                f"prefetch {f'{offload.prefetch} layer(s) ahead' if offload.prefetch else 'off'}, "
                f"CPU compute of misses {offload.cpu_compute}")
    first = modules[0]
    packed = getattr(first, "packed_format", None)
    tensor = first.packed_gate_up_data if packed else first.down_proj
    size = sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))
    return (f"{len(modules)} layers resident on {tensor.device}, {packed or str(tensor.dtype).removeprefix('torch.')}"
            f", {size / 2**20:.1f} MiB")


def explain(model: torch.nn.Module, *example_inputs, options: dict | None = None, **example_kwargs) -> ExplainReport:
    """Compile `model` with the dflash passes (lowered eagerly, no Inductor), run it once on the example inputs and
    report pass match counts, graph breaks, each graph before and after the passes, and what the run returned."""
    if isinstance(model, torch.nn.Module):
        adapt_model(model)
    report = ExplainReport()
    options = {**(options or {}), "lowering": "eager"}
    backend = functools.partial(compile_graph, options=options, on_graph=report.graphs.append)
    breaks_before = dict(counters["graph_break"])
    with torch.no_grad():
        report.outputs = torch.compile(model, backend=backend, dynamic=False)(*example_inputs, **example_kwargs)
    report.expert_placement = expert_placement(model)
    for reason, count in counters["graph_break"].items():
        new = count - breaks_before.get(reason, 0)
        if new > 0:
            report.break_reasons.append(reason)
            report.graph_break_count += new
    return report
