"""The prompt's forward before the first new token (prefill): transformers' `model(ids, use_cache=True)`, what
`model.generate` runs first, against the decoder's `_prefill` as `optimize(model).generate` runs it (its cache, its
attention, and for models with sliding-window layers chunks of `prefill_chunk` tokens), on the GPU:

    python bench/prefill.py --model gpt-oss-20b --layers 4 --prompt 2048 --chunks 256 1024 2048
    python bench/prefill.py --model qwen3-30b-a3b --layers 4 --prompt 2048 --experts bf16 mxfp4 --profile
    python bench/prefill.py --model qwen3-30b-a3b --layers 4 --prompt 4096 --chunks 4096 --masks unpadded rows explicit

Milliseconds (medians of --repeats after a warm-up call) per prefill chunk size, our experts kept bf16 or packed
(`--experts`; transformers' side runs them dequantized to bf16, as bench/spec_decode.py does), the ratio to
transformers' forward, and the device memory each call takes at its peak beyond what was allocated before it (its
temporaries: the decoder keeps its cache from the timed calls) next to `prefill_memory`'s estimate, which
`generate` sizes its chunks by; `--profile` adds each side's heaviest CUDA kernels. The prompts have no left padding, so
SDPA models attend by SDPA's causal flag in the first chunk; `--masks rows explicit` also times the paths of a
left-padded batch (row by row without masks, or with explicit masks).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from unittest.mock import patch

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spec_decode import build_model, packed_twin  # noqa: E402

import dflash_compile  # noqa: E402
from dflash_compile import speculative  # noqa: E402
from dflash_compile.benchmark import timed  # noqa: E402
from dflash_compile.prefill_memory import PrefillActivations  # noqa: E402


def ours(target, ids, chunk: int, new: int, masks: str = "unpadded"):
    """A call of the decoder's prefill on a fresh cache, as `generate` makes and runs it. `masks`: "unpadded", or as
    for a left-padded batch "rows" (row by row without masks, at any length: ROWS_WITHOUT_MASKS set to 0) or
    "explicit" (with [b, 1, t, slots] masks)."""
    decoder = dflash_compile.optimize(target, compile=False, prefill_chunk=chunk).decoder
    max_len = speculative.cache_capacity(ids.shape[1] + new + decoder.block_size)
    pad = torch.zeros(ids.shape[0], dtype=torch.int64, device=ids.device)
    rows_from = 0 if masks == "rows" else ids.shape[1] + 1

    def run():
        with speculative.generation_context(target), patch.object(speculative, "ROWS_WITHOUT_MASKS", rows_from):
            cache = decoder._cache(ids.shape[0], max_len, target.dtype, ids.device, pad)
            return decoder._prefill(ids, cache, masks != "unpadded")[0]

    return run


def heaviest_kernels(fn, count: int = 8) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=count, max_name_column_width=70)


def peak_mib(fn, device: str) -> float:
    """Device memory one call of `fn` takes at its peak beyond what was allocated before it (its cache and
    temporaries; what it returns counts while held)."""
    if not device.startswith("cuda"):
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-oss-20b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1, help="rows of the prompt (no padding; see --masks)")
    parser.add_argument("--new", type=int, default=64, help="sizes the cache as a generation of this many tokens")
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--experts", nargs="+", default=["bf16"], choices=["bf16", "mxfp4", "fp8_block"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="each side's heaviest CUDA kernels")
    parser.add_argument("--masks", nargs="+", default=["unpadded"], choices=["unpadded", "rows", "explicit"],
                        help="our prefill as for an unpadded prompt, or for a left-padded batch row by row or with "
                             "explicit masks")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = build_model(args.model, args.device, args.layers)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device=args.device)
    print(f"# {args.model}, {args.layers} layers, {args.batch} x prompt {args.prompt}, {args.device}, torch "
          f"{torch.__version__}, transformers {transformers.__version__}")

    def plain():
        with torch.no_grad():
            return model(ids, use_cache=True).logits[:, -1]

    print("| experts | prefill chunk | masks | ms | transformers ms | speed-up | peak MiB | estimate MiB | "
          "transformers peak MiB | max logit difference |\n|---|---|---|---|---|---|---|---|---|---|")
    for experts in args.experts:
        target = model if experts == "bf16" else packed_twin(model, experts)  # `model` now holds its values
        expected, base = timed(plain, args.repeats, args.device)
        base_peak = peak_mib(plain, args.device)
        for chunk, masks in itertools.product(args.chunks, args.masks):
            run = ours(target, ids, chunk, args.new, masks)
            logits, seconds = timed(run, args.repeats, args.device)
            difference = (logits.float() - expected.float()).abs().max().item()
            estimate = PrefillActivations.of(target, 0, False).bytes(args.batch, chunk, args.prompt,
                                                                     masked=masks == "explicit") / 2**20
            print(f"| {experts} | {chunk} | {masks} | {seconds * 1e3:.2f} | {base * 1e3:.2f} | {base / seconds:.2f}x | "
                  f"{peak_mib(run, args.device):.0f} | {estimate:.0f} | {base_peak:.0f} | {difference:.3g} |",
                  flush=True)
        if args.profile and args.device == "cuda":
            print(f"\n## transformers\n{heaviest_kernels(plain)}")
            for chunk in args.chunks:
                table = heaviest_kernels(ours(target, ids, chunk, args.new))
                print(f"\n## ours, {experts} experts, chunk {chunk}\n{table}")
        del target


if __name__ == "__main__":
    main()
