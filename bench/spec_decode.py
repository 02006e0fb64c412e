"""Speculative decoding benchmark: optimize(...).generate vs model.generate vs transformers' native DFlash.

    python bench/spec_decode.py --model tiny-gpt_oss                  # CPU, tiny model (seconds)
    python bench/spec_decode.py --model gpt-oss-20b --device cuda      # H200, random bf16 weights at real shape
    python bench/spec_decode.py --model gpt-oss-20b --experts mxfp4    # the same experts kept MXFP4 on our side

Side by side in one run, batch 1, greedy, medians of --repeats:
  * plain `model.generate` (eager, the library default users run);
  * ours without a drafter (the compiled step with a 1-token block);
  * ours with an oracle drafter proposing the target's own greedy tokens, each corrupted with probability p, so
    the mean accepted length tau is controlled (block --block);
  * transformers' native DFlash (`assistant_model=`, `speculation_type="dflash"`) with a random drafter (its
    acceptance is about 1: this row shows the cost of its machinery);
  * step times (CUDA only) of one decode step and of 8- and 16-token verify steps with uniform random routing,
    next to each step's memory-bandwidth floor: every weight the step reads once (attention, router, shared
    parameters, lm_head, the KV cache) plus the experts the block actually touched, at the device-to-device copy
    bandwidth measured in the same run.

With `--experts mxfp4` (or `fp8_block`) our rows run a copy of the model whose routed experts are quantized and kept
packed (the fused kernel reads 4.25 / 8 bits per weight), while every transformers row runs the model with those
experts dequantized back to bf16 -- what transformers does with such a checkpoint when its kernels hub is not
reachable -- so both sides compute with the same weight values.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile

import torch
import transformers

import dflash_compile
from dflash_compile.benchmark import timed
from dflash_compile.cache import TargetCache
from dflash_compile.cost_model import (BITS_PER_WEIGHT, HARDWARE, REFERENCE_CONFIGS, B, C, Hardware, ModelSizes,
                                       StepCost, reference_config)
from dflash_compile.families import auto_model_class, experts_modules, routed_top_k, router_of, zero_compute_experts
from dflash_compile.packed import PackedWeight, attach_packed, expert_weights
from dflash_compile.speculative import generation_context
from dflash_compile.testing import (
    OracleDrafter, load_tiny_model, random_drafter_weights, randomize_token_routes, save_drafter, tiny_drafter_config)

def build_model(name: str, device: str, layers: int | None = None) -> transformers.PreTrainedModel:
    """A tiny test model, or a reference shape with random bf16 weights (its first `layers` layers when given)."""
    if name.startswith("tiny-"):
        return load_tiny_model(name.removeprefix("tiny-")).to(device)
    kinds = getattr(reference_config(name), "layer_types", None) or ["attention"]
    first_attention = next(layer for layer, kind in enumerate(kinds) if kind != "linear_attention")
    if layers and layers <= first_attention:
        raise SystemExit(f"--layers {layers} keeps only linear-attention layers of {name}, and model.generate needs "
                         f"an attention layer in its cache: keep at least {first_attention + 1}")
    config = reference_config(name, layers)
    with torch.device(device):
        model = auto_model_class(config).from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # transformers initialises biases and sinks to zero; small random values are realistic
        for tensor in model.parameters():
            if not tensor.any():
                tensor.normal_(0, 0.02)
        randomize_token_routes(model)  # DeepSeek-V4's first layers' experts by token id: all expert 0 as initialised
        make_confident(model)
    return model.eval()


def packed_twin(model, format: str) -> transformers.PreTrainedModel:
    """A copy of `model` with its routed experts quantized to `format` and attached packed; `model`'s own experts
    are overwritten with the same values dequantized to its dtype, so both compute with identical weights."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for experts, twin_experts in zip(experts_modules(model).values(), experts_modules(twin).values()):
            dense = expert_weights(experts)  # output-major views of the parameters
            packed = [PackedWeight.quantize(weight.data, format, weight.bias) for weight in dense]
            for weight, quantized in zip(dense, packed):
                weight.data.copy_(quantized.dequantize(weight.data.dtype))
            attach_packed(twin_experts, *packed)
    return twin


