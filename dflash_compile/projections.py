"""Linear layers that read one input, laid out in one buffer so that one GEMM serves them all.

`share_storage(model)` (run by `optimize`) moves each registry-named group of sibling `nn.Linear` layers (a
family's `FamilySpec.shared_input_linears`: q/k/v projections, an MLP's gate/up) into one contiguous weight
buffer, and their biases into one bias buffer: every parameter becomes a view of its rows, with the same values and
no extra memory. The `projection_fusion` pass then makes linear calls on one input whose weights are such adjacent
rows one linear over the whole buffer. At one token each projection is a GEMV of its own, most of them split-K
with a reduce kernel after it (gpt-oss-20b: ~13 kernels a layer for q, k, v, o and the router; session 31).

`save_pretrained` still writes each layer's weight as a tensor of its own (tests/test_projections.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .families import spec_for_model

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def rows_adjacent(tensors: list[torch.Tensor]) -> bool:
    """Whether the tensors are contiguous and lie one after another in one storage, in this order (so that one
    view of the storage holds them all, concatenated along dim 0)."""
    first = tensors[0]
    offset = first.storage_offset()
    for tensor in tensors:
        if (not tensor.is_contiguous() or tensor.storage_offset() != offset or tensor.dtype != first.dtype
                or tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return False
        offset += tensor.numel()
    return True


def _sharable(linears: list) -> bool:
    """Plain linear layers (not a quantized subclass) with float weights of one dtype, device and input width, and
    biases on all of them or none."""
    if not all(type(linear) is nn.Linear for linear in linears):
        return False
    weights = [linear.weight for linear in linears]
    biases = [linear.bias is not None for linear in linears]
    return (weights[0].dtype in _FLOATS and weights[0].device.type != "meta" and len(set(biases)) == 1
            and len({(w.dtype, w.device, w.shape[1]) for w in weights}) == 1)


def _concatenated(parameters: list[nn.Parameter]) -> None:
    """Give the parameters the rows of one new buffer, in order (same values)."""
    buffer = torch.cat([parameter.detach() for parameter in parameters])
    start = 0
    for parameter in parameters:
        parameter.data = buffer[start: start + parameter.shape[0]]
        start += parameter.shape[0]


@torch.no_grad()
def lay_out_together(linears: list) -> bool:
    """Put the linear layers' weights (and biases) in one buffer each, in this order; False where they cannot be
    (not all plain float `nn.Linear` of one input width, dtype and device, biases on some only) or already are."""
    if not _sharable(linears) or rows_adjacent([linear.weight for linear in linears]):
        return False
    _concatenated([linear.weight for linear in linears])
    if linears[0].bias is not None:
        _concatenated([linear.bias for linear in linears])
    return True


def share_storage(model: nn.Module) -> int:
    """Lay each of the family's groups of sibling linear layers out in one weight (and bias) buffer; returns how
    many groups it laid out (groups already laid out so, e.g. by an earlier `optimize`, are left as they are)."""
    spec = spec_for_model(model)
    groups = spec.shared_input_linears if spec else ()
    return sum(lay_out_together([getattr(module, name, None) for name in names])
               for module in model.modules() for names in groups)
