"""One decode / verify attention layer: `dflash::decode_attention`'s Triton kernel (kernels/decode_attention.py,
one launch split over the cache's slots) against the torch math it replaced on CUDA (`attention.folded_attention`
under torch.compile: a QK^T GEMM, a softmax and a PV GEMM over the whole score matrix), each in a CUDA graph.

    python bench/decode_attention.py                      # H200: gpt-oss-20b (sinks), Qwen3-30B-A3B, Qwen3.5 layers
    python bench/decode_attention.py --slots 512 4096 --tokens 1 16
    python bench/decode_attention.py --shapes qwen3-30b-a3b --tokens 8 16 --block-r 128 64 32   # rows per program
    python bench/decode_attention.py --filled 0.5 0.75 1.0   # the fraction of the capacity filled before the step

The mask shows the first --filled of the slots plus the new tokens causally, as a decode step's additive mask over
the cache's capacity (a power of two, between half and all of it filled). The kernel is timed over every slot (the
op without `seen`) and over the slots before the step's `seen` count (`TargetCache.seen_slots`, as the decoder
passes it).
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton

from dflash_compile.attention import folded_attention
from dflash_compile.cache import additive_mask
from dflash_compile.kernels.decode_attention import grouped_decode_attention

SHAPES = {"gpt-oss-20b": (64, 8, 64, True), "qwen3-30b-a3b": (32, 4, 128, False),  # heads, kv heads, d, sinks
          "qwen3.5-35b-a3b": (16, 2, 256, False)}


def inputs(shape: str, tokens: int, slots: int, filled_fraction: float):
    """The op's arguments, and the step's `seen` count: the filled slots and the new tokens."""
    heads, kv_heads, d, has_sinks = SHAPES[shape]
    query = torch.randn(1, tokens, heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    key, value = (torch.randn(1, kv_heads, slots, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    filled = min(int(slots * filled_fraction), slots - tokens)
    visible = torch.arange(slots, device="cuda") <= filled + torch.arange(tokens, device="cuda")[:, None]
    mask = additive_mask(visible[None], torch.bfloat16)
    sinks = torch.randn(heads, device="cuda", dtype=torch.bfloat16) if has_sinks else None
    return (query, key, value, mask, sinks, d ** -0.5), torch.tensor(filled + tokens, device="cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument("--slots", nargs="+", type=int, default=[512, 1024, 4096, 8192])
    parser.add_argument("--block-r", nargs="+", type=int, default=[None],
                        help="folded rows per program of the kernel, each timed (default: the op, 16)")
    parser.add_argument("--filled", nargs="+", type=float, default=[0.5],
                        help="fractions of the slots filled before the step, each timed")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print("| shape | tokens | slots | filled | rows per program | compiled torch math us | decode_attention us, every "
          "slot | up to seen us | seen speed-up | over torch | max difference |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    compiled = torch.compile(folded_attention)
    for shape, tokens, slots, filled in itertools.product(args.shapes, args.tokens, args.slots, args.filled):
        tensors, seen = inputs(shape, tokens, slots, filled)
        torch_time = us(lambda: compiled(*tensors))
        for block_r in args.block_r:
            every_slot = us(functools.partial(kernel_call, *tensors, None, block_r))
            kernel = functools.partial(kernel_call, *tensors, seen, block_r)
            up_to_seen = us(kernel)
            difference = (compiled(*tensors).float() - kernel().float()).abs().max().item()
            print(f"| {shape} | {tokens} | {slots} | {filled} | {block_r or 'op'} | {torch_time:.1f} | "
                  f"{every_slot:.1f} | {up_to_seen:.1f} | {every_slot / up_to_seen:.2f}x | "
                  f"{torch_time / up_to_seen:.2f}x | {difference:.1e} |", flush=True)


def us(call) -> float:
    return triton.testing.do_bench_cudagraph(call) * 1e3


def kernel_call(query, key, value, mask, sinks, scaling, seen, block_r):
    """`dflash::decode_attention` as the op runs it, or its kernel with `block_r` folded rows per program."""
    if block_r is None:
        return torch.ops.dflash.decode_attention(query, key, value, mask, sinks, scaling, seen)
    return grouped_decode_attention(query, key, value, mask, sinks, scaling, seen, block_r=block_r)


if __name__ == "__main__":
    main()
