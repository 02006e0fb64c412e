"""Instructions in the fused MoE kernel's K loop, compiled offline for the H200 (sm_90) on any machine, no GPU:

    python bench/kernel_sass.py                         # every format, gate_up and down, the formats' TILES
    python bench/kernel_sass.py --format mxfp4 --tiles block_n=64 num_warps=8
    python bench/kernel_sass.py --format fp8_block --tiles operands=fp16
    python bench/kernel_sass.py --one-token --digest     # + an md5 of each kernel's SASS: a refactor must keep it
    python bench/kernel_sass.py --one-token --capability 80   # an A100: FP8's e4m3 conversions do not compile

The kernels are bound by instruction issue rather than by memory at decode sizes: on the H200 (session 4 sweep) the
FP8 kernel read 2.9x more bytes per second than the MXFP4 one at M = 16, and its K loop issues 2.9x more weight
bytes per warp instruction here; the MXFP4 decode by fp32 bit construction that measured 2-2.5x slower has 2.4x the
loop instructions. So "weight bytes per warp instruction" of the loop is a proxy for a kernel change that can be
read before any GPU time is spent. Compiles with the specialisations the JIT makes on real shapes (16-byte aligned
pointers, sizes divisible by 16), disassembles with the cuobjdump bundled with Triton, takes the longest backward
branch as the K loop and prints its instruction count, its commonest opcodes and bytes per warp instruction, and
the registers per thread with the CTAs per SM they and the shared memory allow (the one-token CUDA-core path runs
at ~2.6 warps per scheduler with its issue slots half busy, session 16's Nsight Compute profile, so residency
matters there; blocks of 2 lost 13% with one CTA an SM less, session 67).
The proxy has limits: 3.8-6.3% fewer loop instructions in the blocks of 2 at gpt-oss-20b's M = 16 measured 0.96-1.01x
on an H100 (session 66), so a shorter loop is a candidate for a GPU A/B, not a result. The CTA barriers an iteration
(BAR: Triton's layout conversions through shared memory, each a store, a barrier, loads and another barrier) are
counted beside it: the warps of a CTA wait for each other there, which a count of instructions does not show.
Compile with the device's Triton, not only this machine's: a change that left Triton 3.9's loop as it was added 5%
to 3.6's and cost the H200 0.86-0.94x (session 21). `pip install --no-deps --target /tmp/t36 triton==3.6.0`, then
`PYTHONPATH=/tmp/t36 python bench/kernel_sass.py ...`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import io
import itertools
import re
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_compile.kernels.moe import (  # noqa: E402
    ACTIVATIONS, FORMATS, GROUPED, PAIR_PER_BLOCK, ROW_TILES, _moe_gemm_kernel, _paired_activations, _scan_width,
    tiles_for, tma_tile)

H200 = 90  # the H200's compute capability: sm_90, the default target
POINTERS = {"x": "*bf16", "bias": "*fp32", "out": "*bf16", "pair_ids": "*i32", "block_expert": "*i32",
            "pair_weights": "*fp32", "host_bias": "*fp32", "slot_of": "*i32", "x_shifts": "*i32",
            "out_shifts": "*i32", "summed": "*bf16", "arrivals": "*i32"}
WEIGHT_POINTERS = {"dense": ("*bf16", "*fp32"), "mxfp4": ("*u8", "*u8"), "fp8_block": ("*u8", "*fp32")}
# arguments the JIT sees as multiples of 16 on the benchmark shapes (pointers from the allocator, H, I, strides)
ALIGNED = ("x", "data", "scales", "bias", "out", "pair_ids", "block_expert", "pair_weights", "host_data",
           "host_scales", "host_bias", "slot_of", "N", "K", "N_OUT", "data_stride", "scales_stride", "bias_stride",
           "row_stride", "k_split")


def compile_kernel(format: str, gated: bool, tiles: dict, host_fallback: bool = False, one_token: bool = False,
                   interleaved: bool = True, capability: int = H200):
    """`_moe_gemm_kernel` for `format` compiled for sm_`capability`, gpt-oss-style (clamped SwiGLU, biases; gate/up
    rows `interleaved` or concatenated); `host_fallback`: with offload's slot table and host blobs; `one_token`: a
    decode launch (every pair its own block, K split by the tile `split_k`)."""
    data, scales = WEIGHT_POINTERS[format]
    names = _moe_gemm_kernel.arg_names
    fp16 = tiles.get("operands") == "fp16"
    tma_loads, tile_rows = tma_tile(gated, interleaved, tiles["block_n"])
    if tiles["weight_loads"] == "pointers":
        tma_loads = 0
    signature = {name: "i32" for name in names} | POINTERS | {"data": data, "scales": scales, "alpha": "fp32",
                                                              "limit": "fp32", "data_stride": "i64",
                                                              "scales_stride": "i64", "bias_stride": "i64",
                                                              "host_data": data, "host_scales": scales}
    if fp16:  # the activations come in (and the gate/up output goes out) as prescaled fp16
        signature |= {"x": "*fp16", "out": "*fp16"}
        if gated and (one_token or tiles["block_m"] < 16):  # `_activations`: those rows come as they are
            signature |= {"x": "*bf16"}
    split_k = tiles["split_k"] if one_token else 1
    paired_input, paired_shift = False, 0  # as `fused_moe` runs the MXFP4 row path: activations as fp16 pairs
    if format == "mxfp4" and tiles["block_m"] < 16:
        paired_input, paired_shift = _paired_activations(1 if one_token else 2, split_k, "clamped_swiglu", 1.702, 7.0)
    x_paired = paired_input if gated else paired_shift > 0
    if x_paired:
        signature |= {"x": "*fp16"}
    if gated and paired_shift:
        signature |= {"out": "*fp16"}
    constants = dict(FORMAT=FORMATS[format], GATED=gated, INTERLEAVED=interleaved,
                     ACTIVATION=ACTIVATIONS["clamped_swiglu"], HAS_BIAS=True, APPLY_WEIGHT=not gated,
                     COMPUTE_FP32=False, FP16_OPERANDS=fp16,
                     HOST_FALLBACK=host_fallback, BLOCKING=PAIR_PER_BLOCK if one_token else GROUPED,
                     SPLIT_K=split_k,
                     BLOCK_M=tiles["block_m"], BLOCK_N=tiles["block_n"], BLOCK_K=tiles["block_k"],
                     NUM_STAGES=tiles["num_stages"], TMA_LOADS=tma_loads, DEPENDENT_LAUNCH=capability >= 90,
                     X_PAIRED=x_paired, PAIRED_SHIFT=paired_shift, SCAN=_scan_width(2880),  # gpt-oss's K
                     SUM_TOP_K=4 if one_token and not gated else 0,  # one token's down launch sums gpt-oss's top-4
                     column_stride=1)  # the JIT makes an argument equal to 1 a constant
    if not tma_loads:
        constants["words_tma"] = None
    signature |= {name: "constexpr" for name in constants}
    if tma_loads:  # `_words_descriptor`'s tiles: `tma_tile`'s rows by one K step of 4-byte words
        codes_per_word = 8 if format == "mxfp4" else 4
        signature["words_tma"] = f"tensordesc<i32[{tile_rows}, {tiles['block_k'] // codes_per_word}]>"
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED}
    source = ASTSource(_moe_gemm_kernel, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"],
                                   "launch_pdl": capability >= 90})


def disassemble(cubin: bytes) -> str:
    """`cubin`'s SASS and resource usage, from the cuobjdump bundled with Triton."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path("/tmp") / "dflash_kernel_sass.cubin"
    path.write_bytes(cubin)
    return subprocess.run([str(tool), "-sass", "--dump-resource-usage", str(path)], capture_output=True, text=True,
                          check=True).stdout


