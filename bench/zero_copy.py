"""Routed experts read by the fused kernel straight from pinned host memory (zero-copy over PCIe) against copying
them into the slot pool first, per MoE layer call at decode sizes:

    python3 bench/zero_copy.py                      # H200: Qwen3-30B-A3B (bf16) and gpt-oss-20b (MXFP4) experts
    TRITON_INTERPRET=1 python bench/zero_copy.py --device cpu --shapes tiny     # the same calls, checked, untimed

Three ways to run one layer's routed experts: all resident (the kernel on the slot pool), all on the host
(`slot_of` = -1: the kernel reads their blobs over PCIe), what the host-managed cache does for misses (copy the
routed blobs host -> pool on the stream, then the kernel) and what the device-managed one does for predicted experts
(the copy kernel, `kernels.blob_copy`, then the kernel). Times are CUDA-graph replays; GB/s = the routed experts' bytes
/ time, next to the pinned host-to-device copy bandwidth of the same run. If zero-copy reads come near the copy
bandwidth, an offloaded layer's misses need no host sync and no copy before its kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_compile.kernels.blob_copy import copy_blobs  # noqa: E402
from dflash_compile.kernels.moe import fused_moe  # noqa: E402
from dflash_compile.offload import BlobLayout, blob_parts  # noqa: E402
from dflash_compile.packed import PackedWeight  # noqa: E402
from moe_kernels import random_packed  # noqa: E402

SHAPES = {  # experts, top-k, hidden, intermediate, format
    "qwen3-30b-a3b": (128, 8, 2048, 768, "dense"),
    "gpt-oss-20b": (32, 4, 2880, 2880, "mxfp4"),
    "tiny": (8, 2, 128, 64, "dense"),
}


def expert_weights(format: str, experts: int, hidden: int, inter: int, device: str):
    """Random (gate_up [E, 2I, H], down [E, H, I]) weights in `format`."""
    if format == "dense":
        return tuple(PackedWeight("dense", torch.randn(experts, rows, columns, device=device, dtype=torch.bfloat16)
                                  * columns**-0.5) for rows, columns in ((2 * inter, hidden), (hidden, inter)))
    return (random_packed(format, experts, 2 * inter, hidden, True, device),
            random_packed(format, experts, hidden, inter, True, device))


def layer_calls(shape: str, tokens: int, device: str):
    """(routed bytes, {way: call}) for one layer of `shape` with `tokens` tokens of random routing."""
    experts, top_k, hidden, inter, format = SHAPES[shape]
    parts = blob_parts(*expert_weights(format, experts, hidden, inter, device))
    layout = BlobLayout.of(parts)
    host = layout.blobs(parts, pin_memory=device == "cuda")
    pool = host.to(device)
    generator = torch.Generator().manual_seed(tokens)
    index = torch.rand(tokens, experts, generator=generator).argsort(dim=1)[:, :top_k].to(device)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1).to(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's bf16 math is wrong
    x = torch.randn(tokens, hidden, generator=generator).to(device, dtype)
    pooled, on_host = layout.weights(pool, format), layout.weights(host, format)
    resident = torch.arange(experts, dtype=torch.int32, device=device)
    nowhere = torch.full((experts,), -1, dtype=torch.int32, device=device)
    run = lambda table: fused_moe(x, index, weights, *pooled, host=on_host, slot_of=table)  # noqa: E731
    routed = index.unique().tolist()  # read once, outside any graph

    def copy_then_run():  # what offload does for misses today: each routed blob copied into its slot first
        for expert in routed:
            pool[expert].copy_(host[expert], non_blocking=True)
        return run(resident)

    listed = torch.tensor(routed, device=device)  # the device-managed cache's copy list: routed blob -> its slot
    valid = torch.ones(len(routed), dtype=torch.int32, device=device)

    def copy_kernel_then_run():  # the device-managed cache's prefetch: the GPU's own loads copy the blobs
        copy_blobs(host, pool, listed, listed, valid)
        return run(resident)

    calls = {"resident": lambda: run(resident), "zero-copy from host": lambda: run(nowhere),
             "copy, then kernel": copy_then_run, "copy kernel, then kernel": copy_kernel_then_run}
    return len(routed) * layout.nbytes, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b"], choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8])
    args = parser.parse_args()
    timing = args.device == "cuda"
    if timing:
        source = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        target = torch.empty_like(source, device="cuda")
        pcie = source.numel() / (triton.testing.do_bench(lambda: target.copy_(source, non_blocking=True)) * 1e-3)
        print(f"pinned host-to-device copy: {pcie / 1e9:.1f} GB/s\n")
        print("| shape | M | routed MB | way | us | GB/s | of the copy bandwidth |\n|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        for tokens in args.tokens:
            routed_bytes, calls = layer_calls(shape, tokens, args.device)
            outputs = {way: call() for way, call in calls.items()}
            if not all(torch.equal(out, outputs["resident"]) for out in outputs.values()):
                raise AssertionError(f"{shape} M={tokens}: the ways disagree")
            if not timing:
                print(f"{shape} M={tokens}: {', '.join(calls)} give the same output")
                continue
            for way, call in calls.items():
                us = triton.testing.do_bench_cudagraph(call) * 1e3
                rate = routed_bytes / us / 1e3
                print(f"| {shape} | {tokens} | {routed_bytes / 1e6:.1f} | {way} | {us:.1f} | {rate:.1f} | "
                      f"{rate * 1e9 / pcie:.2f} |", flush=True)


if __name__ == "__main__":
    main()
