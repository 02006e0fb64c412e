"""One attention layer of a decode / verify step or a prefill chunk: transformers' function (its `repeat_kv` copies
of the cache; gpt-oss's eager sink softmax) against `dflash_compile.attention.grouped_query_attention` (queries
folded by group, no copies; sinks as one more key slot of SDPA), on the GPU or the CPU:

    python bench/attention.py                       # gpt-oss-20b (eager, sinks) and Qwen3-30B-A3B (sdpa) layers
    python bench/attention.py --slots 1024 4096 --tokens 1 8
    python bench/attention.py --shapes gpt-oss-20b --tokens 1024 --slots 2048 4096    # prefill chunks
    python bench/attention.py --device cpu --shapes gpt-oss-20b --tokens 1 256 --slots 1024

Per shape, verify width (tokens) and cache capacity (slots): microseconds of each side (CUDA: CUDA-graph replays,
Triton's do_bench_cudagraph, median; CPU: the median of 5 calls, the sides in turns), eagerly and under
torch.compile (the compiled verify step's case), and the largest difference of their outputs. Both sides run in
the same process on the same inputs.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
import triton
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from dflash_compile.attention import grouped_query_attention
from dflash_compile.benchmark import timed_together

SHAPES = {  # heads, key/value heads, head dim, transformers' function, sinks
    "gpt-oss-20b": (64, 8, 64, eager_attention_forward, True),
    "qwen3-30b-a3b": (32, 4, 128, sdpa_attention_forward, False),
}


def inputs(shape: str, tokens: int, slots: int, device: str):
    heads, kv_heads, d, _, sinks = SHAPES[shape]
    query = torch.randn(1, tokens, heads, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
    key, value = (torch.randn(1, kv_heads, slots, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    visible = torch.arange(slots, device=device) <= slots // 2 + torch.arange(tokens, device=device)[:, None]
    mask = torch.where(visible, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)[None, None]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False,
                             sinks=torch.randn(heads, device=device, dtype=torch.bfloat16))
    extra = {"s_aux": module.sinks} if sinks else {}
    return module, (query, key, value, mask), extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument("--slots", nargs="+", type=int, default=[1024, 8192])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    print(torch.cuda.get_device_name() if args.device == "cuda" else "CPU", "torch", torch.__version__)
    print("| shape | tokens | slots | transformers us | grouped us | speed-up | compiled: transformers us | "
          "grouped us | speed-up | max difference |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        theirs = SHAPES[shape][3]
        for tokens in args.tokens:
            for slots in args.slots:
                module, tensors, extra = inputs(shape, tokens, slots, args.device)
                sides = [lambda f=f: f(module, *tensors, scaling=0.125, **extra)[0]
                         for f in (theirs, grouped_query_attention)]
                compiled = [torch.compile(side) for side in sides]
                times = microseconds(sides, args.device) + microseconds(compiled, args.device)
                difference = (sides[0]().float() - sides[1]().float()).abs().max().item()
                print(f"| {shape} | {tokens} | {slots} | {times[0]:.1f} | {times[1]:.1f} | {times[0] / times[1]:.2f}x "
                      f"| {times[2]:.1f} | {times[3]:.1f} | {times[2] / times[3]:.2f}x | {difference:.1e} |",
                      flush=True)


def microseconds(sides, device: str) -> list[float]:
    if device == "cuda":
        return [triton.testing.do_bench_cudagraph(side) * 1e3 for side in sides]
    return [seconds * 1e6 for _, seconds in timed_together(sides, 5)]


if __name__ == "__main__":
    main()
