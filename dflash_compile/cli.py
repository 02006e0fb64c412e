"""The `dflash-compile` command line.

    dflash-compile generate --prompt "def fibonacci(n):"   # the bundled tiny target + drafter pair
    dflash-compile generate --model PATH --drafter PATH --prompt "..." --stream
    dflash-compile train-drafter --target PATH --data texts.jsonl --out drafter/ [--block-size 16 --layers 2]
    dflash-compile quantize --model PATH --out DIR --format mxfp4|fp8_block [--max-shard-size 2GB]   # from disk
    dflash-compile bench [--model PATH --drafter PATH] --out DIR   # table + acceptance / step-time plots
    dflash-compile roofline --model gpt-oss-20b --device h200 --csv out.csv
    dflash-compile calibrate --out hardware.json           # this machine's bandwidths and FLOP/s
    dflash-compile explain                                 # passes on a tiny random gpt-oss model
    dflash-compile explain --model PATH --graphs           # any supported checkpoint directory, graphs printed
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from .offload import MANAGERS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _load(args) -> torch.nn.Module:
    """The model `explain` runs: --model's checkpoint as `generate` loads it (quantized experts kept packed, where
    transformers would expand them), or the built-in tiny model of --family."""
    from .pair import load_model
    from .testing import load_tiny_model

    if args.model is None:
        return load_tiny_model(args.family, DTYPES[args.dtype])
    return load_model(args.model, "cpu", DTYPES[args.dtype])


def explain_command(args) -> int:
    from . import dflash_backend, explain
    from .benchmark import timed_together

    model = _load(args)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    report = explain(model, ids)
    print(report)
    if args.graphs:
        for i, graph in enumerate(report.graphs):
            print(f"\n--- graph {i} after the passes ---\n{graph.after}")
    with torch.no_grad():
        compiled = torch.compile(model, backend=dflash_backend, fullgraph=report.graph_break_count == 0)
        (expected, eager_s), (actual, compiled_s) = timed_together(
            [lambda: model(ids).logits, lambda: compiled(ids).logits], args.repeats, ids.device)
    difference = (actual.float() - expected.float()).abs().max().item()
    print(f"max |compiled - eager| logits: {difference:.3g}")
    print(f"forward over {args.tokens} tokens, median of {args.repeats}: eager {eager_s * 1e3:.2f} ms, "
          f"dflash {compiled_s * 1e3:.2f} ms ({eager_s / compiled_s:.2f}x)")
    return 0


def _device(name: str | None) -> str:
    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def _dtype(name: str | None, device: str, bundled: bool) -> torch.dtype:
    """The named dtype; by default bfloat16 for a --model checkpoint on CUDA (the supported families' own dtype, and
    what the GPU kernels are tuned for: float32 would double the weights' memory), else float32 (a CPU's bf16
    matmuls are slow; the bundled tiny pair's numbers, and its token identity with transformers, are float32's)."""
    return DTYPES[name] if name else torch.bfloat16 if device.startswith("cuda") and not bundled else torch.float32


def _sampling(args) -> dict:
    """`generate`'s sampling settings from --sample (temperature, top-k and top-p left out fall back to the model's
    generation_config, as transformers' generate does); {} for greedy decoding."""
    settings = {name: value for name in ("temperature", "top_k", "top_p") if (value := getattr(args, name)) is not None}
    given = [f"--{name.replace('_', '-')}" for name in settings] + ["--seed"] * (args.seed is not None)
    if given and not args.sample:
        raise SystemExit(f"{', '.join(given)} apply when sampling: add --sample (without it generation is greedy)")
    return {"do_sample": True, **settings} if args.sample else {}


def _compiles(choice: bool | None, device: str) -> bool:
    """--compile / --no-compile as given, else compile where Inductor can: on CUDA, and on a CPU with a C++ compiler
    for its generated code (without one the step runs eagerly, and stderr says why)."""
    if choice is not None:
        return choice
    if device.startswith("cuda"):
        return True
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        print("no C++ compiler for Inductor's CPU code (install g++ or set CXX to compile the step): the step runs "
              "eagerly", file=sys.stderr, flush=True)
        return False
    return True


