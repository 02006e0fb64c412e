"""What the device-managed cache's table updates cost per MoE layer call: `use` (the call's routed experts) and
`plan` (slots for the next layer's predicted experts: LRU victims from sorted stamps, a large pool in chunks first),
CUDA-graph replays of a decode call (one token) and a verify block (16 tokens) for slot pools of growing size:

    python3 bench/slot_table.py                         # H200: Qwen3-30B-A3B's 128 experts, top-8
    TRITON_INTERPRET=1 python bench/slot_table.py --device cpu --layers 4 --slots 256    # the calls, untimed

Each replay runs both updates for one layer, after a warm-up that filled the pool, so evictions happen.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_compile.slot_table import DeviceSlotTable  # noqa: E402


def layer_call(table: DeviceSlotTable, layers: int, experts: int, top_k: int, tokens: int, device: str):
    """A call that updates the tables as one MoE layer call does: its routing used, the next layer's planned."""
    generator = torch.Generator().manual_seed(tokens)
    routed = torch.rand(tokens, experts, generator=generator).argsort(dim=1)[:, :top_k].to(device)
    predicted = torch.rand(tokens, experts, generator=generator).argsort(dim=1)[:, :top_k].to(device)
    step = iter(range(1 << 30))

    def call():
        layer = next(step) % layers  # Python chooses the layer at capture: the replayed graph repeats one layer
        table.use(layer, routed)
        table.plan((layer + 1) % layers, predicted)

    for _ in range(2 * layers):  # fill the pool
        call()
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--slots", type=int, nargs="+", default=[512, 3072, 12288])
    args = parser.parse_args()
    if args.device == "cuda":
        print("| slots | tokens | use + plan, us per layer call |\n|---|---|---|")
    for slots in args.slots:
        for tokens in (1, 16):
            table = DeviceSlotTable(args.layers, args.experts, slots, torch.device(args.device))
            call = layer_call(table, args.layers, args.experts, args.top_k, tokens, args.device)
            if args.device != "cuda":
                print(f"slots {slots}, {tokens} token(s): counts {table.drain()}")
                continue
            us = triton.testing.do_bench_cudagraph(call) * 1e3
            print(f"| {slots} | {tokens} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
