"""Quantizing a bf16 checkpoint on this machine's CPU, two ways, each in a fresh process: the model loaded whole
then `dflash_compile.quantize` (what the quantize command did before session 65), and `quantize_checkpoint`, which
loads it offloaded to disk and reads one module at a time. Seconds and the peak of the process's anonymous resident
memory (RssAnon: not the checkpoint's memory-mapped pages, which the kernel can drop), and whether the two wrote the
same files.

    python bench/quantize_checkpoint.py                                   # Qwen3-30B-A3B's first 4 layers, FP8
    python bench/quantize_checkpoint.py --model gpt-oss-20b --format mxfp4 --layers 2

The bf16 checkpoint is written first (random weights, `build_model`'s reference shapes) into --dir (a temporary
directory by default).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from load import HostPeak  # noqa: E402
from spec_decode import build_model  # noqa: E402

from dflash_compile.checkpoint import quantize, quantize_checkpoint  # noqa: E402
from dflash_compile.pair import load_model  # noqa: E402

WAYS = {"whole": lambda source, out, format: quantize(load_model(source, "cpu", torch.bfloat16), out, format),
        "from disk": lambda source, out, format: quantize_checkpoint(source, out, format)}


def digest(directory: Path) -> str:
    """One hash over the directory's weight files and index, in name order."""
    hasher = hashlib.sha256()
    for path in sorted((*directory.glob("*.safetensors"), *directory.glob("*.index.json"))):
        hasher.update(path.name.encode())
        with path.open("rb") as file:
            while chunk := file.read(1 << 24):
                hasher.update(chunk)
    return hasher.hexdigest()[:16]


def measure(way: str, source: Path, out: Path, format: str) -> None:
    start = time.perf_counter()
    with HostPeak() as peak:
        WAYS[way](source, out, format)
    size = sum(path.stat().st_size for path in out.glob("*.safetensors"))
    print(f"| {way} | {time.perf_counter() - start:.1f} | {peak.peak / 2**30:.2f} | {size / 2**30:.2f} | "
          f"{digest(out)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--format", default="fp8_block", choices=["mxfp4", "fp8_block"])
    parser.add_argument("--dir", help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--way", choices=list(WAYS), help=argparse.SUPPRESS)  # one way, in this process
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="dflash-quantize-"))
    source = root / "bf16"
    if args.way:
        return measure(args.way, source, root / args.way.replace(" ", "-"), args.format)
    start = time.perf_counter()
    model = build_model(args.model, "cpu", args.layers)
    model.save_pretrained(source)
    source_bytes = sum(path.stat().st_size for path in source.glob("*.safetensors"))
    print(f"{args.model}, {args.layers} layers: bf16 checkpoint {source_bytes / 2**30:.2f} GiB written in "
          f"{time.perf_counter() - start:.1f} s; quantizing to {args.format}", flush=True)
    del model
    print("| way | seconds | peak anonymous host memory GiB | written GiB | files' hash |\n|---|---|---|---|---|",
          flush=True)
    for way in WAYS:
        subprocess.run([sys.executable, __file__, "--way", way, "--dir", str(root), "--model", args.model,
                        "--format", args.format], check=True)


if __name__ == "__main__":
    main()
