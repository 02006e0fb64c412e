"""One decode / verify attention layer: `dflash::decode_attention`'s Triton kernel (kernels/decode_attention.py,
one launch split over the cache's slots) against the torch math it replaced on CUDA (`attention.folded_attention`
under torch.compile: a QK^T GEMM, a softmax and a PV GEMM over the whole score matrix), each in a CUDA graph.

    python bench/decode_attention.py                      # H200: gpt-oss-20b (sinks) and Qwen3-30B-A3B layers
    python bench/decode_attention.py --slots 512 4096 --tokens 1 16

The mask shows the first half of the slots plus the new tokens causally, as a decode step's additive mask over the
cache's capacity.
"""

from __future__ import annotations

import argparse

import torch
import triton

from dflash_compile.attention import folded_attention
from dflash_compile.cache import additive_mask

SHAPES = {"gpt-oss-20b": (64, 8, 64, True), "qwen3-30b-a3b": (32, 4, 128, False)}  # heads, kv heads, d, sinks


def inputs(shape: str, tokens: int, slots: int):
    heads, kv_heads, d, has_sinks = SHAPES[shape]
    query = torch.randn(1, tokens, heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    key, value = (torch.randn(1, kv_heads, slots, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    visible = torch.arange(slots, device="cuda") <= slots // 2 + torch.arange(tokens, device="cuda")[:, None]
    mask = additive_mask(visible[None], torch.bfloat16)
    sinks = torch.randn(heads, device="cuda", dtype=torch.bfloat16) if has_sinks else None
    return query, key, value, mask, sinks, d ** -0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument("--slots", nargs="+", type=int, default=[512, 1024, 4096, 8192])
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print("| shape | tokens | slots | compiled torch math us | decode_attention us | speed-up | max difference |")
    print("|---|---|---|---|---|---|---|")
    compiled = torch.compile(folded_attention)
    for shape in args.shapes:
        for tokens in args.tokens:
            for slots in args.slots:
                tensors = inputs(shape, tokens, slots)
                sides = (lambda: compiled(*tensors), lambda: torch.ops.dflash.decode_attention(*tensors))
                times = [triton.testing.do_bench_cudagraph(side) * 1e3 for side in sides]
                difference = (sides[0]().float() - sides[1]().float()).abs().max().item()
                print(f"| {shape} | {tokens} | {slots} | {times[0]:.1f} | {times[1]:.1f} | "
                      f"{times[0] / times[1]:.2f}x | {difference:.1e} |", flush=True)


if __name__ == "__main__":
    main()
