"""A router's choice of experts (`dflash::top_k`'s kernel, kernels/top_k.py) on the GPU: us per call in a CUDA graph,
against torch (topk; softmax then topk where the family takes probabilities) and optionally another version of the
kernels module, over every MoE family's router width and top-k, for decode and verify rows.

    python bench/top_k.py
    python bench/top_k.py --baseline old_top_k.py   # e.g. git show REV:dflash_compile/kernels/top_k.py > old_top_k.py
    python bench/top_k.py --warps 1 2 4             # the kernel's warps, each timed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_compile.kernels import top_k as kernels  # noqa: E402
from moe_kernels import load_baseline  # noqa: E402

# name: (experts, top-k, softmax first): each family's router (DeepSeek-V3 and GLM-4.5 choose by sigmoid scores)
ROUTERS = {"gpt-oss-20b": (32, 4, False), "mixtral-8x7b": (8, 2, True), "olmoe-1b-7b": (64, 8, True),
           "qwen3-30b-a3b": (128, 8, True), "qwen3.5-35b-a3b": (256, 8, True), "deepseek-v3": (256, 8, False)}


def us(call) -> float:
    return triton.testing.do_bench_cudagraph(call) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument("--baseline", type=Path, help="another kernels/top_k.py to time beside (its top_k(x, k))")
    parser.add_argument("--warps", nargs="+", type=int, default=[None],
                        help="the kernel's warps per program, each timed (default: kernels.TOP_K_WARPS' rule)")
    args = parser.parse_args()
    baseline = load_baseline(args.baseline).top_k if args.baseline else None
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print("| router | rows | torch us | baseline us | " + " | ".join(f"{w or 'rule'} warps us" for w in args.warps)
          + " | same experts |")
    print("|---|---|---|---|" + "---|" * len(args.warps) + "---|")
    for name, (experts, k, softmax) in ROUTERS.items():
        for rows in args.rows:
            logits = torch.randn(rows, experts, device="cuda", dtype=torch.bfloat16)
            dtype = torch.float32 if softmax else None

            def scores():  # torch's softmax where the family takes probabilities
                return torch.softmax(logits, -1, dtype=dtype) if softmax else logits

            def torch_choice():
                return torch.topk(scores(), k, dim=-1)

            def old_choice():  # the baseline's topk
                return baseline(scores(), k)

            rule, times = dict(kernels.TOP_K_WARPS), []
            for warps in args.warps:
                kernels.TOP_K_WARPS = dict.fromkeys(rule, warps) if warps else rule
                times.append(us(lambda: kernels.top_k(logits, k, dtype)))
            kernels.TOP_K_WARPS = rule
            # bf16 scores tie often; among equal values torch's order is its own, the chosen set is what routes
            chosen, expected = kernels.top_k(logits, k, dtype)[1], torch_choice()[1]
            same = torch.equal(chosen.sort(-1).values, expected.sort(-1).values)
            old = us(old_choice) if baseline else float("nan")
            print(f"| {name} | {rows} | {us(torch_choice):.1f} | {old:.1f} | "
                  + " | ".join(f"{t:.1f}" for t in times) + f" | {same} |", flush=True)


if __name__ == "__main__":
    main()