def generate_command(args) -> int:
    """Speculative generation of one prompt, greedy or sampled (one token a step on the compiled step when --model
    comes without --drafter), then plain decoding of the same prompt for the speedup."""
    from transformers import TextStreamer

    from . import optimize
    from .benchmark import timed_together
    from .pair import load_target, pair_paths

    if args.drafter and not args.model:
        raise SystemExit("--drafter needs --model, the target it drafts for (without either: the bundled pair)")
    sampling = _sampling(args)
    target_dir, drafter_dir = (args.model, args.drafter) if args.model else pair_paths()
    device = _device(args.device)
    dtype = _dtype(args.dtype, device, bundled=args.model is None)
    model, tokenizer = load_target(target_dir, "cpu" if args.gpu_memory else device, dtype)
    compile = _compiles(args.compile, device)
    # a seed fixes the verify width at the drafter's block: the adaptive width follows measured step times, and the
    # width sets how many random numbers a step draws, so the same seed would not give the same text
    fast = optimize(model, drafter=drafter_dir, compile=compile, gpu_memory=args.gpu_memory, device=device,
                    offload_manager=args.offload_manager, prefill_chunk=args.prefill_chunk,
                    adaptive=args.seed is None)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)
    streamer = TextStreamer(tokenizer) if args.stream else None
    if compile:  # a silent minute on a full-size model otherwise (docs/benchmarks.md, session 42)
        print("compiling the step in the first generate; Inductor's and Triton's caches keep it for later processes",
              file=sys.stderr, flush=True)
    seed = 0 if args.seed is None else args.seed
    generator = torch.Generator(device).manual_seed(seed)  # ours; transformers' generate draws from torch's
    ours = dict(max_new_tokens=args.max_new_tokens, **sampling, generator=generator if sampling else None)
    start = time.perf_counter()
    output = fast.generate(ids, streamer=streamer, **ours)
    if compile:
        print(f"first generate, compiling included: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if not args.stream:
        print(tokenizer.decode(output[0]))
    new_tokens = output.shape[1] - ids.shape[1]
    torch.manual_seed(seed)
    (plain, plain_seconds), (_, ours_seconds) = timed_together(
        [lambda: model.generate(ids, max_new_tokens=args.max_new_tokens, **{"do_sample": False, **sampling}),
         lambda: fast.generate(ids, **ours)], args.repeats, device)
    stats = fast.last_stats  # the last timed run's (the width chooser keeps learning from run to run)
    widths = ", ".join(f"{w} token{'s' * (w > 1)} x {stats.widths.count(w)}"
                       for w in sorted(set(stats.widths), reverse=True))
    print(f"\n--- {new_tokens} new tokens, block {stats.block_size}, {stats.steps} verify steps ({widths}), "
          f"mean accepted length {stats.tau:.2f}")
    if args.gpu_memory:
        from .explain import expert_placement

        print(f"experts: {expert_placement(model)}")
    # sampled, the two sides draw from one distribution with their own random numbers: their tokens differ
    tokens = "sampled from the same distribution" if sampling else f"same tokens: {torch.equal(output, plain)}"
    print(f"median of {args.repeats}: dflash {new_tokens / ours_seconds:.1f} tok/s, plain decoding (transformers "
          f"generate) {new_tokens / plain_seconds:.1f} tok/s: {plain_seconds / ours_seconds:.2f}x; {tokens}")
    return 0


def _read_texts(path: Path) -> list[str]:
    """One text per line of a .jsonl file: {"text": ...} objects or JSON strings."""
    texts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            texts.append(item["text"])
        elif isinstance(item, str):
            texts.append(item)
        else:
            raise SystemExit(f"{path}:{number}: expected a JSON string or an object with a \"text\" string")
    if not texts:
        raise SystemExit(f"{path} has no texts")
    return texts


def train_drafter_command(args) -> int:
    from .pair import load_target
    from .training import DrafterTraining, train_drafter

    texts = _read_texts(Path(args.data))
    model, tokenizer = load_target(args.target, _device(args.device))
    settings = DrafterTraining(block_size=args.block_size, layers=args.layers, steps=args.steps,
                               batch_size=args.batch_size, sequences=args.sequences,
                               prompt_length=args.prompt_length, continuation_length=args.continuation_length,
                               learning_rate=args.learning_rate)
    out = train_drafter(model, texts, args.out, tokenizer=tokenizer, settings=settings,
                        mask_token_id=args.mask_token_id)
    print(f"drafter written to {out} (training log: {out / 'training' / 'log.jsonl'})")
    return 0


def quantize_command(args) -> int:
    from .checkpoint import checkpoint_directory, quantize_checkpoint, stored_expert_bytes
    from .pair import load_tokenizer

    source = checkpoint_directory(args.model)
    tokenizer = load_tokenizer(source)  # a checkpoint without one is refused before its weights are read
    out = quantize_checkpoint(source, args.out, args.format, DTYPES[args.dtype], args.max_shard_size)
    tokenizer.save_pretrained(out)
    weight_bytes, weights = stored_expert_bytes(out)
    files = len(list(out.glob("model*.safetensors")))
    print(f"{args.format} checkpoint written to {out} ({files} weight file{'s' * (files > 1)}): routed experts "
          f"{weight_bytes / 2**20:.1f} MiB, {weight_bytes * 8 / weights:.2f} bits per weight")
    return 0


def roofline_command(args) -> int:
    from .checkpoint import checkpoint_format
    from .cost_model import BITS_PER_WEIGHT, HARDWARE, Hardware, ModelSizes, StepCost, reference_config, write_csv
    from .pair import DEFAULT_PAIR

    hardware = Hardware.load(args.hardware) if args.hardware else HARDWARE[args.device]
    model = args.model or str(DEFAULT_PAIR / "target")
    config = reference_config(model)
    try:  # as `load_packed` keeps them (DeepSeek-V4's release: MXFP4 experts beside FP8 linears)
        stored, fp8_linears = checkpoint_format(config.to_dict())
    except ValueError:  # not quantized, or in a format dflash-compile does not pack: bf16
        stored, fp8_linears = "bf16", False
    expert_format = args.expert_format or stored
    weight_format = "fp8_block" if fp8_linears or expert_format == "fp8_block" else "bf16"
    cost = StepCost(ModelSizes.of(config), hardware, weight_bits=BITS_PER_WEIGHT[weight_format],
                    expert_bits=BITS_PER_WEIGHT[expert_format])
    rows = []
    for block in args.blocks:
        tau = (1 - args.acceptance**block) / (1 - args.acceptance) if args.acceptance < 1 else float(block)
        costs = cost.evaluate(block, args.context, args.hit_rate, tau)
        rows.append({"model": model, "hardware": hardware.name} | costs)
    print(f"{model} on {hardware.name} ({expert_format} experts), context {args.context}, per-token acceptance "
          f"{args.acceptance}, expert-cache hit rate {args.hit_rate}")
    print(f"{'block':>5} {'experts/layer':>13} {'MB':>9} {'step us':>9} {'fetch us':>9} {'tau':>5} {'tok/s':>8}")
    for row in rows:
        print(f"{row['block']:5d} {row['distinct_experts_per_layer']:13.1f} {row['bytes'] / 1e6:9.1f} "
              f"{row['t_step_us']:9.1f} {row['t_fetch_us']:9.1f} {row['tau']:5.2f} {row['tokens_per_s']:8.1f}")
    best = max(rows, key=lambda row: row["tokens_per_s"])
    print(f"best block: {best['block']} ({best['tokens_per_s']:.1f} tok/s predicted)")
    if args.csv:
        print(f"wrote {write_csv(rows, args.csv)}")
    return 0


def bench_command(args) -> int:
    """Side-by-side table (markdown) and plots for a target + drafter pair, the bundled one by default."""
    from .benchmark import compare, markdown, plots
    from .cost_model import HARDWARE, Hardware, ModelSizes, StepCost, calibrate
    from .pair import heldout_prompts, load_target, pair_paths

    if (args.model is None) != (args.drafter is None):
        raise SystemExit("give both --model and --drafter, or neither for the bundled pair")
    target_dir, drafter_dir = (args.model, args.drafter) if args.model else pair_paths()
    device = _device(args.device)
    model, tokenizer = load_target(target_dir, device, _dtype(None, device, bundled=args.model is None))
    texts = Path(args.prompts).read_text().split("\n\n\n") if args.prompts else heldout_prompts()
    ids = [tokenizer(t, return_tensors="pt").input_ids.to(device) for t in texts]
    ids = [i for i in ids if model.generate(i, max_new_tokens=16, do_sample=False).shape[1] - i.shape[1] == 16]
    if not ids:
        raise SystemExit("every prompt ends within 16 tokens; give prompts the model continues")
    compile = _compiles(args.compile, device)
    rows = compare(model, ids[: args.count], Path(drafter_dir), args.max_new_tokens, args.repeats, compile)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = (f"{Path(target_dir).name} + {Path(drafter_dir).name} on {device}, {min(len(ids), args.count)} prompts x "
             f"{args.max_new_tokens} tokens, median of {args.repeats}, {time.strftime('%Y-%m-%d')}")
    table = markdown(rows, title)
    (out / "report.md").write_text(table)
    hardware = Hardware.load(args.hardware) if args.hardware else (
        HARDWARE["h200"] if device.startswith("cuda") else calibrate("cpu", size_mib=64, repeats=3))
    cost = StepCost(ModelSizes.of(model.config), hardware)
    block = json.loads((Path(drafter_dir) / "config.json").read_text())
    block = (block.get("dflash_config") or {}).get("block_size") or block["block_size"]
    predicted = {w: cost.evaluate(w, 128)["t_step_us"] * 1e-6 for w in (1, block)}
    print(table)
    for path in [out / "report.md", *plots(rows, block, predicted, out)]:
        print(f"wrote {path}")
    return 0


def calibrate_command(args) -> int:
    from .cost_model import calibrate

    hardware = calibrate(args.device)
    print(f"{hardware.name}: memory {hardware.hbm / 1e9:.1f} GB/s, host-to-device {hardware.pcie / 1e9:.1f} GB/s, "
          f"matmul {hardware.flops / 1e12:.2f} TFLOP/s")
    print(f"wrote {hardware.save(args.out)} (use with: dflash-compile roofline --hardware {args.out})")
    return 0


def build_kernels_command(args) -> int:
    """Part of the set-up commands: a machine without a compiler still works (the reference runs), so the status
    is reported, not turned into a failure."""
    from .kernels import cpu, cuda_rows

    print(cpu.status())
    print(cuda_rows.status())  # built here on an H100, or any Hopper GPU with DFLASH_CUDA_ROWS=1
    return 0


def _shard_size(size: str) -> int:
    """--max-shard-size in bytes ("2GB", "500MB" or a number of bytes), refused as the command line is read."""
    from .checkpoint import shard_bytes

    try:
        return shard_bytes(int(size) if size.isdigit() else size)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    from .checkpoint import FORMATS, SHARD_SIZE
    from .cost_model import BITS_PER_WEIGHT, HARDWARE, REFERENCE_CONFIGS
    from .testing import TINY_CONFIGS
    from .training import DrafterTraining

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

    generate = commands.add_parser("generate", help="speculative generation of a prompt, with the speedup")
    generate.add_argument("--prompt", default="def fibonacci(n):\n")
    generate.add_argument("--model", help="target checkpoint directory or Hub repo id (default: the bundled tiny "
                                          "pair)")
    generate.add_argument("--drafter", help="drafter checkpoint directory or Hub repo id for --model (without one: "
                                            "one token a step on the compiled step)")
    generate.add_argument("--max-new-tokens", type=int, default=128)
    generate.add_argument("--dtype", choices=sorted(DTYPES),
                          help="default: bfloat16 for --model on CUDA, else float32 (the bundled pair, a CPU)")
    generate.add_argument("--device", help="default: cuda when available")
    generate.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                          help="compile the verify step (default: yes where Inductor can, on CUDA and on a CPU "
                               "with a C++ compiler; the first generate then includes the compile, ~30 s for the "
                               "bundled pair on a 2-core CPU, less once Inductor's cache holds it)")
    generate.add_argument("--stream", action="store_true", help="print tokens as each verify step commits them")
    generate.add_argument("--sample", action="store_true",
                          help="sample instead of greedy decoding, exactly from the model's distribution (the "
                               "generation_config's temperature, top-k and top-p unless given)")
    generate.add_argument("--temperature", type=float, help="with --sample")
    generate.add_argument("--top-k", type=int, help="with --sample")
    generate.add_argument("--top-p", type=float, help="with --sample")
    generate.add_argument("--seed", type=int,
                          help="with --sample: the random numbers' seed, for the same text on every run (the verify "
                               "width is then fixed at the drafter's block: the adaptive width follows measured step "
                               "times and sets how many numbers a step draws)")
    generate.add_argument("--repeats", type=int, default=5, help="timed generations per side (alternating)")
    generate.add_argument("--gpu-memory", help="offload routed experts to host memory under this budget, e.g. 20GiB")
    generate.add_argument("--prefill-chunk", type=int,
                          help="tokens per prompt forward, to bound the prefill's memory (default: the whole "
                               "prompt, or 4096 for a masked prompt of a model with sliding-window layers)")
    generate.add_argument("--offload-manager", choices=MANAGERS, default="auto",
                          help="who manages the offloaded experts' cache: the host, reading each layer's routing, or "
                               "the GPU itself (no host read per layer; the whole step one CUDA graph); auto: the GPU "
                               "on CUDA with the LRU policy and no CPU compute, else the host")
    generate.set_defaults(run=generate_command)

    train = commands.add_parser("train-drafter", help="train a DFlash drafter for a target on its own outputs")
    train.add_argument("--target", required=True, help="target checkpoint directory (with its tokenizer)")
    train.add_argument("--data", required=True, help=".jsonl file: one {\"text\": ...} object or string per line")
    train.add_argument("--out", required=True, help="drafter directory to write (resumes if it has a state)")
    defaults = DrafterTraining()
    train.add_argument("--block-size", type=int, default=defaults.block_size)
    train.add_argument("--layers", type=int, default=defaults.layers)
    train.add_argument("--steps", type=int, default=defaults.steps)
    train.add_argument("--batch-size", type=int, default=defaults.batch_size)
    train.add_argument("--sequences", type=int, default=defaults.sequences,
                       help="prompts the target continues to make the training data")
    train.add_argument("--prompt-length", type=int, default=defaults.prompt_length)
    train.add_argument("--continuation-length", type=int, default=defaults.continuation_length)
    train.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    train.add_argument("--mask-token-id", type=int, help="default: the tokenizer's mask token")
    train.add_argument("--device", help="default: cuda when available")
    train.set_defaults(run=train_drafter_command)

    quantize = commands.add_parser("quantize", help="write a model as an MXFP4 (gpt-oss) or FP8 block checkpoint")
    quantize.add_argument("--model", required=True,
                          help="bf16 / fp32 checkpoint directory or Hub repo id, read a module at a time from disk")
    quantize.add_argument("--out", required=True, help="directory for the quantized checkpoint")
    quantize.add_argument("--format", required=True, choices=FORMATS)
    quantize.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype to read the model in")
    quantize.add_argument("--max-shard-size", default=SHARD_SIZE, type=_shard_size,
                          help="largest weight file, e.g. 2GB or bytes (default %(default)s); memory holds about one "
                               "while writing, so a smaller size bounds it lower")
    quantize.set_defaults(run=quantize_command)

    roofline = commands.add_parser("roofline", help="predicted step times and tokens/s per block size (cost model)")
    roofline.add_argument("--model", help=f"checkpoint directory or a reference name ({', '.join(REFERENCE_CONFIGS)}); "
                                          "default: the bundled pair's target")
    roofline.add_argument("--device", default="h200", choices=sorted(HARDWARE))
    roofline.add_argument("--hardware", help="a profile written by `dflash-compile calibrate` (overrides --device)")
    roofline.add_argument("--expert-format", choices=sorted(BITS_PER_WEIGHT),
                          help="default: from the checkpoint's quantization_config, else bf16")
    roofline.add_argument("--context", type=int, default=2048)
    roofline.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    roofline.add_argument("--acceptance", type=float, default=0.8,
                          help="per-draft acceptance rate: tau(B) = (1 - a^B) / (1 - a)")
    roofline.add_argument("--hit-rate", type=float, default=1.0, help="expert-cache hit rate when offloading")
    roofline.add_argument("--csv", help="write the rows here")
    roofline.set_defaults(run=roofline_command)

    bench = commands.add_parser("bench", help="side-by-side tokens/s table and plots (bundled pair by default)")
    bench.add_argument("--model", help="target checkpoint directory (with --drafter)")
    bench.add_argument("--drafter", help="drafter checkpoint directory")
    bench.add_argument("--prompts", help="text file, prompts separated by two empty lines (default: held-out ones)")
    bench.add_argument("--count", type=int, default=4, help="prompts to run")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--device", help="default: cuda when available")
    bench.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="compile the verify steps (default: as for generate)")
    bench.add_argument("--hardware", help="profile from `dflash-compile calibrate` for the predicted step times")
    bench.add_argument("--out", default="dflash-bench", help="directory for report.md and the PNG plots")
    bench.set_defaults(run=bench_command)

    calibrate = commands.add_parser("calibrate", help="measure this machine's bandwidths and FLOP/s for the model")
    calibrate.add_argument("--out", default="hardware.json")
    calibrate.add_argument("--device", help="default: cuda when available")
    calibrate.set_defaults(run=calibrate_command)

    build = commands.add_parser("build-kernels", help="compile the C++ CPU kernels (and, where they are on, the CUDA "
                                                      "row kernels) now, else on their first use")
    build.set_defaults(run=build_kernels_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    import transformers

    transformers.logging.set_verbosity_error()  # keep the report readable: no config dumps
    transformers.logging.disable_progress_bar()
    args = build_parser().parse_args(argv)
    if getattr(args, "tokens", 1) < 1:
        raise SystemExit("--tokens must be at least 1")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:  # the library's input checks name the problem and the fix
        raise SystemExit(f"dflash-compile {args.command}: {error}") from None


if __name__ == "__main__":
    sys.exit(main())
