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
  * back to back: calls with one sync at the end of each turn (the device's own time per step once the host keeps
    ahead);
  * host: the host's time to issue one call (no sync after it).
The runners take turns, --steps calls each in all (`timings`).
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
from dflash_compile.passes import PIPELINE
from dflash_compile.speculative import generation_context
from dflash_compile.step_graphs import StepGraphs


def timings(calls: list, steps: int, rounds: int = 5) -> list[dict]:
    """Per call: median synced ms per call, back-to-back ms per call (median of the rounds), median host ms to issue
    a call. The calls take turns: `rounds` rounds (A B, B A, ...) of steps / rounds calls each, so that a device or
    host drifting during the run moves every runner alike."""
    samples = [{"synced": [], "back to back": [], "host": []} for _ in calls]
    per_round = max(1, steps // rounds)
    for round_ in range(rounds):
        for i in range(len(calls)) if round_ % 2 == 0 else reversed(range(len(calls))):
            call, sample = calls[i], samples[i]
            for _ in range(per_round):
                torch.cuda.synchronize()
                start = time.perf_counter()
                call()
                issued = time.perf_counter()
                torch.cuda.synchronize()
                sample["synced"].append(time.perf_counter() - start)
                sample["host"].append(issued - start)
            start = time.perf_counter()
            for _ in range(per_round):
                call()
            torch.cuda.synchronize()
            sample["back to back"].append((time.perf_counter() - start) / per_round)
    return [{key: statistics.median(values) * 1e3 for key, values in sample.items()} for sample in samples]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-oss-20b")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--experts", default="bf16", choices=["bf16", "mxfp4", "fp8_block"])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="`generate` calls per runner (medians)")
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
        calls, outputs = {}, []
        with generation_context(model):
            tokens, cache, active = step_inputs(model, plain, args, 1)
            for name, variant in variants.items():
                step = variant(dflash_compile.optimize(model)).decoder.verify_step
                call = functools.partial(step, tokens, cache, active)
                calls[name] = in_torch_attention(call) if variant.torch_attention else call
            calls["compiled without CUDA graphs"] = functools.partial(plain.verify_step, tokens, cache, active)
            for call in calls.values():
                outputs.append(warm_output(call))
            rows = zip(calls, timings(list(calls.values()), args.steps))
        same = all(torch.equal(a, b) for output in outputs[1:] for a, b in zip(outputs[0], output))
        print(f"same accepted counts and tokens from every runner: {same}")
        print(f"\n{args.steps} steps each, in turns:\n\n"
              "| decode step | synced ms | back to back ms | host ms per call |\n|---|---|---|---|")
        for name, t in rows:
            print(f"| {name} | {t['synced']:.3f} | {t['back to back']:.3f} | {t['host']:.3f} |")

        with tempfile.TemporaryDirectory() as tmp:
            drafter = random_drafter(model, args.block, tmp)
            drafters = {"no drafter": {}, f"random DFlash drafter, block {args.block}": dict(drafter=drafter,
                                                                                            adaptive=False)}
            runs = {(d, v): variant(dflash_compile.optimize(model, **options))
                    for d, options in drafters.items() for v, variant in variants.items()}
        print(f"\n`generate`, {args.new} tokens after {args.prompt}, medians of {args.repeats} (round robin):\n\n"
              "| drafter | steps | tok/s | vs the first | ms per step | ms outside steps | same tokens |\n"
              "|---|---|---|---|---|---|---|")
        for drafter in drafters:
            fasts = {v: fast for (d, v), fast in runs.items() if d == drafter}
            timed_runs = timed_together([lambda f=f: f.generate(ids, max_new_tokens=args.new) for f in fasts.values()],
                                        args.repeats, args.device)
            first = timed_runs[0]
            for (name, fast), (out, seconds) in zip(fasts.items(), timed_runs):
                stats = fast.last_stats
                step = statistics.median(stats.step_seconds) * 1e3
                outside = (stats.seconds - sum(stats.step_seconds)) * 1e3
                print(f"| {drafter} | {name} | {args.new / seconds:.1f} | {first[1] / seconds:.2f}x | {step:.2f} | "
                      f"{outside:.1f} | {torch.equal(out, first[0])} |")


def warm_output(call) -> list[torch.Tensor]:
    """A step's accepted counts and tokens, after three warm-up calls (compiling and capturing it)."""
    for _ in range(3):
        call()
    return [t.clone() for t in call()[:2]]


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
