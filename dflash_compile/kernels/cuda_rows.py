"""One token's MXFP4 MoE layer as CUDA C++ kernels on the CUDA cores (csrc/moe_rows_cuda.cu), for `fused_moe`'s
calls it covers: gpt-oss's layout (gate and up rows interleaved, clamped SwiGLU, biases), top-4, resident experts,
bf16 activations, K up to 96 groups of 32, on a compute capability 9.0 GPU (Hopper: programmatic dependent launch).

Every lane of a warp reads its own 32-code groups of a row as 16-byte loads and decodes them in registers, the
activations staged once per CTA in shared memory: none of the Triton row path's per-step staging and barriers. On
the H100 a gpt-oss-20b layer took 25.4 us against the Triton path's 31.4 (69% of the copy bandwidth against 56%,
bench/probe_cuda_rows.py, docs/benchmarks.md session 58). Off unless DFLASH_CUDA_ROWS=1 until it has been measured
on the H200 and run by the GPU tests (tests/kernels/test_cuda_rows.py).

Compiled once per machine and torch version on first use with `torch.utils.cpp_extension.load` (nvcc and a CUDA
build of torch; cached in TORCH_EXTENSIONS_DIR), as the CPU kernels are (`kernels.cpu`); without them the Triton
kernels run, and `status()` says why.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

from ..packed import PackedWeight

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "moe_rows_cuda.cu"
TOP_K = 4  # the kernels' routed experts per token (gpt-oss)
MAX_GROUPS = 96  # 32-code groups a row may have: three per lane
_failure: str | None = None


@functools.cache
def load():
    """The compiled module, or None (with `status()` saying why): off, no CUDA Hopper GPU, or no build."""
    global _failure
    if os.environ.get("DFLASH_CUDA_ROWS", "0") != "1":
        _failure = "off (DFLASH_CUDA_ROWS=1 turns them on)"
        return None
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        _failure = "they need a GPU of compute capability 9.0 (H100, H200)"
        return None
    if not SOURCE.exists():
        _failure = f"source not found ({SOURCE}): install from a source checkout"
        return None
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(name="dflash_cuda_rows", sources=[str(SOURCE)],
                                  extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)
    except (RuntimeError, OSError, ImportError) as error:  # no nvcc / ninja, or a build error
        _failure = f"build failed: {str(error).strip().splitlines()[-1] if str(error).strip() else error!r}"
        warnings.warn(f"dflash CUDA row kernels unavailable ({_failure}); one-token MXFP4 layers run the Triton "
                      "kernels", stacklevel=2)
        return None


def status() -> str:
    """One line for reports: whether one-token MXFP4 layers run the CUDA C++ kernels."""
    return "CUDA row kernels loaded" if load() is not None else f"CUDA row kernels unused: {_failure}"


def covers(hidden: torch.Tensor, top_k_index: torch.Tensor, gate_up: PackedWeight, down: PackedWeight,
           interleaved: bool, activation: str) -> bool:
    """Whether a `fused_moe` call (resident experts, no tile overrides) is one these kernels run, and they are on."""
    weights = (gate_up, down)
    return (hidden.is_cuda and hidden.dtype == torch.bfloat16 and tuple(top_k_index.shape) == (1, TOP_K)
            and interleaved and activation == "clamped_swiglu"
            and all(w.format == "mxfp4" and w.data.is_cuda and w.bias is not None and w.bias.dtype == torch.bfloat16
                    and w.data.shape[2] <= MAX_GROUPS and all(t.is_contiguous() for t in (w.data, w.scales, w.bias))
                    for w in weights)
            and load() is not None)


def one_token_moe(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  gate_up: PackedWeight, down: PackedWeight, alpha: float, limit: float,
                  paired_shift: int) -> torch.Tensor:
    """`fused_moe` of one token on the CUDA row kernels (`covers` said yes): [1, H] bf16 out. `paired_shift`: the
    power of two that keeps clamped SwiGLU's outputs in fp16 between the launches (`moe._paired_shift`)."""
    x = hidden.contiguous()
    if x.data_ptr() % 16:  # the kernel reads the activations 16 bytes at a time
        x = x.clone()
    return load().mxfp4_one_token(
        x, gate_up.data, gate_up.scales, gate_up.bias, down.data, down.scales, down.bias,
        top_k_index.reshape(-1).to(torch.int64).contiguous(), top_k_weights.reshape(-1).float().contiguous(),
        float(alpha), float(limit), int(paired_shift))
