"""Adaptive verify width against fixed blocks and plain decoding, on the bundled pair (CPU or GPU).

    python bench/adaptive.py [--device cuda] [--new 128] [--repeats 5]

Rows: transformers' generate; dflash without a drafter; the trained drafter at its fixed block 8 and adaptive; a
random drafter (same shapes, acceptance about zero) fixed and adaptive. tokens/s are medians over `--repeats`
generations of each of the first 4 held-out prompts the target does not end within 32 tokens, after a warm-up; every output is checked against
transformers' generate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dflash_compile  # noqa: E402
from dflash_compile.drafter import load_drafter, save_drafter  # noqa: E402
from dflash_compile.pair import heldout_prompts, load_target, pair_paths  # noqa: E402


def tokens_per_second(generate, ids, repeats: int, device: str) -> tuple[float, torch.Tensor]:
    out = generate(ids)  # warm-up (compilation, chooser timings)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(ids)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return (out.shape[1] - ids.shape[1]) / statistics.median(times), out


def random_drafter(model, drafter_dir: Path, directory: Path) -> Path:
    """The trained drafter's config with its weights shuffled: same cost, drafts the target rejects."""
    import json

    drafter, _ = load_drafter(drafter_dir, model)
    generator = torch.Generator().manual_seed(0)
    weights = {k: v[torch.randperm(v.shape[0], generator=generator)] if v.ndim > 1 else v
               for k, v in drafter.state_dict().items()}
    return save_drafter(directory, json.loads((drafter_dir / "config.json").read_text()), weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    target_dir, drafter_dir = pair_paths()
    model, tokenizer = load_target(target_dir, args.device)
    compile = args.device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        shuffled = random_drafter(model, drafter_dir, Path(tmp) / "random")
        setups = {
            "transformers generate": None,
            "dflash, no drafter": dict(drafter=None),
            "dflash, trained drafter, block 8": dict(drafter=drafter_dir, adaptive=False),
            "dflash, trained drafter, adaptive": dict(drafter=drafter_dir),
            "dflash, random drafter, block 8": dict(drafter=shuffled, adaptive=False),
            "dflash, random drafter, adaptive": dict(drafter=shuffled),
        }
        rows = {name: [] for name in setups}
        details = {name: [] for name in setups}
        prompts = [tokenizer(p, return_tensors="pt").input_ids.to(args.device) for p in heldout_prompts()]
        long_enough = [ids for ids in prompts  # prompts the target does not end at once
                       if model.generate(ids, max_new_tokens=32, do_sample=False).shape[1] - ids.shape[1] == 32]
        for ids in long_enough[: args.prompts]:
            speed, expected = tokens_per_second(
                lambda i: model.generate(i, max_new_tokens=args.new, do_sample=False), ids, args.repeats, args.device)
            rows["transformers generate"].append(speed)
            for name, options in setups.items():
                if options is None:
                    continue
                fast = dflash_compile.optimize(model, compile=compile, **options)
                speed, out = tokens_per_second(lambda i: fast.generate(i, max_new_tokens=args.new), ids,
                                               args.repeats, args.device)
                assert torch.equal(out, expected), f"{name}: output differs from generate"
                rows[name].append(speed)
                stats = fast.last_stats
                details[name].append(f"tau {stats.tau:.2f}, width>1 in {sum(w > 1 for w in stats.widths)}/"
                                     f"{len(stats.widths)} steps")
    base = statistics.median(rows["dflash, no drafter"])
    print(f"device {args.device}, {args.prompts} held-out prompts x {args.new} tokens, median of {args.repeats}")
    print(f"{'setup':36s} {'tok/s':>8s} {'vs no drafter':>14s}  last prompt")
    for name, speeds in rows.items():
        speed = statistics.median(speeds)
        print(f"{name:36s} {speed:8.1f} {speed / base:13.2f}x  {details[name][-1] if details[name] else ''}")


if __name__ == "__main__":
    main()
