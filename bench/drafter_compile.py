"""The drafter's two calls per drafting step, eager against compiled (what `optimize(..., compile=True)` runs):

    python bench/drafter_compile.py            # the bundled pair on this machine's CPU (or --device cuda)

`add_context` of one step's 8 tokens (through the decoder, padded to the block) and `draft_logits` of one block,
on a drafter cache holding 40 tokens; kept counts of 0 leave the cache as it is, so every call does the same work.
Milliseconds per call, medians of --repeats rounds of 200 calls, eager and compiled alternating.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_compile import optimize  # noqa: E402
from dflash_compile.benchmark import timed  # noqa: E402
from dflash_compile.pair import load_target, pair_paths  # noqa: E402

CALLS = 200  # per timed round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    target, drafter_dir = pair_paths()
    model, _ = load_target(target, args.device, torch.float32)
    decoder = optimize(model, drafter=drafter_dir, compile=True, adaptive=False).decoder
    drafter, lm_head = decoder.drafter, model.get_output_embeddings()
    block = drafter.config.block_size
    with torch.inference_mode():
        cache = drafter.new_cache(1, 512, torch.float32, args.device)
        drafter.add_context(cache, torch.randn(1, 40, drafter.fc.in_features, device=args.device),
                            torch.tensor([40], device=args.device))
        features = torch.randn(1, block, drafter.fc.in_features, device=args.device)
        kept = torch.zeros_like(cache.lengths)
        embeds = torch.randn(1, block, model.config.hidden_size, device=args.device)
        calls = {
            "add_context": {"eager": lambda: drafter.add_context(cache, features, kept),
                            "compiled": lambda: decoder._add_context(cache, features, kept)},
            "draft_logits": {"eager": lambda: drafter.draft_logits(embeds, cache, lm_head),
                             "compiled": lambda: decoder.draft_logits(embeds, cache, lm_head)},
        }
        for name, ways in calls.items():
            times = {way: [] for way in ways}
            for _ in range(args.repeats):  # the two ways alternate, so a drifting machine speed hits both
                for way, call in ways.items():  # timed's warm-up round compiles the first time
                    times[way].append(timed(lambda: [call() for _ in range(CALLS)], 1, args.device)[1] / CALLS * 1e3)
            eager, compiled = (statistics.median(times[way]) for way in ("eager", "compiled"))
            print(f"{name}: eager {eager:.3f} ms, compiled {compiled:.3f} ms ({eager / compiled:.2f}x)")


if __name__ == "__main__":
    main()
