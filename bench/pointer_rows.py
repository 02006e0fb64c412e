"""The CUDA-core row path with pointer loads (GPUs without TMA such as sm_89, and offload's host fallback) against
the tensor-core tiles, on the H200 with TMA switched off by the tiles (`weight_loads=pointers`): one token and
blocks of 2 rows in MoE calls, and one or two rows of dense layers. Prints each candidate's time (`tune`: CUDA-graph
replays over rotated layers, a config counts only within 1e-2 of the fp64 reference) and the dense layers' times
(`packed_linear` with the row path's block_m against the tensor cores').

    python bench/pointer_rows.py                                # FP8: Qwen3-30B-A3B-FP8 MoE, DeepSeek-V3 / Qwen3 dense
    python bench/pointer_rows.py --format mxfp4 --shape gpt-oss-20b --tokens 1 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_compile.kernels.moe import TILES, packed_linear  # noqa: E402
from moe_kernels import SHAPES as MOE_SHAPES  # noqa: E402
from moe_kernels import graph_time_us, random_packed, row_candidates, tune  # noqa: E402
from packed_linear import SHAPES as DENSE_SHAPES  # noqa: E402
from packed_linear import copies_past_l2  # noqa: E402

POINTERS = {"weight_loads": "pointers"}


def moe_candidates(format: str, tokens: int):
    """The row path's pointer-load tiles at the call's rows per block, then the tensor cores' (TILES)."""
    block_m = 1 if tokens == 1 else 2
    for tiles in row_candidates(format):
        if tiles["weight_loads"] == "pointers":
            yield tiles | {"block_m": block_m} | ({"operands": "fp16"} if format == "fp8_block" else {})
    yield {"block_m": 16} | POINTERS


def dense_rows(format: str, tokens: int) -> None:
    """Each dense shape at `tokens` rows: the row path (block_m = tokens, pointer loads) against the tensor cores."""
    for name, (n, k) in DENSE_SHAPES.items():
        weights = [random_packed(format, 1, n, k, bias=False) for _ in range(copies_past_l2(n * k))]
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        expected = x.double() @ weights[0].dequantize(torch.float64)[0].T
        times = {}
        for path, tiles in (("rows", POINTERS | {"block_m": tokens}), ("tensor cores", POINTERS)):
            error = ((packed_linear(x, weights[0], **tiles).double() - expected).norm() / expected.norm()).item()
            times[path] = graph_time_us([lambda w=w: packed_linear(x, w, **tiles) for w in weights])
            times[path + " error"] = error
        print(f"| {name} | {tokens} | {times['rows']:.1f} | {times['tensor cores']:.1f} | "
              f"{times['tensor cores'] / times['rows']:.2f}x | {times['rows error']:.1e} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="fp8_block", choices=sorted(set(TILES) - {"dense"}))
    parser.add_argument("--shape", default="qwen3-30b-a3b-fp8", choices=list(MOE_SHAPES))
    parser.add_argument("--tokens", nargs="*", type=int, default=[1, 4, 8])
    parser.add_argument("--dense-tokens", nargs="*", type=int, default=[1, 2])
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for tokens in args.tokens:
        best = tune(args.shape, [tokens], 2, list(moe_candidates(args.format, tokens)))
        print(f"best at M = {tokens}: {best}", flush=True)
    print("| layer | M | row path us | tensor cores us | speed-up | rel. error |\n|---|---|---|---|---|---|")
    for tokens in args.dense_tokens:
        dense_rows(args.format, tokens)


if __name__ == "__main__":
    main()
