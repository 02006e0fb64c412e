"""The C++ CPU MoE kernel (csrc/moe_cpu.cpp) against the PyTorch reference (dequantize each routed expert, fp32
matmuls) on real layer shapes, random routing, on this machine's CPU.

    python bench/moe_cpu.py                          # gpt-oss-20b MXFP4 and Qwen3-30B-A3B FP8 layers, M = 1 4 16
    python bench/moe_cpu.py --bf16                   # the same layers' bf16 experts as transformers stores them
    python bench/moe_cpu.py --dense --tokens 1 8 64 256   # FP8 dense layers (dflash::fp8_block_linear) instead

Prints microseconds per layer (median of --repeats after a warm-up), the routed experts' packed bytes read, GB/s,
and the speed-up; both outputs are compared (relative difference).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_compile.benchmark import timed  # noqa: E402
from dflash_compile.expert_store import Gate, reference_packed, run_packed  # noqa: E402
from dflash_compile.kernels import cpu  # noqa: E402
from dflash_compile.packed import PackedWeight  # noqa: E402
from moe_kernels import SHAPES, random_packed  # noqa: E402


def bf16_as_stored(weight: PackedWeight, gpt_oss: bool) -> PackedWeight:
    """`weight`'s values as transformers keeps bf16 experts: gpt-oss [E, in, out], read through a transposed view
    (input-major), the other families [E, out, in]."""
    values = weight.dequantize(torch.bfloat16)
    values = values.transpose(1, 2).contiguous().transpose(1, 2) if gpt_oss else values.contiguous()
    return PackedWeight("dense", values, None, weight.bias)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["gpt-oss-20b", "qwen3-30b-a3b-fp8"], choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bf16", action="store_true", help="bf16 experts as transformers stores them instead")
    parser.add_argument("--dense", action="store_true", help="FP8 dense layers (DENSE_SHAPES) instead of MoE layers")
    args = parser.parse_args()
    print(cpu.status(), f"| {torch.get_num_threads()} threads | torch {torch.__version__}")
    if args.dense:
        return dense_layers(args.tokens, args.repeats)
    print("| shape | M | experts read | MB | C++ us | GB/s | reference us | speed-up | rel. difference |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        experts, top_k, hidden, inter, format, gpt_oss = SHAPES[name]
        torch.manual_seed(0)
        gate_up = random_packed(format, experts, 2 * inter, hidden, gpt_oss, device="cpu")
        down = random_packed(format, experts, hidden, inter, gpt_oss, device="cpu")
        if args.bf16:
            gate_up, down, format = bf16_as_stored(gate_up, gpt_oss), bf16_as_stored(down, gpt_oss), "bf16"
        gate = Gate(gpt_oss, "clamped_swiglu" if gpt_oss else "silu")
        per_expert = (gate_up.nbytes() + down.nbytes()) / experts
        for tokens in args.tokens:
            generator = torch.Generator().manual_seed(tokens)
            index = torch.rand(tokens, experts, generator=generator).argsort(dim=1)[:, :top_k]
            weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1)
            x = torch.randn(tokens, hidden, generator=generator)
            fast, fast_s = timed(lambda: run_packed(x, index, weights, gate_up, down, gate), args.repeats)
            slow, slow_s = timed(lambda: reference_packed(x, index, weights, gate_up, down, gate), args.repeats)
            moved = index.unique().numel() * per_expert
            difference = ((fast - slow).norm() / slow.norm()).item()
            print(f"| {name} {format} | {tokens} | {index.unique().numel()} | {moved / 1e6:.1f} | {fast_s * 1e6:.0f} | "
                  f"{moved / fast_s / 1e9:.2f} | {slow_s * 1e6:.0f} | {slow_s / fast_s:.1f}x | {difference:.1e} |",
                  flush=True)


DENSE_SHAPES = {"deepseek-v3 q_a_proj": (1536, 7168), "qwen3-30b-a3b-fp8 q_proj": (4096, 2048),
                "deepseek-v3 dense down_proj": (7168, 18432)}  # name: (N, K), from bench/packed_linear.py


def dense_layers(token_counts: list[int], repeats: int) -> None:
    """`dflash::fp8_block_linear` (the C++ kernel) against the reference: the weight dequantized, then torch's
    linear."""
    print("| layer | M | MB | C++ us | GB/s | reference us | speed-up | rel. difference |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (n, k) in DENSE_SHAPES.items():
        weight = random_packed("fp8_block", 1, n, k, bias=False, device="cpu")
        data, scales = weight.data[0].view(torch.float8_e4m3fn), weight.scales[0]
        for tokens in token_counts:
            x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens))
            fast, fast_s = timed(lambda: torch.ops.dflash.fp8_block_linear(x, data, scales, None), repeats)
            slow, slow_s = timed(lambda: torch.nn.functional.linear(x, weight.dequantize()[0]), repeats)
            difference = ((fast - slow).norm() / slow.norm()).item()
            print(f"| {name} | {tokens} | {weight.nbytes() / 1e6:.1f} | {fast_s * 1e6:.0f} | "
                  f"{weight.nbytes() / fast_s / 1e9:.2f} | {slow_s * 1e6:.0f} | {slow_s / fast_s:.1f}x | "
                  f"{difference:.1e} |", flush=True)


if __name__ == "__main__":
    main()
