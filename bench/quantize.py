"""`PackedWeight.quantize` and `dequantize` of one full-size expert layer on this machine's CPU: seconds and the
growth of the process's peak resident memory around each call (what `dflash_compile.quantize`, `optimize`'s
re-packing of expanded MXFP4 experts and the benches' packed twins pay per layer).

    python bench/quantize.py                                   # gpt-oss-20b's gate/up [32, 5760, 2880], both formats
    python bench/quantize.py --shape 128 1536 2048 --formats fp8_block   # Qwen3-30B-A3B's gate/up

Run each format in a fresh process (the default does): the peak only grows, so one call's high-water would hide the
next one's.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_compile.packed import PackedWeight  # noqa: E402


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def measure(shape: list[int], format: str) -> None:
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)  # no fp32 peak
    PackedWeight.quantize(weight[:1, :64], format).dequantize()  # the ops' first-call costs apart
    before, start = peak_gib(), time.perf_counter()
    packed = PackedWeight.quantize(weight, format)
    quantized, quantize_s = peak_gib(), time.perf_counter() - start
    start = time.perf_counter()
    packed.dequantize(torch.bfloat16)
    dequantize_s = time.perf_counter() - start
    print(f"{format:9s} {shape}: quantize {quantize_s:5.1f} s, peak +{quantized - before:.2f} GiB; dequantize to bf16 "
          f"{dequantize_s:5.1f} s, peak +{peak_gib() - quantized:.2f} GiB beyond (input {weight.nbytes / 2**30:.2f} "
          f"GiB bf16)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[32, 5760, 2880], metavar=("E", "N", "K"))
    parser.add_argument("--formats", nargs="+", default=["mxfp4", "fp8_block"], choices=["mxfp4", "fp8_block"])
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # one format, this process
    args = parser.parse_args()
    if args.in_process:
        return measure(args.shape, args.formats[0])
    for format in args.formats:
        subprocess.run([sys.executable, __file__, "--in-process", "--shape", *map(str, args.shape), "--formats",
                        format], check=True)


if __name__ == "__main__":
    main()
