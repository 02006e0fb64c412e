"""`align_routing` (the grouping of (token, expert) pairs into one-expert blocks before a fused MoE launch at M > 1)
on decode, verify and prefill sizes (H200): microseconds per call as CUDA-graph replays of 20 calls, optionally next
to another version of dflash_compile/kernels/moe.py on the same routing, whose blocks must hold the same experts.

    python bench/align_routing.py
    python bench/align_routing.py --baseline old_moe.py   # e.g. git show REV:dflash_compile/kernels/moe.py > old_moe.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_compile.kernels.moe import TILES, align_routing  # noqa: E402
from moe_kernels import load_baseline, random_routing  # noqa: E402

CASES = [(8, 4, 32), (16, 4, 32), (8, 8, 128), (16, 8, 128), (16, 8, 256), (64, 8, 128), (512, 8, 128)]  # T, k, E


def call_us(align, index, experts: int, block_m: int) -> float:
    return triton.testing.do_bench_cudagraph(lambda: [align(index, experts, block_m) for _ in range(20)]) * 1e3 / 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another moe.py whose align_routing to time beside")
    args = parser.parse_args()
    baseline = load_baseline(args.baseline).align_routing if args.baseline else None
    block_m = TILES["fp8_block"]["block_m"]
    print("| tokens | top-k | experts | us | baseline us | speedup | same blocks |\n|---|---|---|---|---|---|---|")
    for tokens, top_k, experts in CASES:
        index = random_routing(tokens, experts, top_k)
        us = call_us(align_routing, index, experts, block_m)
        if baseline is None:
            print(f"| {tokens} | {top_k} | {experts} | {us:.1f} | | | |")
            continue
        same = torch.equal(align_routing(index, experts, block_m)[1], baseline(index, experts, block_m)[1])
        old_us = call_us(baseline, index, experts, block_m)
        print(f"| {tokens} | {top_k} | {experts} | {us:.1f} | {old_us:.1f} | {old_us / us:.2f}x | {same} |")


if __name__ == "__main__":
    main()
