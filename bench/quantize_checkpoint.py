"""Quantizing a bf16 checkpoint on this machine's CPU, two ways, each in a fresh process: the model loaded whole
then `dflash_compile.quantize` (what the quantize command did before session 65), and `quantize_checkpoint`, which
loads it offloaded to disk and reads one module at a time (once for each --shard-sizes: memory holds about one
shard). Seconds and the peak of the process's anonymous resident memory (RssAnon: not the checkpoint's
memory-mapped pages, which the kernel can drop), and whether they wrote the same tensors.

    python bench/quantize_checkpoint.py                                   # Qwen3-30B-A3B's first 4 layers, FP8
    python bench/quantize_checkpoint.py --model gpt-oss-20b --format mxfp4 --layers 2
    python bench/quantize_checkpoint.py --layers 8 --shard-sizes 5GB 1GB

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
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from load import HostPeak  # noqa: E402
from spec_decode import build_model  # noqa: E402

from dflash_compile.checkpoint import quantize, quantize_checkpoint  # noqa: E402
from dflash_compile.pair import load_model  # noqa: E402

WAYS = {"whole": lambda source, out, format, max_shard_size: quantize(load_model(source, "cpu", torch.bfloat16), out,
                                                                       format, max_shard_size),
        "from disk": quantize_checkpoint}


def digest(directory: Path) -> str:
    """One hash over the checkpoint's tensors (names and bytes) in name order, whatever files hold them."""
    handles = {name: handle for handle in (safe_open(path, "pt") for path in directory.glob("*.safetensors"))
               for name in handle.keys()}  # one handle a file, its header read once
    hasher = hashlib.sha256()
    for name in sorted(handles):
        hasher.update(name.encode())
        hasher.update(handles[name].get_tensor(name).view(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:16]


def measure(way: str, source: Path, out: Path, format: str, shards: str) -> None:
    start = time.perf_counter()
    with HostPeak() as peak:
        WAYS[way](source, out, format, max_shard_size=shards)
    files = list(out.glob("*.safetensors"))
    print(f"| {way} | {shards} | {len(files)} | {time.perf_counter() - start:.1f} | {peak.peak / 2**30:.2f} | "
          f"{sum(path.stat().st_size for path in files) / 2**30:.2f} | {digest(out)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--format", default="fp8_block", choices=["mxfp4", "fp8_block"])
    parser.add_argument("--dir", help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--shard-sizes", nargs="+", default=["5GB"], help="largest files for the from-disk way")
    parser.add_argument("--way", choices=list(WAYS), help=argparse.SUPPRESS)  # one way, in this process
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="dflash-quantize-"))
    source = root / "bf16"
    if args.way:
        return measure(args.way, source, root / f"{args.way.replace(' ', '-')}-{args.shard_sizes[0]}", args.format,
                       args.shard_sizes[0])
    start = time.perf_counter()
    model = build_model(args.model, "cpu", args.layers)
    model.save_pretrained(source)
    source_bytes = sum(path.stat().st_size for path in source.glob("*.safetensors"))
    print(f"{args.model}, {args.layers} layers: bf16 checkpoint {source_bytes / 2**30:.2f} GiB written in "
          f"{time.perf_counter() - start:.1f} s; quantizing to {args.format}", flush=True)
    del model
    print("| way | shards of at most | files | seconds | peak anonymous host memory GiB | written GiB | tensors' hash |"
          "\n|---|---|---|---|---|---|---|", flush=True)
    for way, shards in [("whole", "5GB")] + [("from disk", size) for size in args.shard_sizes]:
        subprocess.run([sys.executable, __file__, "--way", way, "--dir", str(root), "--model", args.model,
                        "--format", args.format, "--shard-sizes", shards], check=True)


if __name__ == "__main__":
    main()
