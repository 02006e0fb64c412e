"""Expert offload benchmark: dflash's slot pool against transformers + accelerate offload on the same budget.

    python bench/offload.py --model gpt-oss-20b --device cuda --resident 0.25 0.5     # H200, random bf16 weights
    python bench/offload.py --model tiny-qwen3_moe --device cpu                        # plumbing check on a CPU

For each fraction of the routed experts that fits on the device (the budget is the dense weights plus that
fraction of all experts): greedy tokens/s with the prefill, the prefill alone (a generation that stops after the
prefill's token; `--prefill-chunk` sizes for models with sliding-window layers) and decode alone (a whole generation
minus that one), decode bytes fetched per token and decode time against the PCIe floor for those bytes, achieved
host-to-device GB/s, hit rate;
the same with DFlash verify blocks (an oracle drafter at --corruption, so acceptance is controlled): bytes per
committed token; and accelerate (`dispatch_model` with `infer_auto_device_map(max_memory=...)`, what
`device_map="auto"` does) on the same model and budget. Every output is checked against the resident model's
greedy tokens. Medians of --repeats after a warm-up.

`--experts mxfp4` / `fp8_block` offloads packed experts (quantized on the device from the random bf16 weights; the
resident reference and accelerate run those values dequantized to bf16), and `--pool-estimate layer slots` times a
prompt layer that reads the slot pool as its experts with the kernel choice estimated over the layer's experts (the
library's) or over the pool's slots (before 3636aff):

    python bench/offload.py --model gpt-oss-20b --layers 4 --experts mxfp4 --resident 0.75 --prompt 8192 --new 8 \
        --decode-only --accelerate-new 0 --pool-estimate layer slots
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import re
import statistics
import sys
import time
from pathlib import Path
from unittest.mock import patch

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spec_decode import build_model, first_mismatch, packed_twin, width_summary  # noqa: E402

import dflash_compile  # noqa: E402
from dflash_compile.benchmark import timed  # noqa: E402
from dflash_compile import offload  # noqa: E402
from dflash_compile.kernels import blob_copy, moe  # noqa: E402
from dflash_compile.offload import MANAGERS, OffloadStats, choose_manager, plan_offload  # noqa: E402
from dflash_compile.testing import OracleDrafter  # noqa: E402


def accelerate_offloaded(model, budget: int, device: str):
    """transformers + accelerate: layers that do not fit `budget` on the device run from CPU memory."""
    from accelerate import dispatch_model, infer_auto_device_map

    if device == "cpu":
        return model
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    device_map = infer_auto_device_map(model, max_memory={0: budget, "cpu": 10**13}, no_split_module_classes=no_split)
    return dispatch_model(model, device_map=device_map)


def host_to_device_bandwidth(device: str) -> float:
    """Bytes per second of a 1 GiB pinned host -> device copy (the PCIe floor's denominator)."""
    if device == "cpu":
        return float("nan")
    source = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(source, device=device)
    _, seconds = timed(lambda: target.copy_(source, non_blocking=True), 5, device)
    return source.numel() / seconds


WARM_UPS = 4


def measured_run(fast, ids, new: int) -> tuple[torch.Tensor, float, OffloadStats]:
    """The output, seconds and added offload statistics of one generation of `new` tokens."""
    offloaded = fast.model.dflash_offload
    before = copy.copy(offloaded.stats)
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fast.generate(ids, max_new_tokens=new)
    if ids.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return out, seconds, OffloadStats(**{k: v - getattr(before, k) for k, v in vars(offloaded.stats).items()})


def managers(requested: list[str], device: str, policy: str, cpu_compute: str) -> list[str]:
    """The managers to run, "auto" replaced by the one it picks for these options (none run twice)."""
    return list(dict.fromkeys(choose_manager(torch.device(device), policy, cpu_compute) if manager == "auto"
                              else manager for manager in requested))


def slots_and_tokens_check(offloaded, expected: torch.Tensor, out: torch.Tensor) -> str:
    """The tokens against the resident model's, and every slot's bytes against its expert's blob: random-weight
    experts move the tokens little, so lost copies can leave them identical (they did once)."""
    stale = offloaded.stale_slots()
    return first_mismatch(expected, out) + (f", {len(stale)} stale slots" if stale else "")


def decode_measurement(fast, ids, new: int, repeats: int):
    """After warm-up generations: (last output, median seconds of a whole generation, of one that stops after the
    prefill's token, and the last whole generation's and prefill's offload statistics). Decode alone is the
    difference of the two (same cache path); `fast.last_stats` is left at the last whole generation's. The warm-up
    repeats (up to WARM_UPS times) until the adaptive width has compiled and timed every width, as in a process that
    has generated before, rather than compiling inside a measured run (short generations can end before it has)."""
    for _ in range(WARM_UPS):
        fast.generate(ids, max_new_tokens=new)
        if fast.decoder.chooser is None or all(fast.decoder.chooser.times.values()):
            break
    prefills, wholes = [], []
    for _ in range(repeats):
        prefills.append(measured_run(fast, ids, 1))
        wholes.append(measured_run(fast, ids, new))
    median = statistics.median
    return (wholes[-1][0], median(w[1] for w in wholes), median(p[1] for p in prefills), wholes[-1][2],
            prefills[-1][2])


def _busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds in, milliseconds out)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1e3


