"""What a new process pays before its first tokens: `dflash_compile.from_pretrained` of a quantized checkpoint and
its first `generate` (compilation included), in fresh processes that share one compile cache (Inductor's FX graph
and AOTAutograd caches, Triton's kernel cache): the first process compiles cold, the later ones find the cache warm.

    python bench/warm_start.py --model gpt-oss-20b                 # H200: the 13 GB MXFP4 checkpoint of bench/load.py
    python bench/warm_start.py --model tiny-gpt_oss --device cpu    # plumbing check

Each process prints one row: load s, first generate s with where compilation went (Dynamo's trace of the step,
Inductor's compile of its graph), the cache hits it saw, the next generation's tokens/s and whether its tokens equal
the first process's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import budget, checkpoint_arguments, family_format, write_checkpoint  # noqa: E402

import dflash_compile  # noqa: E402
from dflash_compile.benchmark import timed  # noqa: E402

# compile_times() keys: Dynamo's whole frame conversion, and Inductor's compile inside it.
PHASES = {"dynamo": "_compile.compile_inner", "inductor": "compile_fx.<locals>.fw_compiler_base"}


def child(args) -> None:
    """One process's load, first generation and a timed one; prints a JSON line."""
    from torch._dynamo.utils import compile_times, counters

    config = transformers.AutoConfig.from_pretrained(args.child)
    ids = torch.randint(0, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    options = {"gpu_memory": budget(args.child, args.device, args.resident)} if args.resident < 1 else {}
    start = time.perf_counter()
    fast = dflash_compile.from_pretrained(args.child, device=args.device, **options)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    first = fast.generate(ids, max_new_tokens=args.new)
    first_s = time.perf_counter() - start
    phases = compile_times(repr="csv", aggregate=True)
    seconds = dict(zip(*phases))
    out, step_s = timed(lambda: fast.generate(ids, max_new_tokens=args.new), args.repeats, args.device)
    hits = {key: value for group in ("inductor", "aot_autograd") for key, value in counters[group].items()
            if "cache" in key}
    print(json.dumps({"load_s": load_s, "first_s": first_s, "tok_s": args.new / step_s, "hits": hits,
                      "tokens": out.tolist(), "same_as_first": torch.equal(first, out),
                      **{name: float(seconds.get(key, 0)) for name, key in PHASES.items()}}), flush=True)


def main() -> None:
    parser = checkpoint_arguments(__doc__.splitlines()[0], resident=1.0)
    parser.add_argument("--processes", type=int, default=3, help="processes in turn over one compile cache")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    if args.child:
        return child(args)
    args.format = family_format(args)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, tempfile.TemporaryDirectory() as cache:
        write_checkpoint(args, Path(tmp))
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton"}
        command = [sys.executable, __file__, "--child", tmp, *sys.argv[1:]]
        print(f"# {args.model} ({args.layers or 'all'} layers), {args.format}, {args.device}, {args.resident:.0%} of "
              f"experts resident, prompt {args.prompt}, {args.new} new tokens; torch {torch.__version__}\n"
              "| process | cache | load s | first generate s | Dynamo s | Inductor s | cache counters | tok/s | "
              "tokens |\n|---|---|---|---|---|---|---|---|---|", flush=True)
        first_tokens = None
        for process in range(args.processes):
            lines = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout.splitlines()
            row = json.loads(lines[-1])
            first_tokens = first_tokens or row["tokens"]
            same = "identical" if row["tokens"] == first_tokens and row["same_as_first"] else "DIFFER"
            print(f"| {process + 1} | {'cold' if process == 0 else 'warm'} | {row['load_s']:.1f} | "
                  f"{row['first_s']:.1f} | {row['dynamo']:.1f} | {row['inductor']:.1f} | {row['hits']} | "
                  f"{row['tok_s']:.1f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
