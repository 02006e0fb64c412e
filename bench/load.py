"""A quantized checkpoint from disk to generated tokens at full size: `dflash_compile.from_pretrained`, resident and
offloaded, against transformers' `from_pretrained` of the same directory dequantized to bf16 (what it runs without
the `kernels` package: MXFP4 experts fall back to it, FP8 layers need `kernels`).

    python bench/load.py --model gpt-oss-20b --resident 0.25            # H200: a 13 GB MXFP4 checkpoint, 24 layers
    python bench/load.py --model tiny-gpt_oss --device cpu               # plumbing check

The checkpoint is written by `dflash_compile.quantize` from the random bf16 weights of `build_model` (into --dir, a
temporary directory by default). Each side, memory counted from what the process held before its load: seconds to
load, device memory it then holds and its peak while generating, host memory it then holds and its peak during the
load (anonymous: not the checkpoint's memory-mapped pages, which the kernel can drop), seconds of the first generation
(compilation included), tokens/s of the next --repeats (median) and its tokens against transformers'. The offloaded
budget is the dense weights plus --resident of the routed experts (as bench/offload.py).
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spec_decode import build_model, first_mismatch  # noqa: E402

import dflash_compile  # noqa: E402
from dflash_compile.benchmark import timed  # noqa: E402
from dflash_compile.offload import plan_offload  # noqa: E402
from dflash_compile.testing import tiny_config  # noqa: E402


def host_bytes() -> int:
    """This process's anonymous resident host memory (Linux's RssAnon: not the checkpoint's memory-mapped file
    pages, which the kernel can drop and read again)."""
    return int(re.search(r"RssAnon:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


class HostPeak(threading.Thread):
    """The peak of `host_bytes` while in its `with` block, sampled every millisecond."""

    def __enter__(self):
        self.peak, self.running = host_bytes(), True
        self.start()
        return self

    def run(self):
        while self.running:
            self.peak = max(self.peak, host_bytes())
            time.sleep(1e-3)

    def __exit__(self, *exc):
        self.running = False
        self.join()


def device_bytes(device: str, peak: bool = False) -> int:
    if not device.startswith("cuda"):
        return 0
    return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()


def quantizable_model(args) -> transformers.PreTrainedModel:
    """`build_model`'s model; a tiny one with its MLP widths at 128, which both formats' blocks divide."""
    if not args.model.startswith("tiny-"):
        return build_model(args.model, args.device, args.layers)
    config = tiny_config(args.model.removeprefix("tiny-"))
    for key in ("intermediate_size", "moe_intermediate_size"):
        if hasattr(config, key):
            setattr(config, key, 128)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(args.device)


def write_checkpoint(args, directory: Path) -> None:
    model = quantizable_model(args)
    start = time.perf_counter()
    dflash_compile.quantize(model, directory, args.format)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    print(f"{args.format} checkpoint: {size / 2**30:.2f} GiB written in {time.perf_counter() - start:.1f} s",
          flush=True)


def budget(directory: Path, device: str, fraction: float) -> int:
    """Device bytes for the dense weights, the runtime's reserve and `fraction` of all routed experts."""
    plan = plan_offload(dflash_compile.load_packed(directory), device)
    experts = max(int(fraction * plan.experts_per_layer * plan.layers), plan.experts_per_layer)
    return plan.dense_bytes + plan.reserve_bytes + experts * plan.blob_bytes


def measure(name: str, load, generate, args, expected: torch.Tensor | None) -> torch.Tensor:
    """Load, generate once (compiling), time --repeats generations; print one row. Returns the tokens. Memory is
    counted from what the process held before the load."""
    torch._dynamo.reset()  # each side compiles afresh, and no earlier side's compiled graphs hold its weights
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    device_before, host_before = device_bytes(args.device), host_bytes()
    with HostPeak() as host:
        start = time.perf_counter()
        model = load()
        load_s = time.perf_counter() - start
    held, host_held = device_bytes(args.device) - device_before, host_bytes() - host_before
    start = time.perf_counter()
    generate(model)
    first_s = time.perf_counter() - start
    out, seconds = timed(lambda: generate(model), args.repeats, args.device)
    device_peak = device_bytes(args.device, peak=True) - device_before
    check = "reference" if expected is None else first_mismatch(expected, out)
    print(f"| {name} | {load_s:.1f} | {held / 2**30:.2f} | {device_peak / 2**30:.2f} | {host_held / 2**30:.2f} | "
          f"{(host.peak - host_before) / 2**30:.2f} | {first_s:.1f} | {args.new / seconds:.1f} | {check} |", flush=True)
    return out


def checkpoint_arguments(description: str, resident: float) -> argparse.ArgumentParser:
    """The options of a benchmark over a checkpoint `write_checkpoint` writes (this script's and warm_start.py's)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="tiny-gpt_oss", help="tiny-<family>, gpt-oss-20b or qwen3-30b-a3b")
    parser.add_argument("--format", help="mxfp4 or fp8_block (default: the family's: mxfp4 for gpt-oss)")
    parser.add_argument("--layers", type=int, help="the first LAYERS layers of a reference shape (default all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--resident", type=float, default=resident, help="fraction of routed experts on the device")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where to write the checkpoint (default: a temporary directory)")
    return parser


def family_format(args) -> str:
    return args.format or ("mxfp4" if "gpt" in args.model else "fp8_block")


def main() -> None:
    args = checkpoint_arguments(__doc__.splitlines()[0], resident=0.25).parse_args()
    args.format = family_format(args)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        write_checkpoint(args, directory)
        gc.collect()
        config = transformers.AutoConfig.from_pretrained(directory)
        ids = torch.randint(0, config.vocab_size, (1, args.prompt), device=args.device)
        # dequantized to bf16: what transformers runs without the `kernels` package (None would drop FP8's scales)
        quantization = (transformers.Mxfp4Config if args.format == "mxfp4" else transformers.FineGrainedFP8Config)(
            dequantize=True)
        print(f"# {args.model} ({args.layers or 'all'} layers), {args.format} checkpoint, {args.device}, prompt "
              f"{args.prompt}, {args.new} new tokens, median of {args.repeats}; torch {torch.__version__}, "
              f"transformers {transformers.__version__}\n| side | load s | device GiB held | device GiB peak "
              "(generating) | host GiB held | host GiB peak (load) | first generate s | tok/s | tokens |\n"
              "|---|---|---|---|---|---|---|---|---|", flush=True)
        expected = measure(
            "transformers from_pretrained + generate",
            lambda: transformers.AutoModelForCausalLM.from_pretrained(
                directory, dtype=torch.bfloat16, device_map=args.device, quantization_config=quantization),
            lambda model: model.generate(ids, max_new_tokens=args.new, do_sample=False), args, None)
        ours = lambda fast: fast.generate(ids, max_new_tokens=args.new)  # noqa: E731
        measure("dflash_compile.from_pretrained, resident", lambda: dflash_compile.from_pretrained(
            directory, device=args.device), ours, args, expected)
        gpu_memory = budget(directory, args.device, args.resident)
        measure(f"dflash_compile.from_pretrained, gpu_memory {gpu_memory / 2**30:.3g} GiB ({args.resident:.0%} of "
                "experts)", lambda: dflash_compile.from_pretrained(directory, gpu_memory=gpu_memory,
                                                                    device=args.device), ours, args, expected)


if __name__ == "__main__":
    main()