def make_confident(model) -> None:
    """Give a random-weight model a decisive greedy path without changing any shape or cost: token embeddings
    scaled to dominate the residual stream, and lm_head set to a permutation of them, so the next token is a fixed
    permutation of the current one by a wide logit margin. Plain random weights leave near-ties between the
    top logits, and bf16 rounding differences between any two implementations (transformers' own DFlash vs its
    own generate included) then pick different tokens within a few steps, which makes acceptance meaningless."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    if head.weight is embed:  # tied (ERNIE-4.5): writing the head would undo the embeddings' scale
        head.weight = torch.nn.Parameter(torch.empty_like(embed), requires_grad=False)
        model.config.get_text_config().tie_word_embeddings = False
    embed.mul_(5000)
    permutation = torch.randperm(embed.shape[0], generator=torch.Generator().manual_seed(0)).to(embed.device)
    head.weight.copy_(embed[permutation] / 5000)


def width_summary(fast) -> str:
    """Which widths the last generation used and what their steps cost, next to the chooser's estimates."""
    stats, chooser = fast.last_stats, fast.decoder.chooser
    steps = {w: [s for v, s in zip(stats.widths, stats.step_seconds) if v == w] for w in set(stats.widths)}
    return ", ".join(f"width {w}: {len(steps.get(w, []))} steps, median "
                     f"{1e3 * statistics.median(steps[w]) if w in steps else float('nan'):.2f} ms (chooser: "
                     f"{1e3 * chooser.seconds(w) if chooser.times[w] else float('nan'):.2f} ms, "
                     f"{chooser.expected_tokens(w):.2f} tokens)" for w in chooser.widths)


def first_mismatch(expected: torch.Tensor, actual: torch.Tensor) -> str:
    if expected.shape == actual.shape and torch.equal(expected, actual):
        return "identical"
    width = min(expected.shape[1], actual.shape[1])
    differ = (expected[:, :width] != actual[:, :width]).nonzero()
    return f"differs at token {int(differ[0, 1]) if len(differ) else width}"


class UniformRouting:
    """Keeps each router's computation but replaces its choice by uniform random experts (random-weight routers
    collapse onto a few experts; real ones spread). Records distinct experts per call when asked. Each router is
    the registry's (`router_of`): its last output (or its only one: DBRX's logits) is the chosen indices, replaced
    by random picks, or, where the MoE block takes the top-k itself (Llama 4's, DBRX's), every expert's logits,
    replaced by random logits. Picks of zero-compute experts (LongCat-Flash's, numbered after the routed ones) read
    no expert: not counted."""

    def __init__(self, model):
        self.handles, self.distinct = [], []
        self.record, self.top_k = False, routed_top_k(model.config.get_text_config())
        self.zero_compute = zero_compute_experts(model.config.get_text_config())
        for name in experts_modules(model):
            self.handles.append(router_of(model, name).register_forward_hook(self._hook))

    def _hook(self, module, args, output):
        *kept, last = output if isinstance(output, tuple) else (output,)
        chooses = not last.is_floating_point()  # the router's own top-k indices, or every expert's logits
        logits = torch.rand(last.shape[0], kept[0].shape[-1] if chooses else last.shape[-1], device=last.device)
        picks = logits.topk(self.top_k).indices
        if self.record:
            routed = picks[picks < logits.shape[-1] - self.zero_compute]  # zero-compute experts come last
            self.distinct.append(routed.unique().numel())
        replaced = picks if chooses else logits
        return (*kept, replaced) if isinstance(output, tuple) else replaced

    def remove(self):
        for handle in self.handles:
            handle.remove()


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    _, seconds = timed(lambda: dst.copy_(src), 5, device)
    return 2 * src.numel() / seconds


def measured_cost(model, bandwidth: float, expert_bits: float) -> StepCost:
    """The cost model of a step of `model` at the measured bandwidth, with the routed experts stored at
    `expert_bits` per weight: its bytes over the bandwidth are the step's memory floor."""
    measured = Hardware("measured", hbm=bandwidth, pcie=55e9, flops=float("inf"), step_overhead=0.0)
    return StepCost(ModelSizes.of(model.config), measured, expert_bits=expert_bits)


