"""Routed-expert MoE kernels on real layer shapes (H200): the fused packed kernel against (a) dequantize-to-bf16 then
torch matmuls and (b) bf16 weights with transformers' grouped_mm experts, for M tokens with random routing; (c) is
the fused kernel on those same bf16 weights (resident bf16 experts). The bf16 shapes (format "dense": the experts of
bf16 checkpoints) run the fused kernel on bf16 weights as their "fused" column.

    python bench/moe_kernels.py                     # all shapes, M in 1 4 8 16 64; prints a table, writes --json
    python bench/moe_kernels.py --shapes gpt-oss-20b --tokens 1 16
    python bench/moe_kernels.py --no-tune --baseline old_moe.py   # TILES as they are; vs another kernel version
    DFLASH_CUDA_ROWS=1 python bench/moe_kernels.py --no-tune --tokens 1 --against-triton   # CUDA row kernels vs Triton
    python bench/moe_kernels.py --shapes gpt-oss-20b --tokens 1 --one-token-only   # sweep one token's tiles only
    python bench/moe_kernels.py --no-tune --down-sweep --shapes gpt-oss-20b --tokens 1 16   # down launch apart
    python bench/moe_kernels.py --no-tune --shapes gpt-oss-20b --tokens 4 8 --tiles block_m=2   # M > 1 overrides
    python bench/moe_kernels.py --no-tune --shapes gpt-oss-120b --tokens 4 16 --routing-skew 1   # a skewed router
    python bench/moe_kernels.py --no-tune --tokens 256 --sweep block_m=16,64 num_warps=4,8   # best tiles per shape, M
    python bench/moe_kernels.py --no-tune --tokens 2048 4096 --dequantize-pairs 1 --baseline old_moe.py   # prefill
    python bench/moe_kernels.py --no-tune --shapes qwen3-30b-a3b olmoe-1b-7b mixtral-8x7b --tokens 1 8   # bf16 experts

Weights rotate over several layers so that L2 does not serve them. "bytes" are the routed experts' packed bytes
(weights, scales, biases) that one call must read; GB/s is bytes / time, next to the device-to-device copy bandwidth
measured in the same run ((read + write) / time of a 2 GiB copy) and to one kernel that only reads as many bytes
(`_read_tile`, rotated the same way): about the most a single launch streams at that size. Fused and grouped_mm
times are CUDA-graph replays of all rotated layers divided by the layer count (how a compiled decode step runs them),
except calls that dequantize their experts for a grouped GEMM (from DEQUANTIZE_PAIRS pairs per routed expert,
`--dequantize-pairs`): like a prefill, which runs eagerly, they and their baseline are timed plainly (that path
syncs on the host); (a) syncs on the host, so it is timed plainly. Numerics: fused (bf16 activations) against
reference dequantization + fp64 math. `--baseline` times a second copy of dflash_compile/kernels/moe.py (e.g. `git show
REV:dflash_compile/kernels/moe.py > old.py`) on the same inputs and tiles, so a kernel change is measured against
what it replaces in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_compile.expert_store import Gate, expert_sum  # noqa: E402
from dflash_compile.families import spec_for_experts_class  # noqa: E402
from dflash_compile.kernels import cuda_rows, moe  # noqa: E402
from dflash_compile.kernels.moe import ROW_TILES, TILES, fused_moe, pairs_per_routed_expert, rows_per_block  # noqa: E402
from dflash_compile.packed import PackedWeight, expert_weights  # noqa: E402
from kernel_sass import parse_tiles, tile_grid  # noqa: E402  (bench/, the script's own folder)

SHAPES = {  # experts, top-k, hidden, intermediate, format, gpt-oss layout
    "gpt-oss-20b": (32, 4, 2880, 2880, "mxfp4", True),
    "gpt-oss-120b": (128, 4, 2880, 2880, "mxfp4", True),
    "qwen3-30b-a3b-fp8": (128, 8, 2048, 768, "fp8_block", False),
    "qwen3-30b-a3b-mxfp4": (128, 8, 2048, 768, "mxfp4", False),  # quantize()'s output: gate/up concatenated
    # bf16 checkpoints' experts as transformers keeps them ([E, out, in]), through the same kernel
    "qwen3-30b-a3b": (128, 8, 2048, 768, "dense", False),
    "olmoe-1b-7b": (64, 8, 2048, 1024, "dense", False),
    "mixtral-8x7b": (8, 2, 4096, 14336, "dense", False),
}


def random_packed(format: str, experts: int, rows: int, columns: int, bias: bool, device="cuda") -> PackedWeight:
    """Random packed bytes made where they are used (quantizing 100s of MB would only cost time)."""
    b = torch.randn(experts, rows, device=device, dtype=torch.bfloat16) * 0.1 if bias else None
    if format == "dense":  # bf16 weights through the same kernel
        return PackedWeight("dense", torch.randn(experts, rows, columns, device=device, dtype=torch.bfloat16) * 0.02,
                            None, b)
    if format == "mxfp4":
        data = torch.randint(0, 256, (experts, rows, columns // 32, 16), dtype=torch.uint8, device=device)
        scales = torch.randint(118, 124, (experts, rows, columns // 32), dtype=torch.uint8, device=device)
        return PackedWeight("mxfp4", data, scales, b)
    values = (torch.randn(experts, rows, columns, device=device) * 100).clamp(-448, 448)  # no NaN codes
    data = values.to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.rand(experts, -(-rows // 128), -(-columns // 128), device=device) * 1e-3 + 1e-4
    return PackedWeight("fp8_block", data, scales, b)


def random_routing(tokens: int, experts: int, top_k: int, skew: float = 0.0, generator=None) -> torch.Tensor:
    """[tokens, top_k] distinct experts per token, drawn without replacement with weight (r + 1)^-skew for the
    expert of index r (Gumbel top-k): uniform at skew 0 (the same draws as `rand(...).argsort()[:, :top_k]`), a
    router that favours a few experts above it (skew 1: expert 0 about 3x as likely as expert 2 ...)."""
    uniform = torch.rand(tokens, experts, device="cuda", generator=generator)
    log_weights = -skew * torch.arange(1, experts + 1, device="cuda", dtype=torch.float32).log()
    return (log_weights - torch.log(-torch.log1p(-uniform))).topk(top_k, dim=1).indices


def expert_bytes(weight: PackedWeight) -> int:
    return weight.nbytes() // weight.shape[0]


def reference(x, index, weights, gate_up, down, interleaved, activation):
    """fp64 math on the dequantized routed experts (the kernels' definition)."""
    used = index.unique()
    w1, w2 = gate_up.select(used).dequantize(torch.float64), down.select(used).dequantize(torch.float64)
    b1 = None if gate_up.bias is None else gate_up.bias[used].double()
    b2 = None if down.bias is None else down.bias[used].double()
    position = {int(e): i for i, e in enumerate(used.tolist())}
    gate = Gate(interleaved, activation)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for slot in range(index.shape[1]):
            e = position[int(index[t, slot])]
            act = gate(x[t].double() @ w1[e].T + (b1[e] if b1 is not None else 0))
            out[t] += weights[t, slot].double() * (act @ w2[e].T + (b2[e] if b2 is not None else 0))
    return out


def dequantize_then_matmul(x, index, weights, gate_up, down, interleaved, activation):
    """Baseline (a): each routed expert dequantized to bf16 (reference dequantizer), then torch matmuls."""
    gate = Gate(interleaved, activation)

    def expert_mlp(expert, tokens):
        w1, w2 = gate_up.select([expert]), down.select([expert])
        h = tokens @ w1.dequantize(torch.bfloat16)[0].T + (w1.bias[0] if w1.bias is not None else 0)
        return gate(h) @ w2.dequantize(torch.bfloat16)[0].T + (w2.bias[0] if w2.bias is not None else 0)

    return expert_sum(x, index, weights, gate_up.shape[0], expert_mlp)


def bf16_experts(name: str, experts: int, hidden: int, inter: int):
    """transformers' own experts module with bf16 weights, run two ways: (b) its grouped_mm implementation, and (c)
    the fused kernel reading the module's parameters in place (`expert_weights`: gpt-oss's [E, in, out] through a
    transposed view). Returns both callables (x, index, weights) -> out."""
    import transformers
    from transformers.integrations.moe import grouped_mm_experts_forward

    if name.startswith("gpt-oss"):
        config = transformers.GptOssConfig(num_local_experts=experts, hidden_size=hidden, intermediate_size=inter)
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as Experts
    else:
        config = transformers.Qwen3MoeConfig(num_experts=experts, hidden_size=hidden, moe_intermediate_size=inter)
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        module = Experts(config)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0, 0.02)
    gate = Gate.of(spec_for_experts_class(Experts).layout, module)
    gate_up, down = expert_weights(module)
    grouped = lambda x, index, weights: grouped_mm_experts_forward(module, x, index, weights)  # noqa: E731
    fused = lambda x, index, weights: fused_moe(x, index, weights, gate_up, down, interleaved=gate.interleaved,  # noqa: E731
                                                activation=gate.activation, alpha=gate.alpha, limit=gate.limit)
    return grouped, fused


