"""`explain(model, example_inputs)`: what the dflash passes did to each graph, and where Dynamo broke the graph."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch._dynamo.utils import counters

from .backend import GraphReport, compile_graph


@dataclass
class ExplainReport:
    graphs: list[GraphReport] = field(default_factory=list)
    graph_break_count: int = 0
    break_reasons: list[str] = field(default_factory=list)

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
        return "\n".join(lines)


def explain(model: torch.nn.Module, *example_inputs, options: dict | None = None, **example_kwargs) -> ExplainReport:
    """Compile `model` with the dflash passes (lowered eagerly, no Inductor), run it once on the example inputs and
    report pass match counts, graph breaks and each graph before and after the passes."""
    report = ExplainReport()
    options = {**(options or {}), "lowering": "eager"}
    backend = functools.partial(compile_graph, options=options, on_graph=report.graphs.append)
    breaks_before = dict(counters["graph_break"])
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=False)(*example_inputs, **example_kwargs)
    for reason, count in counters["graph_break"].items():
        new = count - breaks_before.get(reason, 0)
        if new > 0:
            report.break_reasons.append(reason)
            report.graph_break_count += new
    return report