def step_inputs(model, decoder, args, block: int):
    """(tokens, cache, active) for repeated verify steps of `block` tokens after a prefilled prompt; nothing is
    committed (active 0), so every call does the same work."""
    prompt = torch.randint(0, model.config.get_text_config().vocab_size, (1, args.prompt), device=args.device)
    cache = TargetCache(1, args.prompt + 64, model.dtype, args.device)
    with torch.no_grad():
        decoder._target_forward(prompt, cache, logits_to_keep=1)
    kept = torch.full((1,), args.prompt, device=args.device)
    cache.rows.commit(kept)
    cache.commit_linear(kept, args.prompt)  # linear-attention layers then verify from a state, as in `generate`
    tokens = torch.randint(0, model.config.get_text_config().vocab_size, (1, block), device=args.device)
    return tokens, cache, torch.zeros(1, dtype=torch.int64, device=args.device)


def step_times(model, decoder, args, bandwidth, expert_bits: float = 16.0):
    """Decode and verify step times with uniform routing, as `generate` runs them, next to their memory floors."""
    routing = UniformRouting(model)
    cost = measured_cost(model, bandwidth, expert_bits)
    rows = []
    for block in args.step_blocks:
        tokens, cache, active = step_inputs(model, decoder, args, block)
        routing.record, routing.distinct = True, []
        with torch.no_grad():
            decoder._target_forward(tokens, cache)  # eager pass to count the experts a block touches
        routing.record = False
        # nan where no hook ran: a router whose forward Dynamo traced already (its hook then inlined, not recording),
        # as Nemotron-H's on the H100 (session 56)
        distinct = statistics.mean(routing.distinct) if routing.distinct else float("nan")
        with generation_context(model):
            _, seconds = timed(lambda: decoder.verify_step(tokens, cache, active), args.repeats * 3, args.device)
        floor = float(cost.bytes.subs({B: block, C: args.prompt})) / bandwidth
        expected = float(cost.distinct_experts.subs(B, block))
        rows.append((block, seconds, floor, distinct, expected))
    routing.remove()
    return rows


def profile_decode(model, args) -> None:
    """Where a compiled decode step spends its time: 10 steady-state steps after warm-up calls (default mode, so
    kernels show one by one; no prefill, no compilation in the profiled region)."""
    from torch.profiler import ProfilerActivity, profile

    decoder = dflash_compile.optimize(model).decoder
    tokens, cache, active = step_inputs(model, decoder, args, 1)
    synchronize = torch.cuda.synchronize if args.device == "cuda" else lambda: None
    with generation_context(model):
        for _ in range(3):
            decoder.verify_step(tokens, cache, active)
        synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                decoder.verify_step(tokens, cache, active)
            synchronize()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0 and e.device_type.name == "CUDA"]
    print(f"per step: {sum(e.count for e in kernels) / 10:.0f} kernels, "
          f"{sum(e.self_device_time_total for e in kernels) / 10 / 1e3:.2f} ms of kernel time")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


