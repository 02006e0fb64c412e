"""Where a compiled decode step's wall time goes besides its kernels (CUDA).

    python3 bench/step_overhead.py --model gpt-oss-20b --experts mxfp4
    python3 bench/step_overhead.py --model qwen3-30b-a3b

One decode step (batch 1, one token, after a --prompt-token prefill, nothing committed so every call does the same
work), on the same inputs for every runner, timed three ways:
  * synced: a device sync before and after every call, as `generate` pays it (it reads the accepted counts each
    step);
  * back to back: --steps calls, one sync at the end (the device's own time per step once the host keeps ahead);
  * host: the host's time to issue one call (no sync after it).
Runners: the step on torch.compile's CUDA-graph trees (mode "reduce-overhead" as torch runs it: Dynamo's guards and
the trees' input checks on every call; `optimize`'s default before session 31), on `StepGraphs` (the same step
compiled without CUDA graphs, captured once per shape in a plain `torch.cuda.CUDAGraph`: `optimize`'s default now),
and compiled without CUDA graphs. Then `generate` (--new tokens, greedy) before and after, without a drafter and with a
random DFlash drafter (every draft rejected: each step drafts, verifies --block tokens and keeps one), tokens
compared.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers
from spec_decode import build_model, step_inputs

import dflash_compile
from dflash_compile.benchmark import timed_together
from dflash_compile.attention import grouped_attention
from dflash_compile.families import experts_modules
from dflash_compile.packed import PackedWeight, attach_packed, expert_weights
from dflash_compile.testing import random_drafter_weights, save_drafter, tiny_drafter_config


def pack_experts(model, format: str) -> None:
    """Quantize the routed experts to `format` and attach them packed (the fused kernel reads those)."""
    with torch.no_grad():
        for experts in experts_modules(model).values():
            weights = expert_weights(experts)
            attach_packed(experts, *[PackedWeight.quantize(w.data.float(), format, w.bias) for w in weights])


def timings(call, steps: int) -> dict:
    """Median synced ms per call, back-to-back ms per call, median host ms to issue a call."""
    synced, host = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        synced.append(time.perf_counter() - start)
        host.append(issued - start)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        call()
    torch.cuda.synchronize()
    together = (time.perf_counter() - start) / steps
    return {"synced": statistics.median(synced) * 1e3, "back to back": together * 1e3,
            "host": statistics.median(host) * 1e3}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-oss-20b")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--experts", default="bf16", choices=["bf16", "mxfp4", "fp8_block"])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--block", type=int, default=8)
    args = parser.parse_args()
    args.device = "cuda"
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = build_model(args.model, args.device, args.layers)
    if args.experts != "bf16":
        pack_experts(model, args.experts)
    print(f"# {args.model}, {model.config.num_hidden_layers} layers, experts {args.experts}, prompt {args.prompt}, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), device=args.device)
    with torch.no_grad():
        graphed = dflash_compile.optimize(model)  # StepGraphs on CUDA
        trees = as_before(dflash_compile.optimize(model))
        plain = dflash_compile.optimize(model, mode="default").decoder
        runners = {"torch.compile reduce-overhead (CUDA-graph trees)": trees.decoder.verify_step,
                   "StepGraphs (one torch.cuda.CUDAGraph per shape)": graphed.decoder.verify_step,
                   "compiled without CUDA graphs": plain.verify_step}
        rows, outputs = [], []
        with grouped_attention(model):  # as `generate` runs the steps
            tokens, cache, active = step_inputs(model, plain, args, 1)
            for name, step in runners.items():
                call = lambda: step(tokens, cache, active)  # noqa: E731
                for _ in range(3):
                    call()
                outputs.append([t.clone() for t in call()[:2]])
                rows.append((name, timings(call, args.steps)))
        same = all(torch.equal(a, b) for output in outputs[1:] for a, b in zip(outputs[0], output))
        print(f"same accepted counts and tokens from every runner: {same}")
        print("\n| runner | synced ms | back to back ms | host ms per call |\n|---|---|---|---|")
        for name, t in rows:
            print(f"| {name} | {t['synced']:.3f} | {t['back to back']:.3f} | {t['host']:.3f} |")

        with tempfile.TemporaryDirectory() as tmp:
            drafter = random_drafter(model, args.block, tmp)
            pairs = {"no drafter": (as_before(dflash_compile.optimize(model)), graphed),
                     f"random DFlash drafter, block {args.block}": (
                         as_before(dflash_compile.optimize(model, drafter, adaptive=False)),
                         dflash_compile.optimize(model, drafter, adaptive=False))}
        print(f"\n`generate`, {args.new} tokens after {args.prompt}, medians of 3:\n\n| drafter | tok/s before (trees, "
              "drafter without graphs) | tok/s StepGraphs | speed-up | ms per step before / after | same tokens |\n"
              "|---|---|---|---|---|---|")
        for name, (before, after) in pairs.items():
            (old, old_s), (new, new_s) = timed_together(
                [lambda: before.generate(ids, max_new_tokens=args.new),
                 lambda: after.generate(ids, max_new_tokens=args.new)], 3, args.device)
            steps = [statistics.median(f.last_stats.step_seconds) * 1e3 for f in (before, after)]
            print(f"| {name} | {args.new / old_s:.1f} | {args.new / new_s:.1f} | {old_s / new_s:.2f}x | "
                  f"{steps[0]:.2f} / {steps[1]:.2f} | {torch.equal(old, new)} |")


def as_before(fast):
    """`fast` with its steps compiled as before `StepGraphs` (session 30): the verify step on torch.compile's
    CUDA-graph trees, the drafter's calls without CUDA graphs."""
    decoder = fast.decoder
    decoder.verify_step = decoder._compiled(decoder._verify_step, decoder.backend, "reduce-overhead")
    if decoder.context_step is not None:
        decoder.draft_logits = decoder._compiled(decoder.drafter.draft_logits, "inductor", "default")
        decoder.context_step = decoder._compiled(decoder.drafter.add_context, "inductor", "default")
    return fast


def random_drafter(model, block: int, directory: str) -> str:
    """A random DFlash drafter of two layers at the target's hidden size (spec_decode.py's native row's shape)."""
    config = tiny_drafter_config(model.config, block_size=block, sliding_window=4096)
    config.update(hidden_size=model.config.hidden_size, intermediate_size=2 * model.config.hidden_size,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    return save_drafter(directory, config, random_drafter_weights(config))

if __name__ == "__main__":
    main()
