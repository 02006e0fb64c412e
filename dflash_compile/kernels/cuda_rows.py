"""One token's MoE layer as CUDA C++ kernels on the CUDA cores (csrc/moe_rows_cuda.cu), for the `fused_moe` calls
they cover: bf16 activations, resident experts, on a compute capability 9.0 GPU (Hopper: programmatic dependent
launch), in three layouts: gpt-oss's MXFP4 (gate and up rows interleaved, clamped SwiGLU, biases, top-4), MXFP4 of
SiLU families as `quantize` writes them (gate rows then up rows, no biases, top-2, 4 or 8), both with K up to 128
groups of 32; and Qwen3-FP8's 128 x 128 block-scaled FP8 (gate rows then up rows, SiLU, top-8, H <= 4096, I <= 2048).

Every lane of a warp reads its own 16-byte pieces of a row and decodes them in registers, the activations staged
once per CTA in shared memory: none of the Triton row path's per-step staging and barriers. On an H100 a
gpt-oss-20b layer took 26.7 us against the Triton path's 31.0 (66% of the copy bandwidth), a SiLU MXFP4 one of
Qwen3-30B-A3B's shape 14.3 against 18.3, a Qwen3-30B-A3B-FP8 one 18.4 against 20.6 (docs/benchmarks.md, session 60;
tests/kernels/test_cuda_rows.py passes there). On the H200 (session 69; session 58's versions of the same design ran
0.87-0.98x of Triton there) 24.3 against 27.4 us, 13.2 against 17.7 and 16.1 against 17.8. So they run by default on
the GPUs of `FASTER_ON`, where they were measured faster; elsewhere only with DFLASH_CUDA_ROWS=1, and never with
DFLASH_CUDA_ROWS=0.

Compiled once per machine and torch version on first use with `torch.utils.cpp_extension.load` (nvcc and a CUDA
build of torch; cached in TORCH_EXTENSIONS_DIR), as the CPU kernels are (`kernels.cpu`); without them the Triton
kernels run, and `status()` says why.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path

import torch

from ..packed import PackedWeight
from . import build_extension

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "moe_rows_cuda.cu"
MXFP4_TOP_K, MXFP4_SILU_TOP_K, FP8_TOP_K = 4, (2, 4, 8), 8  # routed experts per token: gpt-oss; SiLU; Qwen3-FP8
MAX_GROUPS = 128  # MXFP4: 32-code groups a row may have, up to four a lane
# GPUs (in the device name) where they beat the Triton kernels (docs/benchmarks.md, sessions 60-64 and 69)
FASTER_ON = ("H100", "H200")
SETTINGS = ("0", "1", "auto")  # DFLASH_CUDA_ROWS: off, on (any Hopper GPU), on where FASTER_ON (the default)
FP8_MAX_HIDDEN, FP8_MAX_INTER = 4096, 2048  # FP8: up to 8 and 4 16-byte chunks per lane
_failure: str | None = None


@functools.cache
def load():
    """The compiled module, or None (with `status()` saying why): turned off, no CUDA Hopper GPU, a GPU they are not
    faster on (unless asked for), or no build."""
    global _failure
    setting = os.environ.get("DFLASH_CUDA_ROWS", "auto")
    if setting not in SETTINGS:
        raise ValueError(f"DFLASH_CUDA_ROWS={setting!r}: use 1 (the CUDA row kernels on), 0 (off) or auto (on the "
                         f"GPUs they are faster on: {', '.join(FASTER_ON)})")
    if setting == "0":
        _failure = "off (DFLASH_CUDA_ROWS=0)"
        return None
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        _failure = "they need a GPU of compute capability 9.0 (H100, H200)"
        return None
    name = torch.cuda.get_device_name()
    if setting == "auto" and not any(faster in name for faster in FASTER_ON):
        _failure = (f"off on the {name}: measured faster than the Triton kernels only on the {', '.join(FASTER_ON)} "
                    "(DFLASH_CUDA_ROWS=1 turns them on)")
        return None
    if not SOURCE.exists():
        _failure = f"source not found ({SOURCE}): install from a source checkout"
        return None
    # the kernels live in the header: its hash among the flags rebuilds the cached module when it changes
    kernels = hashlib.sha1(SOURCE.with_suffix(".cuh").read_bytes()).hexdigest()[:16]
    module, _failure = build_extension(name="dflash_cuda_rows", sources=[str(SOURCE)], verbose=False,
                                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a",
                                                          f"-DDFLASH_KERNELS={kernels}"])
    if _failure is not None and setting == "1":  # asked for, but no nvcc / ninja, or a build error
        warnings.warn(f"dflash CUDA row kernels unavailable ({_failure}); one-token layers run the Triton kernels",
                      stacklevel=2)
    return module


def status() -> str:
    """One line for reports: whether one-token layers run the CUDA C++ kernels."""
    return "CUDA row kernels loaded" if load() is not None else f"CUDA row kernels unused: {_failure}"


def covers(hidden: torch.Tensor, top_k_index: torch.Tensor, gate_up: PackedWeight, down: PackedWeight,
           interleaved: bool, activation: str) -> bool:
    """Whether a `fused_moe` call (one bf16 token, resident experts, no tile overrides) is one these kernels run,
    and they are on: a layout of `LAYOUTS` (gpt-oss's or SiLU MXFP4, Qwen3-FP8)."""
    if not (hidden.is_cuda and hidden.dtype == torch.bfloat16 and top_k_index.shape[0] == 1
            and all(w.format == gate_up.format and w.data.is_cuda
                    and all(t.is_contiguous() for t in (w.data, w.scales, w.bias) if t is not None)
                    for w in (gate_up, down))):
        return False
    layout = LAYOUTS.get(gate_up.format)
    return layout is not None and layout(top_k_index, gate_up, down, interleaved, activation) and load() is not None


def _mxfp4_layout(top_k_index, gate_up, down, interleaved, activation) -> bool:
    """gpt-oss (top-4, interleaved gate/up rows, clamped SwiGLU, bf16 biases) or gate rows then up rows with SiLU
    and no biases (`quantize`'s MXFP4 of Qwen3-MoE, OLMoE, Mixtral: top-2, 4 or 8); rows of at most 128 groups (K <=
    4096), fewer than 2^31 groups in all (the kernels index them in 32 bits)."""
    weights = (gate_up, down)
    gpt_oss = (top_k_index.shape[1] == MXFP4_TOP_K and interleaved and activation == "clamped_swiglu"
               and all(w.bias is not None and w.bias.dtype == torch.bfloat16 for w in weights))
    silu = (top_k_index.shape[1] in MXFP4_SILU_TOP_K and not interleaved and activation == "silu"
            and all(w.bias is None for w in weights))
    return (gpt_oss or silu) and all(w.data.shape[2] <= MAX_GROUPS and w.data.numel() // 16 < 2**31 for w in weights)


def _fp8_layout(top_k_index, gate_up, down, interleaved, activation) -> bool:
    """Qwen3-FP8 (GLM-4.5-Air-FP8 alike): top-8, gate rows then up rows, SiLU, no biases, H <= 4096 and I <= 2048
    in whole 16-byte chunks."""
    hidden, inter = gate_up.data.shape[2], down.data.shape[2]
    return (top_k_index.shape[1] == FP8_TOP_K and not interleaved and activation == "silu"
            and gate_up.bias is None and down.bias is None and hidden % 16 == 0 and inter % 16 == 0
            and hidden <= FP8_MAX_HIDDEN and inter <= FP8_MAX_INTER
            and all(w.scales.dtype == torch.float32 for w in (gate_up, down)))


LAYOUTS = {"mxfp4": _mxfp4_layout, "fp8_block": _fp8_layout}  # format -> whether a call has the kernels' layout


def one_token_moe(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  gate_up: PackedWeight, down: PackedWeight, interleaved: bool, alpha: float, limit: float,
                  paired_shift: int) -> torch.Tensor:
    """`fused_moe` of one token on the CUDA row kernels (`covers` said yes): [1, H] bf16 out. `paired_shift`: the
    power of two that keeps clamped SwiGLU's outputs in fp16 between the MXFP4 launches (`moe._paired_shift`)."""
    x = hidden.contiguous()
    if x.data_ptr() % 16:  # the kernels read the activations 16 bytes at a time
        x = x.clone()
    index = top_k_index.reshape(-1).to(torch.int64).contiguous()  # torch.topk's already: no copy
    weights = top_k_weights.reshape(-1).contiguous()  # fp32 or bf16, read as they are
    if weights.dtype not in (torch.float32, torch.bfloat16):
        weights = weights.float()
    if gate_up.format == "fp8_block":
        return load().fp8_one_token(x, gate_up.data, gate_up.scales, down.data, down.scales, index, weights)
    if not interleaved:
        return load().mxfp4_silu_one_token(x, gate_up.data, gate_up.scales, down.data, down.scales, index, weights)
    return load().mxfp4_one_token(x, gate_up.data, gate_up.scales, gate_up.bias, down.data, down.scales, down.bias,
                                  index, weights, float(alpha), float(limit), int(paired_shift))
