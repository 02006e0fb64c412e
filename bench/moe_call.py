"""One fused MoE call on a benchmark shape, nothing else: a target for a profiler (H200).

    ncu -k regex:_moe_gemm -c 2 --section SpeedOfLight --section LaunchStats --section Occupancy \
        python3 bench/moe_call.py --shape qwen3-30b-a3b-fp8 --tokens 1

Random packed weights and routing as in bench/moe_kernels.py; the call runs twice (the first compiles), so a
profiler that counts launches sees gate/up, down and the pair sum of the first call first.
"""

from __future__ import annotations

import argparse

import torch

from moe_kernels import SHAPES, random_packed, random_routing
from dflash_compile.kernels.moe import fused_moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gpt-oss-20b", choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=1)
    args = parser.parse_args()
    experts, top_k, hidden, inter, format, gpt_oss = SHAPES[args.shape]
    gate_up = random_packed(format, experts, 2 * inter, hidden, gpt_oss)
    down = random_packed(format, experts, hidden, inter, gpt_oss)
    index = random_routing(args.tokens, experts, top_k)
    weights = torch.softmax(torch.randn(args.tokens, top_k, device="cuda"), dim=-1)
    x = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        fused_moe(x, index, weights, gate_up, down, interleaved=gpt_oss,
                  activation="clamped_swiglu" if gpt_oss else "silu")
    torch.cuda.synchronize()
    print(f"{args.shape}, {args.tokens} tokens: done")


if __name__ == "__main__":
    main()