def graph_time_us(calls) -> float:
    """Median CUDA-graph replay time of all `calls` in sequence, divided by their count."""
    return triton.testing.do_bench_cudagraph(lambda: [call() for call in calls]) * 1e3 / len(calls)


def plain_time_us(calls) -> float:
    """Median time of all `calls` in sequence launched from the host, divided by their count."""
    return triton.testing.do_bench(lambda: [call() for call in calls]) * 1e3 / len(calls)


def copy_bandwidth() -> float:
    source = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * source.numel() / (triton.testing.do_bench(lambda: target.copy_(source)) * 1e-3)


def without_cuda_rows(*args, **kwargs):
    """`fused_moe` with the CUDA row kernels turned away (`--against-triton`): the Triton kernels on the same call."""
    covers = cuda_rows.covers
    cuda_rows.covers = lambda *_: False
    try:
        return fused_moe(*args, **kwargs)
    finally:
        cuda_rows.covers = covers


def load_baseline(path: Path):
    """Another version of the kernels module, imported inside dflash_compile.kernels (its relative imports resolve
    there)."""
    spec = importlib.util.spec_from_file_location("dflash_compile.kernels.baseline_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@triton.jit
def _read_tile(data, out, ROW_BYTES: tl.constexpr, TILE_ROWS: tl.constexpr, STEP: tl.constexpr,
               TILE_MAJOR: tl.constexpr, NUM_STAGES: tl.constexpr):
    """XOR of the 8-byte words of tile (program_id(0), program_id(1)) of consecutive tiles of TILE_ROWS rows of
    ROW_BYTES: STEP bytes of every row per step, read where the rows lie (row-major, as the MoE kernels read a weight
    tile) or with the tile's bytes stored step after step (TILE_MAJOR). Bytes and no math: a streaming floor."""
    words = data.to(tl.pointer_type(tl.int64))
    tile_start = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * TILE_ROWS * ROW_BYTES // 8
    rows = tl.arange(0, TILE_ROWS)[:, None]
    columns = tl.arange(0, STEP // 8)[None, :]
    acc = tl.zeros((TILE_ROWS, STEP // 8), dtype=tl.int64)
    for k in tl.range(0, ROW_BYTES // 8, STEP // 8, num_stages=NUM_STAGES):
        ok = k + columns < ROW_BYTES // 8
        if TILE_MAJOR:  # step s of the tile: its rows' STEP bytes one after another
            offset = k * TILE_ROWS + rows * tl.minimum(STEP // 8, ROW_BYTES // 8 - k) + columns
        else:
            offset = rows * (ROW_BYTES // 8) + k + columns
        acc ^= tl.load(words + tile_start + offset, mask=ok, other=0)
    tl.store(out + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(tl.xor_sum(acc, 1), 0))


def read_time_us(nbytes: int, layers: int) -> float:
    """One graph-launched kernel reading `nbytes` from each of `layers` buffers in turn (`_read_tile` over tiles of
    32 rows of 1 KiB, 2 warps, 3 stages: among the fastest of bench/read_order.py's sweep): what a single launch can
    stream at this size, with its own start and tail (the copy bandwidth is measured on 2 GiB). torch.sum, used
    before session 16, streams ~1.5x slower at these sizes."""
    tile_bytes = 32 * 1024
    tiles = -(-nbytes // tile_bytes)
    buffers = [torch.zeros(tiles * tile_bytes // 8, dtype=torch.int64, device="cuda") for _ in range(layers)]
    out = torch.empty(tiles, dtype=torch.int64, device="cuda")
    return graph_time_us([lambda b=b: _read_tile[(tiles, 1)](b, out, ROW_BYTES=1024, TILE_ROWS=32, STEP=128,
                                                             TILE_MAJOR=False, NUM_STAGES=3, num_warps=2)
                          for b in buffers])


def kernel_times_us(call, repeats: int = 20) -> str:
    """Each GPU kernel's mean time in `call` (CUPTI, so launch gaps excluded): where a fused call spends its time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(repeats):
            call()
        torch.cuda.synchronize()
    times = {}
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.device_time / repeats
    return ", ".join(f"{name.split('(')[0][:40]} {us:.1f}" for name, us in times.items())


def run_shape(name, tokens_list, layers, tiles, copy_gbs, rows, baseline=None, profile=False, skew=0.0):
    """Times and checks one shape at each M; `tiles`: {"tensor_core": ..., "few_rows": ..., "one_token": ...}
    overrides, each for the calls that take that path (`path_tiles`)."""
    experts, top_k, hidden, inter, format, gpt_oss = SHAPES[name]
    activation = "clamped_swiglu" if gpt_oss else "silu"
    packed = [(random_packed(format, experts, 2 * inter, hidden, gpt_oss),
               random_packed(format, experts, hidden, inter, gpt_oss)) for _ in range(layers)]
    per_expert = expert_bytes(packed[0][0]) + expert_bytes(packed[0][1])
    baseline_b, fused_bf16 = zip(*[bf16_experts(name, experts, hidden, inter) for _ in range(min(layers, 2))])
    for tokens in tokens_list:
        tuning = path_tiles(tiles, tokens, top_k, experts, format)
        generator = torch.Generator(device="cuda").manual_seed(tokens)
        index = random_routing(tokens, experts, top_k, skew, generator)
        weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=generator), dim=-1)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
        fused = lambda g, d: fused_moe(x, index, weights, g, d, interleaved=gpt_oss, activation=activation,  # noqa: E731
                                       **tuning)
        check_tokens = slice(0, min(tokens, 4))
        expected = reference(x[check_tokens], index[check_tokens], weights[check_tokens], *packed[0], gpt_oss,
                             activation)
        actual = fused(*packed[0])[check_tokens].double()
        error = ((actual - expected).norm() / expected.norm()).item()
        touched = index.unique().numel()
        moved = touched * per_expert
        dequantized = not tuning and pairs_per_routed_expert(tokens, top_k, experts) >= moe.DEQUANTIZE_PAIRS[format]
        timer = plain_time_us if dequantized else graph_time_us
        fused_us = timer([lambda g=g, d=d: fused(g, d) for g, d in packed])
        read_us = read_time_us(moved, layers)
        if baseline is not None:
            run_baseline = lambda g, d: baseline(x, index, weights, g, d, interleaved=gpt_oss,  # noqa: E731
                                                 activation=activation, **tuning)
            baseline_us = timer([lambda g=g, d=d: run_baseline(g, d) for g, d in packed])
            print(f"{name:18s} M={tokens:3d} {'dequantized, plain' if dequantized else 'fused, graphs'} "
                  f"{fused_us:8.1f} us, baseline {baseline_us:8.1f} us: {baseline_us / fused_us:.2f}x", flush=True)
        eager_us = triton.testing.do_bench(lambda: fused(*packed[tokens % layers])) * 1e3
        dequant_us = triton.testing.do_bench(
            lambda: dequantize_then_matmul(x, index, weights, *packed[0], gpt_oss, activation)) * 1e3
        try:
            grouped_us = graph_time_us([lambda b=b: b(x, index, weights) for b in baseline_b])
        except Exception as error:  # not capturable in this transformers version: time it plainly
            print(f"grouped_mm not capturable ({type(error).__name__}); timed without a graph", flush=True)
            grouped_us = triton.testing.do_bench(lambda: baseline_b[0](x, index, weights)) * 1e3
        fused_bf16_us = graph_time_us([lambda f=f: f(x, index, weights) for f in fused_bf16])
        bf16_error = ((fused_bf16[0](x, index, weights).double() - baseline_b[0](x, index, weights).double()).norm()
                      / baseline_b[0](x, index, weights).double().norm()).item()
        if profile:  # after this M's timings: the profiler slows what runs after it (session 15, H200: the same
            # kernel timed as a baseline after a profile read 5% slower), so A/B numbers come from runs without it
            print(f"{name:18s} M={tokens:3d} kernels (us): {kernel_times_us(lambda: fused(*packed[0]))}", flush=True)
        row = {"shape": name, "format": format, "tokens": tokens, "routing_skew": skew, "experts_touched": touched,
               "mbytes": moved / 1e6,
               "fused_us": fused_us, "fused_no_graph_us": eager_us, "fused_gbs": moved / fused_us / 1e3,
               "fraction_of_copy": moved / fused_us / 1e3 / copy_gbs, "one_read_us": read_us,
               "one_read_fraction_of_copy": moved / read_us / 1e3 / copy_gbs, "dequant_matmul_us": dequant_us,
               "speedup_vs_dequant": dequant_us / fused_us, "grouped_mm_bf16_us": grouped_us,
               "speedup_vs_grouped_mm": grouped_us / fused_us, "rel_error": error,
               "fused_bf16_us": fused_bf16_us, "fused_bf16_vs_grouped_mm": grouped_us / fused_bf16_us,
               "fused_bf16_rel_error": bf16_error}
        rows.append(row)
        print(f"{name:18s} M={tokens:3d} experts={touched:3d} ({index.numel() / touched:.2f} pairs each) "
              f"{moved / 1e6:8.1f} MB  fused {fused_us:8.1f} us "
              f"({row['fused_gbs']:6.0f} GB/s, {row['fraction_of_copy']:.0%} of copy; no graph {eager_us:7.1f})  "
              f"(a) {dequant_us:8.1f} us ({row['speedup_vs_dequant']:.1f}x)  (b) {grouped_us:8.1f} us "
              f"({row['speedup_vs_grouped_mm']:.2f}x)  err {error:.1e}  (c) fused on bf16 {fused_bf16_us:8.1f} us "
              f"({row['fused_bf16_vs_grouped_mm']:.2f}x of (b), diff {bf16_error:.1e})  one read of the bytes "
              f"{read_us:6.1f} us ({row['one_read_fraction_of_copy']:.0%} of copy)", flush=True)


SPLIT_K = (1, 2, 3, 4, 6)  # shares of K for one token's launches, swept on the best tiles


def path_of(tokens: int, top_k: int, experts: int, format: str) -> str:
    """The path `fused_moe` takes on a call of this size: one token's, the CUDA-core blocks of few rows
    (`rows_per_block`, for formats with a row path: ROW_TILES), or the tensor cores' (blocks of 16 or WIDE_TILES')."""
    if tokens == 1:
        return "one_token"
    loads = "tma" if "tma" in ROW_TILES[format] else "pointers"  # H200: TMA loads where the format has them
    rows = rows_per_block(tokens, top_k, experts, weight_loads=loads, format=format)
    return "few_rows" if rows is not None and rows < 16 else "tensor_core"


def path_tiles(tiles: dict, tokens: int, top_k: int, experts: int, format: str) -> dict:
    """The tiles swept for the path a call of this size takes (`path_of`)."""
    return tiles[path_of(tokens, top_k, experts, format)]


def tile_candidates(format: str):
    """The tensor-core sweep (M > 1): output tiles, K steps (FP8 up to its 128-column scale block) and K steps in
    flight. (CUDA-core tiles of 1-4 pairs with an fp32 MXFP4 decode lost by 2-10x on 2026-11-30; the CUDA-core path
    with the fp16 PTX decode is swept by `row_candidates`.)"""
    block_ks = (64, 128) if format == "fp8_block" else (128, 256)
    for block_n in (16, 32, 64):
        for block_k in block_ks:
            for num_stages in (2, 4):
                yield {"block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": num_stages}
    yield {"block_n": 64, "block_k": 128, "num_warps": 8, "num_stages": 3}
    if format == "fp8_block":  # fp16 tensor-core operands (fewer conversions per K step) on the same tiles
        for block_n in (16, 32, 64):
            yield {"block_n": block_n, "block_k": 128, "num_warps": 4, "num_stages": 4, "operands": "fp16"}


def row_candidates(format: str):
    """Tiles of the CUDA-core path (ROW_TILES) for blocks of one or a few rows, either weight loads the format has;
    FP8 TMA steps also 128 wide (its best blocks of 2, session 21)."""
    for block_n in (8, 16, 32, 64):  # pointer loads, one K step in flight: stages lost 7-26% in session 14's sweep
        for num_warps in (1, 2, 4):
            for block_k in (128, 256):
                yield {"block_n": block_n, "block_k": block_k, "num_warps": num_warps, "num_stages": 1,
                       "weight_loads": "pointers"}
    if "tma" not in ROW_TILES[format]:
        return
    for block_n in (16, 32, 64, 128):  # TMA: 128-wide MXFP4 steps lost 10-30% in session 17's sweep
        for num_warps in (2, 4, 8):
            for block_k in (128, 256) if format == "fp8_block" else (256,):
                yield {"block_n": block_n, "block_k": block_k, "num_warps": num_warps, "num_stages": 3,
                       "weight_loads": "tma"}


def down_candidates(format: str, one_token: bool):
    """The down launch apart from its gate/up launch (tile `down_launch`): columns, warps and, for one token, shares
    of K (added by the pair sum, no launch of their own); FP8 also in 128-wide steps."""
    for block_n in (16, 32, 64):
        for num_warps in (2, 4, 8):
            for split_k in (1, 2) if one_token else (1,):
                yield {"block_n": block_n, "num_warps": num_warps, "split_k": split_k}
            if format == "fp8_block":
                yield {"block_n": block_n, "num_warps": num_warps, "block_k": 128}


def tune(name: str, tokens_list, layers: int, candidates) -> dict:
    """Pick tile sizes and warps for a shape's format among `candidates` (one config per call: no autotuner, which
    fails in the interpreter): the best sum of CUDA-graph times over `tokens_list` (`candidate_times`)."""
    settings, _ = min(candidate_times(name, tokens_list, layers, candidates), key=lambda timed: timed[1])
    return settings


def candidate_times(name: str, tokens_list, layers: int, candidates) -> list[tuple[dict, float]]:
    """Each distinct candidate's sum of CUDA-graph times over `tokens_list`, in the order given (a repeated one is
    timed once, not summed twice); inf where its bf16 result is not within 1e-2 of the reference (a wrong variant
    must not win a sweep) or it fails to run."""
    experts, top_k, hidden, inter, format, gpt_oss = SHAPES[name]
    activation = "clamped_swiglu" if gpt_oss else "silu"
    packed = [(random_packed(format, experts, 2 * inter, hidden, gpt_oss),
               random_packed(format, experts, hidden, inter, gpt_oss)) for _ in range(layers)]
    configs = {repr(settings): settings for settings in candidates}  # settings may hold a dict (down_launch)
    totals = dict.fromkeys(configs, 0.0)
    for tokens in tokens_list:
        index = random_routing(tokens, experts, top_k)
        weights = torch.softmax(torch.randn(tokens, top_k, device="cuda"), dim=-1)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        expected = reference(x[:2], index[:2], weights[:2], *packed[0], gpt_oss, activation)
        for key, settings in configs.items():
            run = lambda g, d: fused_moe(x, index, weights, g, d, interleaved=gpt_oss,  # noqa: E731
                                         activation=activation, **settings)
            try:
                error = ((run(*packed[0])[:2].double() - expected).norm() / expected.norm()).item()
                us = graph_time_us([lambda g=g, d=d: run(g, d) for g, d in packed]) if error <= 1e-2 else float("inf")
            except Exception as failure:  # e.g. out of shared memory: not a candidate
                print(f"tune {name} {settings}: {type(failure).__name__}", flush=True)
                error, us = float("nan"), float("inf")
            totals[key] += us
            print(f"tune {name} M={tokens} {settings}: {us:.1f} us, rel. error {error:.1e}", flush=True)
    return [(configs[key], totals[key]) for key in configs]


def sweep(shapes, tokens_list, layers: int, tiles: dict, values: list[str]) -> None:
    """The fastest tiles per shape and M among every combination of the swept values (on the tiles of the path the
    call takes), next to that path's tiles as they are."""
    rows = []
    for name in shapes:
        experts, top_k, _, _, format, _ = SHAPES[name]
        for tokens in tokens_list:
            default = path_tiles(tiles[format], tokens, top_k, experts, format)
            candidates = [default] + [default | point for point in tile_grid(values)]
            timed = candidate_times(name, [tokens], layers, candidates)
            best, best_us = min(timed, key=lambda candidate: candidate[1])
            rows.append(f"| {name} | {tokens} | {timed[0][1]:.1f} | {best_us:.1f} | {best} | "
                        f"{timed[0][1] / best_us:.2f}x |")
    print("| shape | M | default us | best us | best tiles | speed-up |\n|---|---|---|---|---|---|", *rows, sep="\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 8, 16, 64])
    parser.add_argument("--layers", type=int, default=4, help="layers rotated so L2 cannot serve the weights")
    parser.add_argument("--routing-skew", type=float, default=0.0,
                        help="0: uniform routing; above: experts drawn with weight (index + 1)^-skew (random_routing)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--no-tune", action="store_true", help="the kernels' TILES as they are, no sweep")
    parser.add_argument("--baseline", type=Path, help="another moe.py to time on the same inputs and tiles")
    parser.add_argument("--against-triton", action="store_true",
                        help="the Triton kernels as the baseline of the CUDA row kernels (run with DFLASH_CUDA_ROWS=1)")
    parser.add_argument("--profile", action="store_true",
                        help="print each kernel's time in one fused call (later timings read slower: A/B without it)")
    parser.add_argument("--one-token-only", action="store_true", help="sweep one token's tiles only")
    parser.add_argument("--down-sweep", action="store_true",
                        help="sweep the down launch apart (tile down_launch) at each --tokens, also with --no-tune")
    parser.add_argument("--tiles", nargs="*", default=[],
                        help="overrides of the tiles for M > 1 with --no-tune, e.g. block_m=2 (the CUDA-core path)")
    parser.add_argument("--sweep", nargs="*", default=[],
                        help="tile values to sweep at each --tokens on each --shapes, e.g. block_m=16,64 num_warps=4,8")
    parser.add_argument("--dequantize-pairs", type=float, help="DEQUANTIZE_PAIRS for this version, every format")
    args = parser.parse_args()
    if args.dequantize_pairs is not None:
        moe.DEQUANTIZE_PAIRS = dict.fromkeys(moe.DEQUANTIZE_PAIRS, args.dequantize_pairs)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    copy_gbs = copy_bandwidth() / 1e9
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s")
    overrides = parse_tiles(args.tiles)
    tiles = {format: {"tensor_core": dict(overrides), "few_rows": dict(overrides), "one_token": {}} for format in TILES}
    for format, name in () if args.no_tune else (("mxfp4", "gpt-oss-20b"), ("fp8_block", "qwen3-30b-a3b-fp8")):
        if format not in {SHAPES[shape][4] for shape in args.shapes}:
            continue
        if not args.one_token_only:
            tiles[format]["tensor_core"] = tune(name, [16], 2, list(tile_candidates(format)))
            # blocks of 2 rows at M = 4 (1.19 / 1.14 pairs per routed expert: 20b / Qwen3)
            tiles[format]["few_rows"] = tune(name, [4], 2, list(row_candidates(format)))
        best = tune(name, [1], 2, list(row_candidates(format)))
        tiles[format]["one_token"] = tune(name, [1], 2, [best | {"split_k": split_k} for split_k in SPLIT_K])
    for name in args.shapes if args.down_sweep else ():  # each M's path, on that path's tiles
        experts, top_k, _, _, format, _ = SHAPES[name]
        for tokens in args.tokens:
            path = path_of(tokens, top_k, experts, format)
            tiles[format][path] = tune(name, [tokens], 2, [tiles[format][path] | {"down_launch": down}
                                                           for down in down_candidates(format, tokens == 1)])
    print("tiles:", tiles)
    if args.sweep:
        return sweep(args.shapes, args.tokens, 2, tiles, args.sweep)
    rows = []
    baseline = load_baseline(args.baseline).fused_moe if args.baseline else None
    if args.against_triton:
        print(cuda_rows.status())  # they must be loaded: else both sides run Triton
        baseline = without_cuda_rows
    for name in args.shapes:
        layers = args.layers if name != "gpt-oss-120b" else 2
        run_shape(name, args.tokens, layers, tiles[SHAPES[name][4]], copy_gbs, rows, baseline, args.profile,
                  args.routing_skew)
        torch.cuda.empty_cache()  # the shape's weights are gone with run_shape's frame
        if args.json:  # after every shape: a run cut short keeps what it measured
            args.json.write_text(json.dumps({"copy_gbs": copy_gbs, "tiles": tiles, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
