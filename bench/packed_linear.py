"""Dense FP8 block-scaled (or MXFP4) linear layers (`packed_linear`, DeepSeek-V3 / Qwen3-FP8 attention and dense MLP
shapes) at decode and verify sizes on the H200: microseconds as CUDA-graph replays over weights rotated past L2,
against bf16 weights through torch's linear (cuBLAS: what runs once the checkpoint is dequantized), one
graph-launched read of the packed bytes, K splits swept, and optionally another version of
dflash_compile/kernels/moe.py.

    python bench/packed_linear.py
    python bench/packed_linear.py --baseline old_moe.py   # e.g. git show REV:dflash_compile/kernels/moe.py > old_moe.py
    python bench/packed_linear.py --tokens 1 --tiles block_m=1 --baseline old_moe.py   # the CUDA-core row path
    python bench/packed_linear.py --format mxfp4 --tokens 1 2   # the same shapes packed as MXFP4
    python bench/packed_linear.py --tokens 8 16 --sweep block_n=32,64,128 num_warps=4,8   # best tiles per shape
    python bench/packed_linear.py --tokens 64 128 256 --dequantize-rows 64 --baseline old_moe.py   # from 64 rows
    python bench/packed_linear.py --tokens 256 1024 --dequantize-sweep BLOCK_N=64,128 num_warps=4,8
    python bench/packed_linear.py --format dense --layers gpt-oss qwen3-30b-a3b --tokens 1 8 16   # bf16 projections
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_compile.kernels import moe  # noqa: E402
from dflash_compile.kernels.moe import packed_linear  # noqa: E402
from kernel_sass import parse_tiles, tile_grid  # noqa: E402
from moe_kernels import copy_bandwidth, graph_time_us, load_baseline, random_packed, read_time_us  # noqa: E402

SHAPES = {  # name: (N, K)
    "deepseek-v3 q_a_proj": (1536, 7168),
    "deepseek-v3 kv_a_proj_with_mqa": (576, 7168),
    "deepseek-v3 q_b_proj": (24576, 1536),
    "deepseek-v3 kv_b_proj": (32768, 512),
    "deepseek-v3 o_proj": (7168, 16384),
    "deepseek-v3 dense gate_proj": (18432, 7168),
    "deepseek-v3 dense down_proj": (7168, 18432),
    "qwen3-30b-a3b-fp8 q_proj": (4096, 2048),
    "qwen3-30b-a3b-fp8 o_proj": (2048, 4096),
    # bf16 in these checkpoints (--format dense): q/k/v as pass projection_fusion runs them, o_proj, the router
    "gpt-oss-20b q/k/v": (5120, 2880),
    "gpt-oss-20b o_proj": (2880, 4096),
    "gpt-oss-20b router": (32, 2880),
    "qwen3-30b-a3b q/k/v": (5120, 2048),
    "qwen3-30b-a3b o_proj": (2048, 4096),
    "qwen3-30b-a3b router": (128, 2048),
}
SPLITS = (1, 2, 4, 8, 16)


def copies_past_l2(nbytes: int) -> int:
    """How many copies of a weight of `nbytes` to rotate over so that the 50 MB L2 cannot serve them."""
    return max(2, -(-256_000_000 // nbytes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--format", default="fp8_block", choices=["fp8_block", "mxfp4", "dense"])
    parser.add_argument("--layers", nargs="*", default=[], help="only the SHAPES whose names start with one of these")
    parser.add_argument("--baseline", type=Path, help="another moe.py whose packed_linear to time beside")
    parser.add_argument("--tiles", nargs="*", default=[], help="tile overrides for this version, e.g. block_m=1")
    parser.add_argument("--dequantize-rows", type=int, help="DEQUANTIZE_ROWS for this version (`auto us`)")
    parser.add_argument("--sweep", nargs="*", default=[],
                        help="tile values to sweep with every share count (auto and SPLITS), e.g. num_stages=3,4")
    parser.add_argument("--dequantize-sweep", nargs="*", default=[],
                        help="DEQUANTIZE_TILES values to sweep (the dequantize path, --tokens >= DEQUANTIZE_ROWS), "
                             "e.g. BLOCK_N=64,128 num_warps=4,8")
    args = parser.parse_args()
    for name in [name for name in SHAPES if args.layers and not name.startswith(tuple(args.layers))]:
        del SHAPES[name]
    tiles = parse_tiles(args.tiles)
    if args.dequantize_rows is not None:
        moe.DEQUANTIZE_ROWS = args.dequantize_rows
    if args.sweep or args.dequantize_sweep:
        return sweep(args.tokens, args.format, tiles, args.sweep or args.dequantize_sweep, bool(args.dequantize_sweep))
    baseline = load_baseline(args.baseline).packed_linear if args.baseline else None
    copy_gbs = copy_bandwidth() / 1e9
    print(f"{torch.cuda.get_device_name()}, device-to-device copy {copy_gbs:.0f} GB/s\n")
    print("| layer | M | MB | auto us | of copy | " + " | ".join(f"split {s} us" for s in SPLITS)
          + " | baseline us | bf16 linear us | one read us | rel. error |")
    print("|---|---|---|---|---|" + "---|" * len(SPLITS) + "---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        weights = [random_packed(args.format, 1, n, k, bias=False)]
        nbytes = weights[0].nbytes()
        copies = copies_past_l2(nbytes)
        weights += [random_packed(args.format, 1, n, k, bias=False) for _ in range(copies - 1)]
        dense = [w.dequantize(torch.bfloat16)[0] for w in weights[:copies_past_l2(2 * nbytes)]]
        for tokens in args.tokens:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            expected = x.double() @ weights[0].dequantize(torch.float64)[0].T
            error = ((packed_linear(x, weights[0], **tiles).double() - expected).norm() / expected.norm()).item()
            auto = graph_time_us([lambda w=w: packed_linear(x, w, **tiles) for w in weights])
            swept = [graph_time_us([lambda w=w, s=s: packed_linear(x, w, split_k=s, **tiles) for w in weights])
                     for s in SPLITS]
            old = graph_time_us([lambda w=w: baseline(x, w) for w in weights]) if baseline else float("nan")
            linear = graph_time_us([lambda d=d: torch.nn.functional.linear(x, d) for d in dense])
            read = read_time_us(nbytes, copies)
            print(f"| {name} | {tokens} | {nbytes / 1e6:.1f} | {auto:.1f} | {nbytes / auto / 1e3 / copy_gbs:.0%} | "
                  + " | ".join(f"{us:.1f}" for us in swept) + f" | {old:.1f} | {linear:.1f} | {read:.1f} | "
                  f"{error:.1e} |", flush=True)


def sweep(token_counts: list[int], format: str, tiles: dict, values: list[str], dequantize: bool = False) -> None:
    """The fastest tiles per layer and M among every combination of the swept values, next to the defaults: the
    fused launch's tiles, each with the automatic share count and every count in SPLITS, or (`dequantize`) the
    dequantize kernel's DEQUANTIZE_TILES."""
    grid, default_dequantize = tile_grid(values), moe.DEQUANTIZE_TILES
    print("| layer | M | default us | best us | best tiles | speed-up |\n|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        weights = [random_packed(format, 1, n, k, bias=False)]
        weights += [random_packed(format, 1, n, k, bias=False) for _ in range(copies_past_l2(weights[0].nbytes()) - 1)]
        for tokens in token_counts:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)

            def timed(candidate: dict) -> float:
                moe.DEQUANTIZE_TILES = default_dequantize | candidate if dequantize else default_dequantize
                layer_tiles = tiles if dequantize else tiles | candidate
                return graph_time_us([lambda w=w: packed_linear(x, w, **layer_tiles) for w in weights])

            candidates = [{}] + (grid if dequantize else [point | shares for point in grid
                                                          for shares in [{}] + [{"split_k": s} for s in SPLITS]])
            times = [timed(candidate) for candidate in candidates]
            best = min(range(len(times)), key=times.__getitem__)
            print(f"| {name} | {tokens} | {times[0]:.1f} | {times[best]:.1f} | {candidates[best]} | "
                  f"{times[0] / times[best]:.2f}x |", flush=True)
    moe.DEQUANTIZE_TILES = default_dequantize


if __name__ == "__main__":
    main()
