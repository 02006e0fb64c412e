"""Compiled steps replayed from plain CUDA graphs, one per call signature.

torch.compile's "reduce-overhead" mode (CUDA-graph trees) checks Dynamo's guards and the addresses of every graph
input (each parameter, each cache buffer) on every call: on the H200 0.77 ms of host time per gpt-oss-20b decode
step (24 layers, MXFP4 experts) and 1.33 ms per Qwen3-30B-A3B step (48 layers), which `generate` pays in full since
it reads every step's accepted counts before issuing the next. The same step compiled without CUDA graphs, captured
once in a `torch.cuda.CUDAGraph` and replayed, takes 0.03 / 0.08 ms of host time: 3.60 -> 2.95 ms and 6.51 -> 5.39
ms per synced step (`bench/step_overhead.py`, docs/benchmarks.md, session 31).

What Dynamo's guards would check on every call is checked here once per signature instead: the arguments' shapes,
dtypes and devices, the identity of their other objects (a cache, whose buffers the graph reads and writes in place),
and `state()`, what the function's code reads besides its arguments (sampling settings, the attention
implementation). So the caller must not change anything else the graph depends on between calls -- replace a
parameter tensor or a cache buffer -- without `clear()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch

log = logging.getLogger(__name__)


def _signature(arg) -> Hashable:
    """What a call's argument contributes to its graph's key: a tensor's shape, dtype and device (its values are
    copied in at each replay), None as itself, any other object by identity (the graph holds on to its tensors)."""
    if isinstance(arg, torch.Tensor):
        return "tensor", tuple(arg.shape), arg.dtype, arg.device
    return None if arg is None else ("object", id(arg))


class _Captured:
    """One call of `function` captured in a CUDA graph, over static copies of its tensor arguments."""

    def __init__(self, function: Callable, args: tuple):
        self.args = [arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args]  # holds the objects too
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = function(*self.args)

    def replay(self, args: tuple):
        for static, arg in zip(self.args, args):
            if isinstance(arg, torch.Tensor):
                static.copy_(arg)
        self.graph.replay()
        return self.outputs


class StepGraphs:
    """`function` (compiled without CUDA graphs) called through CUDA graphs captured per call signature.

    A signature's first call runs `function` itself: its compilation, and the warm-up a capture needs. The second
    captures it over static copies of the tensor arguments and replays; later calls copy their tensor arguments into
    those and replay. The returned tensors are the graph's own buffers, overwritten by its next replay, as under
    torch.compile's CUDA graphs. A signature whose capture fails runs `function` from then on."""

    def __init__(self, function: Callable, state: Callable[[], Hashable]):
        self.function, self.state = function, state
        self.graphs: dict[Hashable, _Captured] = {}
        self.failed: set[Hashable] = set()  # keys whose capture failed: they run `function`
        # each key's first arguments: the objects it names by identity stay alive (their ids are not reused)
        self.objects: dict[Hashable, tuple] = {}

    def __call__(self, *args):
        key = (self.state(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(), *map(_signature, args))
        if key not in self.objects:
            self.objects[key] = args
            return self.function(*args)
        captured = self.graphs.get(key)
        if captured is None and key not in self.failed:
            try:
                captured = self.graphs[key] = _Captured(self.function, args)
            except RuntimeError as error:
                self.failed.add(key)
                log.warning("running a compiled step without a CUDA graph: its capture failed (%s)", error)
        return self.function(*args) if captured is None else captured.replay(args)

    def clear(self) -> None:
        """Drop every graph and the objects the keys hold, e.g. when the cache they write is replaced."""
        self.graphs.clear()
        self.failed.clear()
        self.objects.clear()
