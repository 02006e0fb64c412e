"""Where a compiled decode step's wall time goes besides its kernels (CUDA).

    python3 bench/step_overhead.py --model gpt-oss-20b --experts mxfp4
    python3 bench/step_overhead.py --model qwen3-30b-a3b
    python3 bench/step_overhead.py --model gpt-oss-20b --experts mxfp4 --default-only --inductor combo_kernels=True
    python3 bench/step_overhead.py --model gpt-oss-20b --experts mxfp4 --default-only --torch-attention
    python3 bench/step_overhead.py --model gpt-oss-20b --experts mxfp4 --default-only --torch-attention --prompt 4096
    python3 bench/step_overhead.py --model gpt-oss-20b --experts mxfp4 --default-only --without split_k_linear

One decode step (batch 1, one token, after a --prompt-token prefill, nothing committed so every call does the same
work), on the same inputs for every runner, timed three ways:
  * synced: a device sync before and after every call, as `generate` pays it (it reads the accepted counts each
    step);
  * back to back: --steps calls, one sync at the end (the device's own time per step once the host keeps ahead);
  * host: the host's time to issue one call (no sync after it).
Runners (VARIANTS): the step on `StepGraphs` (compiled without CUDA graphs, captured once per shape in a plain
`torch.cuda.CUDAGraph`: `optimize`'s default since session 31) without passes `projection_fusion` and `small_top_k`,
without `small_top_k`, and with every pass (the default); with --inductor, the default's passes under those Inductor
options too; with --without, the default without those passes; with --torch-attention, the default with attention
in torch's math rather than `dflash::decode_attention` (session 33 timed the two in separate processes and their
`generate` disagreed with their steps); then compiled without CUDA graphs. (Session 31 also timed torch.compile's
CUDA-graph trees, mode "reduce-overhead" as torch runs it: `as_compiled(False, ...)`.) Then
`generate` (--new tokens, greedy) for each variant, without a drafter and with a random DFlash drafter (every draft
rejected: each step drafts, verifies --block tokens and keeps one), tokens compared, with the milliseconds of a
`generate` spent outside its steps (prefill, set-up, the host's loop).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import statistics
import tempfile
import time

import torch
import transformers
from spec_decode import build_model, packed_twin, random_drafter, step_inputs

import dflash_compile
from dflash_compile.backend import dflash_backend_with
from dflash_compile.benchmark import timed_together
from dflash_compile import attention
from dflash_compile.attention import grouped_attention
from dflash_compile.passes import PIPELINE
from dflash_compile.step_graphs import StepGraphs


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
    parser.add_argument("--default-only", action="store_true",
                        help="time only optimize's default of the VARIANTS (and the --inductor variant)")
    parser.add_argument("--inductor", nargs="*", default=[],
                        help="Inductor options of one more variant, the default's passes, e.g. combo_kernels=True")
    parser.add_argument("--without", nargs="*", default=[], choices=list(PIPELINE),
                        help="one more variant: the default without these passes")
    parser.add_argument("--torch-attention", action="store_true",
                        help="one more variant: the default with attention in torch's math, not the decode kernel")
    args = parser.parse_args()
    variants = dict(list(VARIANTS.items())[-1:] if args.default_only else VARIANTS.items())
    if args.inductor:
        options = {key: ast.literal_eval(value) for key, value in (item.split("=", 1) for item in args.inductor)}
        variants[f"StepGraphs, every pass, Inductor {options}"] = as_compiled(True, inductor=options)
    if args.without:
        variants[f"StepGraphs, every pass but {', '.join(args.without)}"] = as_compiled(True, tuple(args.without))
    if args.torch_attention:
        variants["StepGraphs, every pass, attention in torch's math"] = as_compiled(True, torch_attention=True)
    args.device = "cuda"
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = build_model(args.model, args.device, args.layers)
    if args.experts != "bf16":  # a copy with its experts packed; the bf16 original goes
        model = packed_twin(model, args.experts)
    print(f"# {args.model}, {model.config.num_hidden_layers} layers, experts {args.experts}, prompt {args.prompt}, "
          f"torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}")
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), device=args.device)
    with torch.no_grad():
        plain = dflash_compile.optimize(model, mode="default").decoder
        rows, outputs = [], []
        with grouped_attention(model):  # as `generate` runs the steps
            tokens, cache, active = step_inputs(model, plain, args, 1)
            for name, variant in variants.items():
                step = variant(dflash_compile.optimize(model)).decoder.verify_step
                call = functools.partial(step, tokens, cache, active)
                rows.append((name, step_timings(in_torch_attention(call) if variant.torch_attention else call,
                                                args.steps, outputs)))
            rows.append(("compiled without CUDA graphs", step_timings(lambda: plain.verify_step(tokens, cache, active),
                                                                      args.steps, outputs)))
        same = all(torch.equal(a, b) for output in outputs[1:] for a, b in zip(outputs[0], output))
        print(f"same accepted counts and tokens from every runner: {same}")
        print("\n| decode step | synced ms | back to back ms | host ms per call |\n|---|---|---|---|")
        for name, t in rows:
            print(f"| {name} | {t['synced']:.3f} | {t['back to back']:.3f} | {t['host']:.3f} |")

        with tempfile.TemporaryDirectory() as tmp:
            drafter = random_drafter(model, args.block, tmp)
            drafters = {"no drafter": {}, f"random DFlash drafter, block {args.block}": dict(drafter=drafter,
                                                                                            adaptive=False)}
            runs = {(d, v): variant(dflash_compile.optimize(model, **options))
                    for d, options in drafters.items() for v, variant in variants.items()}
        print(f"\n`generate`, {args.new} tokens after {args.prompt}, medians of 3 (round robin):\n\n"
              "| drafter | steps | tok/s | vs the first | ms per step | ms outside steps | same tokens |\n"
              "|---|---|---|---|---|---|---|")
        for drafter in drafters:
            fasts = {v: fast for (d, v), fast in runs.items() if d == drafter}
            timed_runs = timed_together([lambda f=f: f.generate(ids, max_new_tokens=args.new) for f in fasts.values()],
                                        3, args.device)
            first = timed_runs[0]
            for (name, fast), (out, seconds) in zip(fasts.items(), timed_runs):
                stats = fast.last_stats
                step = statistics.median(stats.step_seconds) * 1e3
                outside = (stats.seconds - sum(stats.step_seconds)) * 1e3
                print(f"| {drafter} | {name} | {args.new / seconds:.1f} | {first[1] / seconds:.2f}x | {step:.2f} | "
                      f"{outside:.1f} | {torch.equal(out, first[0])} |")


def step_timings(call, steps: int, outputs: list) -> dict:
    """`timings` of a step after three warm-up calls; its accepted counts and tokens go to `outputs`."""
    for _ in range(3):
        call()
    outputs.append([t.clone() for t in call()[:2]])
    return timings(call, steps)


def in_torch_attention(call):
    """`call` with no folded query rows taking the decode kernel while it runs (the limit is read when a step is
    traced or captured, so each variant's graphs keep the attention they were made with)."""
    @functools.wraps(call)
    def wrapped(*args, **kwargs):
        with contextlib.ExitStack() as restore:
            restore.callback(setattr, attention, "DECODE_KERNEL_MAX_ROWS", attention.DECODE_KERNEL_MAX_ROWS)
            attention.DECODE_KERNEL_MAX_ROWS = 0
            return call(*args, **kwargs)

    return wrapped


def as_compiled(graphs: bool, without: tuple[str, ...] = (), inductor: dict | None = None,
                torch_attention: bool = False):
    """A function setting an optimized model's steps up as one of the VARIANTS: the verify step on `StepGraphs`
    or on torch.compile's CUDA-graph trees (the drafter's calls then without CUDA graphs, as in session 30), with
    the dflash passes but those named in `without`, these Inductor options, and attention in torch's math if
    `torch_attention` (its `generate` sets that up; callers of its step wrap them in `in_torch_attention`)."""
    def variant(fast):
        decoder = fast.decoder
        passes = tuple(name for name in PIPELINE if name not in without)
        extra = {"inductor": tuple(inductor.items())} if inductor else {}  # hashable: dflash_backend_with caches
        backend = dflash_backend_with(fused_experts=True, passes=passes, **extra)
        step = decoder._compiled(decoder._verify_step, backend, "default" if graphs else "reduce-overhead")
        decoder.verify_step = StepGraphs(step, decoder._step_state) if graphs else step
        if decoder.context_step is not None and not graphs:
            decoder.draft_logits = decoder._compiled(decoder.drafter.draft_logits, "inductor", "default")
            decoder.context_step = decoder._compiled(decoder.drafter.add_context, "inductor", "default")
        if torch_attention:
            fast.generate = in_torch_attention(fast.generate)
        return fast

    variant.torch_attention = torch_attention
    return variant


VARIANTS = {"StepGraphs, projections apart, torch.topk": as_compiled(True, ("projection_fusion", "small_top_k")),
            "StepGraphs, projection_fusion, torch.topk": as_compiled(True, ("small_top_k",)),
            "StepGraphs, every pass (optimize's default)": as_compiled(True)}


if __name__ == "__main__":
    main()
