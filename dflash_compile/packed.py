"""Packed expert weights: one 3-D expert weight [E, N, K] (output-major, like nn.Linear and both checkpoint formats)
kept in its stored format. The layout is data; the kernels in `kernels/moe.py` read it.

    mxfp4      data uint8 [E, N, K/32, 16] (two E2M1 codes per byte, low nibble first), scales uint8 [E, N, K/32]
    fp8_block  data uint8 [E, N, K] (float8_e4m3fn bytes), scales fp32 [E, ceil(N/128), ceil(K/128)]
    dense      data [E, N, K] in bf16 / fp16 / fp32, no scales
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from .families import first_projection
from .quant import MXFP4_GROUP, dequantize_fp8_block, dequantize_mxfp4, quantize_fp8_block, quantize_mxfp4

Format = Literal["mxfp4", "fp8_block", "dense"]
FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class PackedWeight:
    format: Format
    data: torch.Tensor
    scales: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # [E, N], kept in its own dtype

    def __post_init__(self):
        experts, rows = self.data.shape[:2]
        expected = {
            "mxfp4": lambda: [experts, rows, self.data.shape[2]],
            "fp8_block": lambda: [experts, *(-(-n // b) for n, b in zip(self.data.shape[1:], FP8_BLOCK))],
            "dense": lambda: None,
        }[self.format]()
        actual = list(self.scales.shape) if self.scales is not None else None
        if actual != expected:
            raise ValueError(f"{self.format} expert weight {list(self.data.shape)} needs scales {expected}, got "
                             f"{actual}")
        if self.format == "mxfp4" and (self.data.ndim != 4 or self.data.shape[3] != MXFP4_GROUP // 2):
            raise ValueError(f"mxfp4 expert blocks must be uint8 [E, N, K/32, 16], got {list(self.data.shape)}")
        if self.bias is not None and list(self.bias.shape) != [experts, rows]:
            raise ValueError(f"expert bias must be [E, N] = {[experts, rows]}, got {list(self.bias.shape)}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(experts, N out, K in)."""
        experts, rows = self.data.shape[:2]
        columns = self.data.shape[2] * MXFP4_GROUP if self.format == "mxfp4" else self.data.shape[2]
        return experts, rows, columns

    def select(self, experts) -> PackedWeight:
        """The same weight restricted to `experts` (a list or index tensor), in that order."""
        index = torch.as_tensor(experts, device=self.data.device)
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return PackedWeight(self.format, self.data[index], pick(self.scales), pick(self.bias))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.bias) if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference [E, N, K] weight (pure PyTorch, the definition the kernels are tested against), decoded an
        expert at a time into the result: the decode's fp32 scratch is a few copies of one expert's."""
        if self.format == "dense":
            return self.data.to(dtype)
        out = torch.empty(self.shape, dtype=dtype, device=self.data.device)
        for expert, (data, scales) in enumerate(zip(self.data, self.scales)):
            if self.format == "mxfp4":
                out[expert] = dequantize_mxfp4(data, scales, dtype)
            else:
                out[expert] = dequantize_fp8_block(data.view(torch.float8_e4m3fn), scales, FP8_BLOCK, dtype)
        return out

    @classmethod
    def quantize(cls, weight: torch.Tensor, format: Format, bias: torch.Tensor | None = None) -> PackedWeight:
        """Pack an [E, N, K] weight (any float dtype) with the format's own rounding rules, an expert at a time: the
        rounding's fp32 scratch is a few copies of one expert, where a whole layer's (gpt-oss-120b's gate/up: 2.1G
        weights, ~64 GiB at the ~32 bytes a weight that rounding a whole layer took) would not fit beside the model."""
        if format == "dense":
            return cls("dense", weight, None, bias)
        quantizer = quantize_mxfp4 if format == "mxfp4" else partial(quantize_fp8_block, block=FP8_BLOCK)
        parts = [quantizer(w) for w in weight]
        data = torch.stack([d.view(torch.uint8) for d, _ in parts])  # float8_e4m3fn bytes as uint8; MXFP4's as they are
        return cls(format, data, torch.stack([s for _, s in parts]), bias)


PACKED_IMPLEMENTATION = "dflash_packed"  # transformers experts_implementation that runs packed weights
_PARTS = ("data", "scales", "bias")


def attach_packed(module: torch.nn.Module, gate_up: PackedWeight, down: PackedWeight) -> None:
    """Give a transformers experts module packed weights in place of its 3-D parameters.

    The packed tensors become buffers (so `.to()` moves them and `expert_dispatch` drops them from the graph) and the
    shared config's experts implementation becomes `dflash_packed`, whose forward runs `dflash::packed_moe`.
    """
    if gate_up.format != down.format:
        raise ValueError(f"gate_up is {gate_up.format} but down is {down.format}: one format per experts module")
    first = first_projection(module)
    for name in (first, "down_proj", f"{first}_bias", "down_proj_bias"):
        module._parameters.pop(name, None)
    for prefix, weight in (("gate_up", gate_up), ("down", down)):
        for part in _PARTS:
            module.register_buffer(f"packed_{prefix}_{part}", getattr(weight, part))
    module.packed_format = gate_up.format
    module.config._experts_implementation = PACKED_IMPLEMENTATION


def packed_weights(module: torch.nn.Module) -> tuple[PackedWeight, PackedWeight]:
    """The (gate_up, down) packed weights of a module prepared by `attach_packed`, as its buffers are now."""
    return tuple(PackedWeight(module.packed_format, *(getattr(module, f"packed_{prefix}_{part}") for part in _PARTS))
                 for prefix in ("gate_up", "down"))


def expert_weights(module: torch.nn.Module) -> tuple[PackedWeight, PackedWeight]:
    """(gate_up, down) of an experts module as output-major PackedWeights: its packed buffers, or its 3-D
    parameters (transposed back where the family stores [E, in, out]) as "dense" ones with their biases; "gate_up"
    is `up_proj` for experts without a gate."""
    if getattr(module, "packed_format", None):
        return packed_weights(module)

    def dense(name: str) -> PackedWeight:
        weight = getattr(module, name).detach()
        bias = getattr(module, f"{name}_bias").detach() if module.has_bias else None
        return PackedWeight("dense", weight.transpose(1, 2) if module.is_transposed else weight, None, bias)

    return dense(first_projection(module)), dense("down_proj")