def random_drafter(model, block: int, directory: str, transformers_format: bool = False) -> str:
    """A random DFlash drafter of two layers at the target's hidden size, saved in `directory`."""
    config = tiny_drafter_config(model.config, block_size=block, sliding_window=4096)
    hidden = model.config.get_text_config().hidden_size
    config.update(hidden_size=hidden, intermediate_size=2 * hidden,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    return save_drafter(directory, config, random_drafter_weights(config), transformers_format=transformers_format)


def native_dflash(model, args, ids):
    """transformers' own DFlash path with a random drafter in its format (batch 1)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = random_drafter(model, args.block, tmp, transformers_format=True)
        assistant = transformers.AutoModel.from_pretrained(path, dtype=model.dtype).to(args.device).eval()
    return lambda: model.generate(ids, do_sample=False, max_new_tokens=args.new, assistant_model=assistant,
                                  speculation_type="dflash")


def print_step_table(model, target, plain, grouped_steps, args, bandwidth) -> None:
    """Step times of our compiled step (and of grouped_mm experts when measured) next to their floors and the h200
    profile's predictions."""
    print(f"\ndevice-to-device copy: {bandwidth / 1e9:.0f} GB/s")
    print("\n| step (uniform routing) | experts | ms | memory floor ms | floor / measured | experts/layer | expected | "
          "predicted ms (h200 profile) | predicted / measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    bits = BITS_PER_WEIGHT[args.experts]
    runs = [(f"dflash fused kernel, {args.experts}", step_times(target, plain.decoder, args, bandwidth, bits), bits)]
    runs += [("transformers grouped_mm", grouped_steps, 16.0)] if grouped_steps else []
    for experts, steps, bits in runs:
        predict = StepCost(ModelSizes.of(model.config), HARDWARE["h200"], expert_bits=bits)  # fitted overheads
        for block, seconds, floor, distinct, expected_experts in steps:
            name = "decode (1 token)" if block == 1 else f"verify {block}"
            predicted = predict.evaluate(block, args.prompt)["t_step_us"] * 1e-6
            print(f"| {name} | {experts} | {seconds * 1e3:.2f} | {floor * 1e3:.2f} | {floor / seconds:.2f} | "
                  f"{distinct:.1f} | {expected_experts:.1f} | {predicted * 1e3:.2f} | {predicted / seconds:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gpt_oss", help=f"tiny-<family> or one of {sorted(REFERENCE_CONFIGS)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, help="keep only the first LAYERS layers of a reference shape")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--corruption", type=float, nargs="*", default=[0.45, 0.1],
                        help="oracle corruption probabilities (about tau 3 and 6 at block 8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-blocks", type=int, nargs="*", default=[1, 8, 16],
                        help="tokens per step of the step-time table (1 = decode)")
    parser.add_argument("--temperatures", type=float, nargs="*", default=[0.7, 1.0],
                        help="sampled runs (top-k 50, top-p 0.9) with the oracle proposing the greedy path")
    parser.add_argument("--skip-native", action="store_true")
    parser.add_argument("--mode", default=None, help="torch.compile mode of the verify step (default: optimize's, "
                                                     '"reduce-overhead" on CUDA; "default": no CUDA graphs)')
    parser.add_argument("--profile", action="store_true", help="print where a decode step spends its time")
    parser.add_argument("--static-cache", action="store_true",
                        help="add model.generate with a static cache (transformers compiles its decode on CUDA)")
    parser.add_argument("--grouped-mm", action="store_true",
                        help="add a row and step times with transformers' grouped_mm experts "
                             "(optimize(fused_experts=False); the default is dflash's fused kernel)")
    parser.add_argument("--experts", default="bf16", choices=["bf16", "mxfp4", "fp8_block"],
                        help="how our rows keep the routed experts (transformers' rows run them dequantized)")
    parser.add_argument("--steps-only", action="store_true", help="only the step-time table (no generation rows)")
    parser.add_argument("--repetition-penalty", type=float,
                        help="add model.generate with this repetition_penalty, and dflash with an oracle of its tokens "
                             "(the first --corruption, block --block): the penalty's cost and token identity")
    parser.add_argument("--no-repeat-ngram-size", type=int,
                        help="likewise with this no_repeat_ngram_size (with --repetition-penalty: both at once)")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)

    model = build_model(args.model, args.device, args.layers)
    target = model if args.experts == "bf16" else packed_twin(model, args.experts)  # what our rows run
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, args.prompt), device=args.device)
    print(f"# {args.model} on {args.device}, prompt {args.prompt}, {args.new} new tokens, batch 1, "
          f"{torch.__version__}, transformers {transformers.__version__}, verify step mode {args.mode}, experts "
          f"{args.experts}")
    if args.profile:
        profile_decode(target, args)
    if args.steps_only:
        print_step_table(model, target, dflash_compile.optimize(target, mode=args.mode), None, args,
                         copy_bandwidth(args.device))
        return
    rows = []
    with torch.no_grad():
        expected, base = timed(lambda: model.generate(ids, do_sample=False, max_new_tokens=args.new), args.repeats,
                               args.device)
    new = expected.shape[1] - args.prompt
    rows.append(("model.generate (eager)", new / base, 1.0, "-", "reference"))

    plain = dflash_compile.optimize(target, mode=args.mode)
    out, seconds = timed(lambda: plain.generate(ids, max_new_tokens=args.new), args.repeats, args.device)
    rows.append(("dflash, no drafter", new / seconds, 1.0, "-", first_mismatch(expected, out)))
    if args.static_cache:  # what transformers users reach for: a static cache, whose decode forward generate
        with torch.no_grad():  # compiles (reduce-overhead) on CUDA
            out, seconds = timed(lambda: model.generate(ids, do_sample=False, max_new_tokens=args.new,
                                                        cache_implementation="static"), args.repeats, args.device)
        rows.append(("model.generate, static cache (compiled by transformers on CUDA)", new / seconds, 1.0, "-",
                     first_mismatch(expected, out)))
    bandwidth = copy_bandwidth(args.device) if args.device == "cuda" else None
    grouped_steps = None
    if args.grouped_mm:  # resident experts through transformers' grouped_mm instead of dflash's fused kernel
        grouped = dflash_compile.optimize(model, mode=args.mode, fused_experts=False)
        out, seconds = timed(lambda: grouped.generate(ids, max_new_tokens=args.new), args.repeats, args.device)
        rows.append(("dflash, no drafter, grouped_mm experts", new / seconds, 1.0, "-", first_mismatch(expected, out)))
        if bandwidth:
            grouped_steps = step_times(model, grouped.decoder, args, bandwidth)
    for corruption in args.corruption:
        for adaptive in (False, True):  # fixed block, then the adaptive verify width
            drafter = OracleDrafter(expected.cpu(), None, args.block, corruption, vocab)
            fast = dflash_compile.optimize(target, drafter=drafter, mode=args.mode, adaptive=adaptive)
            out, seconds = timed(lambda: fast.generate(ids, max_new_tokens=args.new), args.repeats, args.device)
            name = f"dflash, oracle p={corruption} " + ("adaptive width" if adaptive else f"block {args.block}")
            rows.append((name, new / seconds, fast.last_stats.tau, f"{fast.last_stats.steps}",
                         first_mismatch(expected, out)))
            if adaptive:
                print(f"{name}: {width_summary(fast)}")
    for temperature in args.temperatures:  # sampled decoding, the oracle proposing the greedy path
        sampling = dict(do_sample=True, temperature=temperature, top_k=50, top_p=0.9, eos_token_id=-1)
        seed = torch.Generator(device=args.device).manual_seed(0)
        with torch.no_grad():
            sampled, base_t = timed(lambda: model.generate(ids, max_new_tokens=args.new, pad_token_id=0, **sampling),
                                    args.repeats, args.device)
        fast = dflash_compile.optimize(target, drafter=OracleDrafter(expected.cpu(), None, args.block), mode=args.mode,
                                       adaptive=False)
        _, seconds = timed(lambda: fast.generate(ids, max_new_tokens=args.new, generator=seed, **sampling),
                           args.repeats, args.device)
        rows.append((f"model.generate, sampled T={temperature}", new / base_t, 1.0, "-", "sampled"))
        rows.append((f"dflash, oracle (greedy path) block {args.block}, sampled T={temperature}", new / seconds,
                     fast.last_stats.tau, f"{fast.last_stats.steps}", "sampled"))
    settings = {name: value for name, value in (("repetition_penalty", args.repetition_penalty),
                                                ("no_repeat_ngram_size", args.no_repeat_ngram_size)) if value}
    if settings:
        label = ", ".join(f"{name}={value}" for name, value in settings.items())
        with torch.no_grad():
            reference, base_r = timed(lambda: model.generate(ids, do_sample=False, max_new_tokens=args.new, **settings),
                                      args.repeats, args.device)
        corruption = args.corruption[0] if args.corruption else 0.0
        drafter = OracleDrafter(reference.cpu(), None, args.block, corruption, vocab)
        fast = dflash_compile.optimize(target, drafter=drafter, mode=args.mode, adaptive=False)
        out, seconds = timed(lambda: fast.generate(ids, max_new_tokens=args.new, **settings), args.repeats,
                             args.device)
        rows.append((f"model.generate, {label}", new / base_r, 1.0, "-", "reference (with the settings)"))
        rows.append((f"dflash, oracle p={corruption} block {args.block}, {label}", new / seconds, fast.last_stats.tau,
                     f"{fast.last_stats.steps}", first_mismatch(reference, out)))
    if not args.skip_native:
        with torch.no_grad():
            out, seconds = timed(native_dflash(model, args, ids), args.repeats, args.device)
        rows.append((f"transformers native DFlash, random drafter, block {args.block}", out.shape[1] and
                     (out.shape[1] - args.prompt) / seconds, float("nan"), "-", first_mismatch(expected, out)))

    print("\n| run | tokens/s | vs model.generate | tau | verify steps | tokens |")
    print("|---|---|---|---|---|---|")
    for name, rate, tau, steps, same in rows:
        print(f"| {name} | {rate:.1f} | {rate * base / new:.2f}x | {tau:.2f} | {steps} | {same} |")

    if bandwidth:
        print_step_table(model, target, plain, grouped_steps, args, bandwidth)

if __name__ == "__main__":
    main()
