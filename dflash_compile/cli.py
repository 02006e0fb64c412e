"""The `dflash-compile` command line.

    dflash-compile explain                       # the built-in default: a tiny random gpt-oss model
    dflash-compile explain --model PATH --graphs # any supported checkpoint directory, graphs printed
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _load(args) -> torch.nn.Module:
    from .testing import load_tiny_model

    if args.model is None:
        return load_tiny_model(args.family, DTYPES[args.dtype])
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=DTYPES[args.dtype]).eval()


def _timed(fn, repeats: int) -> tuple[torch.Tensor, float]:
    """Result and median seconds of `repeats` calls after one warm-up."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, sorted(times)[len(times) // 2]


def explain_command(args) -> int:
    from . import dflash_backend, explain

    model = _load(args)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    report = explain(model, ids)
    print(report)
    if args.graphs:
        for i, graph in enumerate(report.graphs):
            print(f"\n--- graph {i} after the passes ---\n{graph.after}")
    with torch.no_grad():
        expected, eager_s = _timed(lambda: model(ids).logits, args.repeats)
        compiled = torch.compile(model, backend=dflash_backend, fullgraph=report.graph_break_count == 0)
        actual, compiled_s = _timed(lambda: compiled(ids).logits, args.repeats)
    difference = (actual.float() - expected.float()).abs().max().item()
    print(f"max |compiled - eager| logits: {difference:.3g}")
    print(f"forward over {args.tokens} tokens, median of {args.repeats}: eager {eager_s * 1e3:.2f} ms, "
          f"dflash {compiled_s * 1e3:.2f} ms ({eager_s / compiled_s:.2f}x)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .testing import TINY_CONFIGS

    parser = argparse.ArgumentParser(prog="dflash-compile", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser("explain", help="run the passes on a model: matches, graph breaks, graphs, check")
    explain.add_argument("--model", help="checkpoint directory (default: a built-in tiny random model)")
    explain.add_argument("--family", default="gpt_oss", choices=sorted(TINY_CONFIGS),
                         help="family of the built-in tiny model when --model is not given")
    explain.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    explain.add_argument("--tokens", type=int, default=16, help="length of the random example input")
    explain.add_argument("--repeats", type=int, default=5, help="timed forwards per side")
    explain.add_argument("--graphs", action="store_true", help="print every graph after the passes")
    explain.set_defaults(run=explain_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    import transformers

    transformers.logging.set_verbosity_error()  # keep the report readable: no config dumps
    transformers.logging.disable_progress_bar()
    args = build_parser().parse_args(argv)
    if getattr(args, "tokens", 1) < 1:
        raise SystemExit("--tokens must be at least 1")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