def resident_ctas(sass: str, num_warps: int, shared_bytes: int) -> tuple[int, int]:
    """(registers per thread, CTAs an SM holds on sm_90: 64K registers, allocated per warp in units of 256; at most
    64 warps and 32 CTAs; 228 KiB of shared memory, each CTA its `shared_bytes` and 1 KiB the system keeps), the
    registers from `disassemble`'s output. Session 67: 3 -> 2 CTAs of gpt-oss-20b's blocks of 2 cost 13%."""
    registers = int(re.search(r"REG:(\d+)", sass).group(1))
    per_warp = -(-registers * 32 // 256) * 256
    return registers, min(65536 // (per_warp * num_warps), 64 // num_warps, 32, 228 * 1024 // (shared_bytes + 1024))


def k_loop(sass: str) -> list[str]:
    """The instructions of the longest loop in `disassemble`'s output (the K loop: every other loop is short
    bookkeeping). Branches placed after the kernel's last EXIT are left out: they are ptxas's out-of-line retries of
    barrier waits (TMA's), which jump back into the loop from the end and would stretch it over the epilogue."""
    code = [(int(address, 16), text.strip()) for address, text in
            re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    last_exit = max(address for address, text in code if opcode(text) == "EXIT")
    loops = [(int(target, 16), address) for address, text in code if address < last_exit
             for target in re.findall(r"BRA (0x[0-9a-f]+)", text) if int(target, 16) < address]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return [text for address, text in code if start <= address <= end]


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def compile_error(failure: BaseException) -> str:
    """The first line of a failed compile that says what went wrong (ptxas's first error, or the innermost
    exception's message)."""
    chain = [failure]
    while chain[-1].__cause__ or chain[-1].__context__:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    text = "\n".join(str(error) for error in chain)
    errors = [line.split("error", 1)[1].strip(" :") for line in text.splitlines() if line.startswith("ptxas ")
              and "error" in line]
    return (errors[0] if errors else str(chain[-1]).strip().splitlines()[-1])[:200]


def parse_tiles(items: list[str]) -> dict:
    """Tile overrides from the command line: ["block_n=64", "operands=fp16"] -> {"block_n": 64, "operands": "fp16"}."""
    return {key: int(value) if value.isdigit() else value for key, value in (item.split("=") for item in items)}


def tile_grid(values: list[str]) -> list[dict]:
    """Every combination of swept tile values: ["block_m=16,64", "num_warps=4,8"] -> four tile dicts."""
    names = [item.split("=")[0] for item in values]
    return [parse_tiles([f"{name}={value}" for name, value in zip(names, combo)])
            for combo in itertools.product(*(item.split("=")[1].split(",") for item in values))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--tiles", nargs="*", default=[], help="overrides of the format's TILES, e.g. block_n=64")
    parser.add_argument("--host-fallback", action="store_true", help="offload's slot table and host blobs")
    parser.add_argument("--one-token", action="store_true", help="a decode launch (tile split_k applies)")
    parser.add_argument("--concatenated", action="store_true", help="gate/up rows concatenated, not interleaved")
    parser.add_argument("--digest", action="store_true", help="add an md5 of each kernel's SASS instructions")
    parser.add_argument("--capability", type=int, default=H200,
                        help="compile for sm_<this> instead (below 90: pointer loads, no dependent launch)")
    args = parser.parse_args()
    overrides = parse_tiles(args.tiles)
    print("| format | projection | tiles | loop instructions / thread | CTA barriers / iteration | weight bytes / "
          "iteration | bytes / warp instruction | registers / thread (CTAs per SM) | commonest opcodes |"
          + (" SASS md5 |" if args.digest else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if args.digest else ""))
    for format in args.format:
        tma = not args.host_fallback and args.capability >= 90
        projection_tiles = tiles_for(format, overrides, 1 if args.one_token else None,  # as `fused_moe` picks them
                                     "tma" if tma and "tma" in ROW_TILES[format] else "pointers")
        for gated in (True, False):
            tiles = projection_tiles if gated else projection_tiles | projection_tiles["down_launch"]
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # a failing ptxas run prints the whole PTX
                    kernel = compile_kernel(format, gated, tiles, args.host_fallback, args.one_token,
                                            not args.concatenated, args.capability)
                    sass = disassemble(kernel.asm["cubin"])
            except Exception as failure:  # e.g. an instruction this target lacks: say which, go on
                print(f"| {format} | {'gate_up' if gated else 'down'} | does not compile for sm_{args.capability}: "
                      f"{compile_error(failure)} |", flush=True)
                continue
            loop = k_loop(sass)
            registers, ctas = resident_ctas(sass, tiles["num_warps"], kernel.metadata.shared)
            rows = tiles["block_n"] * (2 if gated else 1)
            weight_bytes = rows * tiles["block_k"] * {"dense": 2, "mxfp4": 0.5, "fp8_block": 1}[format]
            opcodes = collections.Counter(map(opcode, loop))
            common = ", ".join(f"{name} {count}" for name, count in opcodes.most_common(5))
            tile_text = " ".join(f"{key}={value}" for key, value in tiles.items() if key != "down_launch")
            digest = ""
            if args.digest:  # the instructions alone: cuobjdump's header names the temporary file
                instructions = "\n".join(line for line in sass.splitlines() if "/*" in line)
                digest = f" {hashlib.md5(instructions.encode()).hexdigest()} |"
            print(f"| {format} | {'gate_up' if gated else 'down'} | {tile_text} | {len(loop)} | {opcodes['BAR']} | "
                  f"{weight_bytes:.0f} | {weight_bytes / (len(loop) * tiles['num_warps']):.2f} | "
                  f"{registers} ({ctas}) | {common} |{digest}",
                  flush=True)


if __name__ == "__main__":
    main()