def copy_timeline(fast, ids, new: int, path: Path) -> dict:
    """Profile one generation on CUDA: write its Chrome trace to `path` and return how long the host-to-device
    copies, the kernels and neither kept the GPU busy, so the gaps on the copy engine can be read off."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fast.generate(ids, max_new_tokens=new)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    ranges = {"copy": [], "kernel": []}
    for event in gpu:
        if "Memcpy HtoD" in event.name or "copy_blobs" in event.name:  # the device-managed cache copies by kernel
            ranges["copy"].append((event.time_range.start, event.time_range.end))
        elif "Memcpy" not in event.name and "Memset" not in event.name:
            ranges["kernel"].append((event.time_range.start, event.time_range.end))
    every = ranges["copy"] + ranges["kernel"]
    span = (max(end for _, end in every) - min(start for start, _ in every)) / 1e3 if every else 0.0
    return {"span_ms": span, "h2d_busy_ms": _busy_ms(ranges["copy"]), "kernels_busy_ms": _busy_ms(ranges["kernel"]),
            "idle_ms": span - _busy_ms(every), "copies": len(ranges["copy"])}


def host_models(args):
    """(the model to offload, the bf16 model whose greedy tokens it must give), both in host memory."""
    if args.experts == "bf16":
        model = build_model(args.model, "cpu", args.layers)
        return model, model
    model = build_model(args.model, args.device, args.layers)  # quantizing takes minutes on a few CPU cores
    twin = packed_twin(model, args.experts)  # `model` now holds the packed values dequantized
    return twin.cpu(), model.cpu()


def pool_estimate(estimate: str):
    """A context in which prompt layers reading the slot pool estimate their pairs per expert over the layer's
    experts ("layer", the library's) or over the pool's slots ("slots": `routed_experts` dropped)."""
    if estimate == "layer":
        return contextlib.nullcontext()
    fused_moe = moe.fused_moe
    return patch.object(moe, "fused_moe", lambda *args, routed_experts=None, **kwargs: fused_moe(*args, **kwargs))


def run(args) -> list[dict]:
    pcie = host_to_device_bandwidth(args.device)
    print(f"pinned host-to-device copy: {pcie / 1e9:.1f} GB/s", flush=True)
    host_model, reference = host_models(args)
    ids = torch.randint(0, host_model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    plan = plan_offload(host_model, args.device)
    rows = []
    resident = copy.deepcopy(reference).to(args.device)
    with torch.no_grad():
        expected, seconds = timed(lambda: resident.generate(ids.to(args.device), max_new_tokens=args.new,
                                                            do_sample=False), args.repeats, args.device)
    rows.append({"setup": "resident, transformers generate", "tokens_per_s": args.new / seconds})
    resident = None  # frees the device for the offloaded runs
    for fraction in args.resident:
        all_experts = plan.experts_per_layer * plan.layers
        budget = (plan.dense_bytes + plan.reserve_bytes
                  + max(int(fraction * all_experts), plan.experts_per_layer) * plan.blob_bytes)
        oracle = OracleDrafter(expected.cpu(), None, args.block, args.corruption, host_model.config.vocab_size)
        speculative = [] if args.decode_only else [(f"DFlash block {args.block}, oracle p={args.corruption}",
                                                    oracle, False)]
        if args.adaptive and not args.decode_only:
            speculative.append((f"DFlash adaptive width, oracle p={args.corruption}", oracle, True))
        copy_programs = list(itertools.product(args.copy_programs or [blob_copy.PROGRAMS],
                                               args.staged_copy_programs or [offload.STAGED_COPY_PROGRAMS]))
        compared = args.copy_programs or args.staged_copy_programs
        setups = [(f"{policy}, prefetch {ahead}, {manager}-managed"
                   + (f" ({programs} / {staged} copy programs ahead / staged)" if compared and manager == "device"
                      else "")
                   + f", {name}" + (f", prefill chunks of {chunk}" if len(args.prefill_chunk) > 1 else "")
                   + (f", estimate over the {estimate}" if len(args.pool_estimate) > 1 else ""),
                   policy, ahead, manager, programs, staged, drafter, adaptive, chunk, estimate)
                  for policy in args.policy for ahead in args.prefetch
                  for manager in managers(args.manager, args.device, policy, args.cpu_compute)
                  for programs, staged in (copy_programs if manager == "device" else copy_programs[:1])
                  for name, drafter, adaptive in [("decode", None, False), *speculative]
                  for chunk in args.prefill_chunk for estimate in args.pool_estimate]
        for name, policy, ahead, manager, programs, staged, drafter, adaptive, chunk, estimate in setups:
            blob_copy.PROGRAMS, offload.STAGED_COPY_PROGRAMS = programs, staged
            fast = dflash_compile.optimize(copy.deepcopy(host_model), drafter, gpu_memory=budget, device=args.device,
                                           adaptive=adaptive, offload_policy=policy, offload_prefetch=ahead,
                                           offload_manager=manager, offload_cpu_compute=args.cpu_compute,
                                           mode=args.mode, prefill_chunk=chunk)
            with pool_estimate(estimate):
                out, whole_s, prefill_s, whole, prefill = decode_measurement(fast, ids.to(args.device), args.new,
                                                                             args.repeats)
            decode_s, decode_bytes = whole_s - prefill_s, whole.bytes_fetched - prefill.bytes_fetched
            if decode_s <= 0:  # tiny models: the two medians' noise exceeds the decode time
                decode_s = float("nan")
            rows.append({
                "setup": f"dflash offload {fraction:.0%} resident, {name}", "tokens_per_s": args.new / whole_s,
                "prefill_ms": prefill_s * 1e3,
                "decode_tokens_per_s": (args.new - 1) / decode_s, "bytes_per_token": decode_bytes / (args.new - 1),
                "h2d_gb_s": whole.bytes_fetched / whole_s / 1e9, "hit_rate": whole.hit_rate,
                "tau": fast.last_stats.tau, "coverage": whole.coverage, "waste": whole.waste,
                "on_cpu_per_token": whole.computed_on_host / args.new,
                "routing_wait_ms_per_token": whole.routing_wait_s * 1e3 / args.new,
                "floor_ratio": decode_s / (decode_bytes / pcie), "slots": fast.model.dflash_offload.slots,
                "check": slots_and_tokens_check(fast.model.dflash_offload, expected, out)})
            print(rows[-1], flush=True)
            if adaptive:
                print(f"{name}: {width_summary(fast)}", flush=True)
            if args.trace and args.device == "cuda":  # one profiled generation per setup, after the timed ones
                args.trace.mkdir(parents=True, exist_ok=True)
                trace = args.trace / (re.sub(r"[^A-Za-z0-9.]+", "_", f"{fraction:.0%} {name}") + ".json")
                print(f"timeline ({trace}):", copy_timeline(fast, ids.to(args.device), args.new, trace), flush=True)
            fast = None
        if args.accelerate_new == 0:
            continue
        print(time.strftime("%X"), "accelerate: dispatching", flush=True)
        accelerated = accelerate_offloaded(copy.deepcopy(reference), budget, args.device)
        print(time.strftime("%X"), "accelerate: generating", flush=True)
        new = args.accelerate_new or args.new  # accelerate is slow: fewer tokens give the same rate
        with torch.no_grad():
            out, seconds = timed(lambda: accelerated.generate(ids.to(args.device), max_new_tokens=new,
                                                              do_sample=False), args.repeats, args.device)
        rows.append({"setup": f"accelerate offload, same budget ({fraction:.0%} of experts)",
                     "tokens_per_s": new / seconds, "check": first_mismatch(expected[:, :ids.shape[1] + new], out)})
        print(rows[-1], flush=True)
        accelerated = None
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen3_moe", help="tiny-<family>, gpt-oss-20b or qwen3-30b-a3b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--resident", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--layers", type=int, help="keep only the first LAYERS layers of a reference shape (host RAM)")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--corruption", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policy", nargs="+", default=["lru"], choices=["lru", "lfu"])
    parser.add_argument("--prefetch", type=int, nargs="+", default=[1],
                        help="MoE layers ahead to prefetch predicted experts for (0: off); several compare them")
    parser.add_argument("--manager", nargs="+", default=["auto"], choices=MANAGERS,
                        help="who manages the expert cache: the host (a routing read per layer), the device, or auto "
                             "(the library's default: the device on CUDA with LRU and no CPU compute)")
    parser.add_argument("--copy-programs", type=int, nargs="+",
                        help="programs of the device manager's copy kernel (default kernels.blob_copy.PROGRAMS); "
                             "several compare them")
    parser.add_argument("--staged-copy-programs", type=int, nargs="+",
                        help="programs of a prompt layer's copy of its own experts (default "
                             "offload.STAGED_COPY_PROGRAMS); several compare them")
    parser.add_argument("--adaptive", action="store_true", help="also run DFlash with the adaptive verify width")
    parser.add_argument("--decode-only", action="store_true", help="plain decoding only (no DFlash rows)")
    parser.add_argument("--cpu-compute", default="off", choices=["off", "auto", "always"],
                        help="run missed experts on the CPU (C++ kernels) instead of copying them")
    parser.add_argument("--accelerate-new", type=int,
                        help="new tokens for the accelerate rows (default --new; 0 skips them)")
    parser.add_argument("--mode", help="torch.compile mode of the verify step (default: optimize's, CUDA graphs around "
                                       'the offload ops on CUDA; "default": every kernel launched from Python)')
    parser.add_argument("--prefill-chunk", type=int, nargs="+", default=[None],
                        help="prefill chunk sizes to time (models with sliding-window layers prefill in chunks; "
                             "default: optimize's, the whole prompt where it goes unmasked)")
    parser.add_argument("--experts", default="bf16", choices=["bf16", "mxfp4", "fp8_block"],
                        help="the routed experts' format (packed ones quantized from the random bf16 weights)")
    parser.add_argument("--pool-estimate", nargs="+", default=["layer"], choices=["layer", "slots"],
                        help="what a prompt layer reading the slot pool estimates its pairs per expert over: the "
                             "layer's experts (the library's) or the pool's slots; several compare them")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--trace", type=Path, help="a folder: write each setup's Chrome trace (CUDA) there and print "
                                                    "how long copies, kernels and neither kept the GPU busy")
    args = parser.parse_args()
    rows = run(args)
    print(f"# {args.model} ({args.layers or 'all'} layers, {args.experts} experts) on {args.device}, prompt "
          f"{args.prompt}, {args.new} new tokens, median of {args.repeats}")
    print("| setup | tok/s (with prefill) | prefill ms | decode tok/s | decode bytes/token | decode time / PCIe floor "
          "| H2D GB/s | hit rate | coverage | waste | tau | check |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        cells = [f"{row.get(k):.3g}" if isinstance(row.get(k), float) else str(row.get(k, "-"))
                 for k in ("tokens_per_s", "prefill_ms", "decode_tokens_per_s", "bytes_per_token", "floor_ratio",
                           "h2d_gb_s", "hit_rate", "coverage", "waste", "tau")]
        print(f"| {row['setup']} | " + " | ".join(cells) + f" | {row.get('check', 'reference')} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
