"""Arrival counts for launches whose last program to arrive finishes the work of all of them (the fused MoE's pair
sum, `moe._sum_when_last`; the decode attention's merge, `decode_attention._split_kernel`): one zeroed int32 buffer
per device, which every such launch leaves zeroed. A fixed size, so that a CUDA graph captured over it never sees it
replaced (a launch needing more takes its separate finishing launch). One launch uses them at a time: the launches
of a device run on one stream, each waiting for the one before; launches on concurrent streams would share them.
"""

from __future__ import annotations

import torch

_COUNTS: dict[torch.device, torch.Tensor] = {}
SIZE = 1 << 16


def arrival_counts(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's arrival counts for a launch needing `needed` of them, or None: more than SIZE, or none made yet
    while a CUDA graph is being captured (zeroing them then would only be recorded)."""
    if needed > SIZE:  # before making any: a buffer made while a test shrinks SIZE would outlive the test
        return None
    counts = _COUNTS.get(device)
    if counts is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        counts = _COUNTS[device] = torch.zeros(SIZE, dtype=torch.int32, device=device)
    return counts


def make_arrival_counts(device: torch.device) -> None:
    """Make the device's arrival counts now, in eager code (the dflash backend does when it compiles a graph for the
    device). Made by the first one-token call instead, inside a compiled step's CUDA-graph warm-up
    ("reduce-overhead"), they came from the graph tree's private pool, outlived the run, and the step raised
    "tensor(s) in the cudagraph pool not tracked as outputs"."""
    arrival_counts(device, 0)
