"""Fused routed-expert MoE in Triton, for decode and verify sizes (M = 1..64 tokens): the weights stay packed
(MXFP4, FP8 block-scaled, or dense) and are dequantized tile by tile inside the GEMM's K loop.

Two GEMM launches per MoE layer, both over blocks of BLOCK_M (token, expert) pairs of one expert:

    gate_up: h[p]   = act(x[token(p)] @ W1[e(p)]^T + b1[e(p)])     gate/up rows concatenated or interleaved
    down:    y[p]   = (h[p] @ W2[e(p)]^T + b2[e(p)]) * weight(p)
    out[t]          = sum over the token's top-k pairs of y

Each expert's weight tile is read once per block of pairs routed to it, so a decode step reads each routed expert
once. The pair -> block assignment (`align_routing`) is computed on the device without a host sync, with the grid
sized by its upper bound: blocks past the real count exit at once (CUDA-graph friendly); a single token needs none
(each pair its own block). A third launch sums each token's pairs in fp32 and rounds once to the output dtype.
Blocks hold 16 pairs (TILES); at prefill sizes more (WIDE_TILES, `rows_per_block`: MXFP4 64 or 128, FP8 32), so each
weight tile is decoded once for that many pairs and multiplied by warpgroup MMAs. From DEQUANTIZE_PAIRS pairs per
routed expert (a long prefill chunk) the experts are dequantized to bf16 instead and multiplied by torch's grouped
GEMM (cuBLAS), the activation and the pair sum in launches of their own (`_dequantized_moe`).

On Hopper every launch here is a programmatic dependent launch (`_dependent_launch`): the next kernel's programs
start while the previous one's last programs finish, and wait in `gdc_wait` before touching memory, which takes
most of the ~1-1.5 us gap between a layer's launches (one token 1.04-1.06x, session 20).

A single token's launches can split K (tile `split_k`): each program takes one share of K, so a decode launch has
split_k times the programs of its top-k x column-tile grid, which alone leaves SMs idle. The shares' fp32 partial
sums are added in a fixed order (deterministic): for gate/up by one more small launch that also activates them, for
down by the pair sum. The down launch may take tiles of its own (tile `down_launch`, DOWN_TILES), its shares then
split alone at no extra launch.

Offload's layout (`slot_of`): the weights are a slot pool on the device, a table maps experts to slots, and an
expert without a slot is read by the kernel from its pinned host blob over PCIe (zero-copy; the GPU addresses
pinned memory directly), so a layer can run without the host first copying its misses (bench/zero_copy.py).

`COMPUTE_FP32` makes every product and sum fp32 (the path the CPU tests run under TRITON_INTERPRET=1, whose bf16
arithmetic is wrong); otherwise tiles are bf16 into fp32 accumulators. Codes are decoded arithmetically there (no
fp8 casts inside the kernel, which the interpreter gets wrong). On the GPU, MXFP4 codes are decoded by inline PTX
straight into the register pairs of the MMA operand (`_E2M1_BF16_ASM`), FP8 codes by the hardware conversion.

Blocks of one or two rows of activations times MXFP4 weights (a decode step's launches; verify sizes where experts
get about one pair each, `rows_per_block`; a dense layer's one or two rows) run on the CUDA cores instead
(`_row_project`, tiles `ROW_TILES`): no tensor-core tile padded to 16 rows, codes decoded to fp16 pairs by shifts
and masks per word and a byte permute per pair (`_e2m1_word_pairs`, 11 instructions per 8 codes) and multiplied in
fp16x2, the activations scaled by a power of two that keeps them in fp16's range. FP8 experts take the same path
for one token and blocks of 2 (the hardware's e4m3x2 -> f16x2 conversion per pair of codes; 1.06-1.12x over the
tensor-core tiles on the H200, session 21; FP8 dense layers for one row, 1.01-1.29x, session 22). On Hopper their
weight words come through TMA descriptors (`weight_loads="tma"`, `_tma_blocker` says where not), a few K steps
ahead into shared memory, which frees the warps' load instructions and registers: 1.05x at one token, 1.27-1.47x
for blocks of 2 (session 17), which then beat the tensor cores up to ~3.3 pairs per routed expert (session 19).
Both launches can take their activations as fp16 already in the row path's pair order (`_paired_columns`,
X_PAIRED), loading pairs as words instead of converting and pairing bf16 values every step: with clamped SwiGLU
(bounded outputs) the gate/up launch writes the down launch's so (PAIRED_SHIFT), and for blocks of 2 a launch per
call (`_pair_rows`) makes the gate/up launch's (one token scales its row in the kernel: there the launch cost more
than it saved, 0.95-0.98x). 1.07-1.09x, then 1.02-1.06x, at verify sizes (session 20).

One token's layer in gpt-oss's MXFP4 layout (interleaved gate/up, clamped SwiGLU, biases, top-4), in MXFP4 with
concatenated gate/up and SiLU (top-2, 4, 8) or in Qwen3-FP8's (top-8), experts resident, can run CUDA C++ kernels
instead (`cuda_rows`, csrc/moe_rows_cuda.cu; 1.12-1.28x the Triton kernels for the three on an H100, session 60):
by default on the H100 and the H200 (1.10-1.34x there, session 69), elsewhere with DFLASH_CUDA_ROWS=1
(`cuda_rows.FASTER_ON`).

`FP16_OPERANDS` (FP8 weights, tile setting `operands="fp16"`): the weights go to the tensor cores as fp16 through
the one-instruction e4m3x2 -> f16x2 conversion (bf16 takes two per value), and the activations come in as fp16
times FP16_PRESCALE (made once per call; the gate/up launch writes its output the same way for the down launch),
so the K loop converts nothing else: 331 -> 227 (gate/up) and 204 -> 156 (down) instructions per K step on sm_90
(bench/kernel_sass.py). The prescale keeps activations up to 1.6e7 finite; fp16 keeps 3 more mantissa bits than
bf16 above 2^-6 and rounds smaller values to 2^-17 absolute. The FP8 default since it measured 1.14x / 1.18x faster
than the best bf16 tiles on the H200 (Qwen3-30B-A3B-FP8 layer, M = 1 / 16; docs/benchmarks.md).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from ..packed import PackedWeight
from . import cuda_rows, sm_count
from .arrivals import arrival_counts

FORMATS = {"dense": 0, "mxfp4": 1, "fp8_block": 2}
FP16_PRESCALE = tl.constexpr(2.0**-8)  # activations times this are fp16 operands (see FP16_OPERANDS)
ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1, "gelu_tanh": 2, "clamped_silu": 3, "relu2": 4, "clamped_gate_silu": 5,
               "softcapped_swiglu": 6}
UNGATED_ACTIVATIONS = ("relu2",)  # of experts without a gate: their first projection is up alone


@triton.jit
def _wait_for_previous_launch(DEPENDENT_LAUNCH: tl.constexpr):
    """With programmatic dependent launch (`_dependent_launch`): wait for the stream's previous kernel to finish
    and its writes to be visible. Every kernel here calls this before it reads or writes memory."""
    if DEPENDENT_LAUNCH:
        gdc_wait()


@triton.jit
def _let_next_launch(DEPENDENT_LAUNCH: tl.constexpr):
    """With programmatic dependent launch: the stream's next kernel may launch once every program of this one has
    called this (and then waits in `_wait_for_previous_launch`). The GEMM calls it after its K loop: called
    earlier, the next launch's programs take whichever SMs have room at that moment and pile onto a few of them
    (one token's gpt-oss layer measured 31.2 -> 38.5 us with it at the start, on the H200)."""
    if DEPENDENT_LAUNCH:
        gdc_launch_dependents()


def _hopper_or_newer(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer: TMA and programmatic dependent launch."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _dependent_launch(device: torch.device) -> dict:
    """Launch options for the kernels here: on Hopper or newer, programmatic dependent launch (each waits in
    `_wait_for_previous_launch`), which hides the gap between a layer's launches; off elsewhere (the interpreter)."""
    on = _hopper_or_newer(device)
    return {"DEPENDENT_LAUNCH": on, "launch_pdl": True} if on else {"DEPENDENT_LAUNCH": False}


ALIGN_CHUNK = 128  # pairs per step of the grouping kernel, one per thread of its warps (atomics need no replicas)


@triton.jit
def _align_routing_kernel(experts_of_pairs, pair_ids, block_expert, cursor, P, E, BLOCKS,
                          BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, SLOTS_POW2: tl.constexpr,
                          BLOCKS_POW2: tl.constexpr, CHUNK: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """One program: pairs grouped by expert into slots padded to BLOCK_M per expert, in O(pairs + experts) steps:
    atomic counts per expert, their padded prefix sums as each expert's first slot, then one atomic increment per
    pair takes the next slot of its expert. The order of an expert's pairs within its slots is whatever the atomics
    give; each pair's result does not depend on it (one row of the block's GEMM)."""
    _wait_for_previous_launch(DEPENDENT_LAUNCH)
    _let_next_launch(DEPENDENT_LAUNCH)  # one program or a few: no SMs to crowd
    ids = tl.arange(0, E_POW2)
    tl.store(cursor + ids, 0, mask=ids < E)
    slots = tl.arange(0, SLOTS_POW2)
    tl.store(pair_ids + slots, tl.full(slots.shape, 0, tl.int32) + P, mask=slots < BLOCKS * BLOCK_M)  # padding
    blocks = tl.arange(0, BLOCKS_POW2)
    tl.store(block_expert + blocks, tl.full(blocks.shape, -1, tl.int32), mask=blocks < BLOCKS)  # past the real ones
    tl.debug_barrier()  # zeros and fills land before the atomics and the scatter below
    for c in range(0, P, CHUNK):  # pairs per expert
        pair = c + tl.arange(0, CHUNK)
        expert = tl.load(experts_of_pairs + pair, mask=pair < P, other=0)
        tl.atomic_add(cursor + expert, 1, mask=pair < P)
    tl.debug_barrier()
    padded = tl.load(cursor + ids, mask=ids < E, other=0, volatile=True)  # past L1: the atomics ran in L2
    padded = (padded + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.debug_barrier()  # every thread has its counts before they become first slots
    tl.store(cursor + ids, tl.cumsum(padded, axis=0) - padded, mask=ids < E)
    tl.debug_barrier()
    for c in range(0, P, CHUNK):  # each pair's slot: the next free one of its expert
        pair = c + tl.arange(0, CHUNK)
        pair_ok = pair < P
        expert = tl.load(experts_of_pairs + pair, mask=pair_ok, other=0)
        slot = tl.atomic_add(cursor + expert, 1, mask=pair_ok)
        tl.store(pair_ids + slot, pair, mask=pair_ok)
        tl.store(block_expert + slot // BLOCK_M, expert, mask=pair_ok)  # a block's pairs all write its expert


def align_routing(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the flattened (token, expert) pairs by expert into blocks of `block_m`, each block one expert.

    Returns pair ids [blocks * block_m] (the pair count P marks padding) and each block's expert [blocks] (-1 for
    blocks past the real count). `blocks` is an upper bound from shapes only, so nothing is read on the host, and
    the whole grouping is one small kernel launch.
    """
    flat = top_k_index.reshape(-1).to(torch.int32)
    pairs = flat.numel()
    blocks = -(-(pairs + min(pairs, num_experts) * (block_m - 1)) // block_m)
    pair_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=flat.device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=flat.device)  # per expert: count, then next slot
    _align_routing_kernel[(1,)](flat, pair_ids, block_expert, cursor, pairs, num_experts, blocks, BLOCK_M=block_m,
                                E_POW2=triton.next_power_of_2(num_experts),
                                SLOTS_POW2=triton.next_power_of_2(blocks * block_m),
                                BLOCKS_POW2=triton.next_power_of_2(blocks), CHUNK=ALIGN_CHUNK,
                                num_warps=ALIGN_CHUNK // 32, **_dependent_launch(flat.device))
    return pair_ids, block_expert


# How a launch's programs along grid axis 0 take their rows (kernel constexpr BLOCKING):
GROUPED = 0  # `align_routing`'s blocks: pair ids and each block's expert
PAIR_PER_BLOCK = 1  # block b is pair b alone, its expert read from the routing itself (one token)
ROWS_IN_ORDER = 2  # one expert (a dense layer): block b is rows [b * BLOCK_M, (b + 1) * BLOCK_M)


class Blocks(NamedTuple):
    """A launch's blocks of rows: the blocking, how many, and `align_routing`'s tensors where they are needed."""
    blocking: int
    count: int  # programs along grid axis 0
    pair_ids: torch.Tensor | None = None
    block_expert: torch.Tensor | None = None


def _blocks(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> Blocks:
    """The MoE GEMM launches' blocks: `align_routing`'s, or for one token (decode) every pair a block of its own: a
    token's experts are distinct, so that reads each expert once as well, and the grouping launch is saved."""
    if top_k_index.shape[0] == 1:
        return Blocks(PAIR_PER_BLOCK, top_k_index.numel(), block_expert=top_k_index.reshape(-1))
    pair_ids, block_expert = align_routing(top_k_index, num_experts, block_m)
    return Blocks(GROUPED, block_expert.numel(), pair_ids, block_expert)


@triton.jit
def _token_sums(per_pair, tokens, columns, ok, P, H, TOP_K: tl.constexpr, SPLITS: tl.constexpr):
    """[tokens, columns] fp32 where `ok`: each token's TOP_K consecutive pair rows of per_pair [SPLITS, P, H] fp32,
    every split, added in one fixed order (split by split, pair by pair), the one `_sum_pairs` and `_sum_when_last`
    share: both give the same bits. The loads bypass L1 (`.cg`): in-launch sums read other programs' stores."""
    total = tl.zeros(ok.shape, dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        for j in tl.static_range(TOP_K):
            rows = split * P + tokens.to(tl.int64) * TOP_K + j
            total += tl.load(per_pair + rows[:, None] * H + columns[None, :], mask=ok, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _sum_pairs_kernel(per_pair, out, P, H, SPLITS: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                      DEPENDENT_LAUNCH: tl.constexpr):
    _wait_for_previous_launch(DEPENDENT_LAUNCH)
    _let_next_launch(DEPENDENT_LAUNCH)  # one program or a few: no SMs to crowd
    token, columns = tl.full((1,), tl.program_id(0), tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (columns < H)[None, :]
    total = _token_sums(per_pair, token, columns, ok, P, H, TOP_K, SPLITS)
    tl.store(out + token[:, None] * H + columns[None, :], total, mask=ok)  # in out's dtype


@triton.jit
def _sum_when_last(per_pair, out, arrivals, pairs, pair_ok, columns, column_ok, P, H, TOP_K: tl.constexpr,
                   SPLITS: tl.constexpr):
    """`_sum_pairs` inside the launch that writes the partials: each program counts its pairs' partials of its
    column tile in `arrivals` (one int32 per token and column tile), and the program that brings a token's count to
    TOP_K * SPLITS adds all of them for that tile (`_token_sums`, as `_sum_pairs` does: the same bits) into `out`
    and sets the count back to 0 for the next call. No program waits for another; the barrier and the
    acquire-release count order every partial's store before its sum's loads."""
    tl.debug_barrier()
    tokens = pairs // TOP_K
    count = arrivals + tokens * tl.num_programs(1) + tl.program_id(1)
    arrived = tl.atomic_add(count, 1, mask=pair_ok, sem="acq_rel", scope="gpu")
    last = pair_ok & (arrived == TOP_K * SPLITS - 1)
    tl.debug_barrier()
    ok = last[:, None] & column_ok[None, :]
    total = _token_sums(per_pair, tokens, columns, ok, P, H, TOP_K, SPLITS)
    tl.store(out + tokens[:, None].to(tl.int64) * H + columns[None, :], total, mask=ok)  # in out's dtype
    tl.store(count, 0, mask=last)


def _sum_pairs(per_pair: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S, T, k, H] fp32 (S K splits) -> [T, H] in `dtype`: each token's pairs and splits summed in fp32 in a fixed
    order, rounded once, in one launch."""
    splits, tokens, top_k, h = per_pair.shape
    out = torch.empty(tokens, h, dtype=dtype, device=per_pair.device)
    block = min(1024, triton.next_power_of_2(h))
    _sum_pairs_kernel[(tokens, triton.cdiv(h, block))](per_pair, out, tokens * top_k, h, SPLITS=splits, TOP_K=top_k,
                                                       BLOCK=block, **_dependent_launch(per_pair.device))
    return out


@triton.jit
def _activate(gate, up, ACTIVATION: tl.constexpr, alpha, limit):
    """The family's activation of the gate and up projections (fp32)."""
    if ACTIVATION == 1:  # gpt-oss: clamped SwiGLU
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        result = (up + 1.0) * gate * tl.sigmoid(gate * alpha)
    elif ACTIVATION == 2:  # GELU(gate) * up, tanh approximation: 0.5 (1 + tanh(z)) = sigmoid(2z)
        result = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
    elif ACTIVATION == 3:  # Step 3.7: SiLU(gate) <= limit, times up clamped to [-limit, limit]
        result = tl.minimum(gate * tl.sigmoid(gate), limit) * tl.minimum(tl.maximum(up, -limit), limit)
    elif ACTIVATION == 5:  # HY V4: SiLU(gate <= limit), times up clamped to [-limit, limit]
        gate = tl.minimum(gate, limit)
        result = gate * tl.sigmoid(gate) * tl.minimum(tl.maximum(up, -limit), limit)
    elif ACTIVATION == 6:  # Inkling 2: softcap(gate, alpha) sigmoid(gate) softcap(up, limit); tanh(z) = 2 sig(2z) - 1
        capped_gate = alpha * (2.0 * tl.sigmoid(2.0 * gate / alpha) - 1.0)
        result = capped_gate * tl.sigmoid(gate) * limit * (2.0 * tl.sigmoid(2.0 * up / limit) - 1.0)
    elif ACTIVATION == 4:  # Nemotron-H, experts without a gate: relu(up)^2, up passed as both
        result = tl.maximum(up, 0.0) * tl.maximum(up, 0.0)
    else:  # SiLU(gate) * up
        result = gate * tl.sigmoid(gate) * up
    return result


@triton.jit
def _finish_gate_up_kernel(partials, out, bias, bias_stride, expert_of_row, P, N, alpha, limit, SPLITS: tl.constexpr,
                           ACTIVATION: tl.constexpr, FP16_OPERANDS: tl.constexpr, INTERLEAVED: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    _wait_for_previous_launch(DEPENDENT_LAUNCH)
    _let_next_launch(DEPENDENT_LAUNCH)  # one program or a few: no SMs to crowd
    pair, columns = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < N
    # each column's gate and up as one [BLOCK, 2] load: interleaved pairs are adjacent, so no stride-2 loads
    up_offset = 1 if INTERLEAVED else N
    both_columns = (2 * columns if INTERLEAVED else columns)[:, None] + tl.arange(0, 2)[None, :] * up_offset
    both = tl.zeros((BLOCK, 2), dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        both += tl.load(partials + (split * P + pair) * (2 * N) + both_columns, mask=inside[:, None],
                        other=0.0).to(tl.float32)
    if HAS_BIAS:  # the row's expert's
        row_bias = bias + tl.load(expert_of_row + pair).to(tl.int64) * bias_stride
        both += tl.load(row_bias + both_columns, mask=inside[:, None], other=0.0).to(tl.float32)
    gate, up = tl.split(both)
    result = _activate(gate, up, ACTIVATION, alpha, limit)
    if FP16_OPERANDS:  # the down launch's activations
        result = result * FP16_PRESCALE
    tl.store(out + pair * N + columns, result, mask=inside)  # in out's dtype


def _finish_gate_up(partials: torch.Tensor, dtype: torch.dtype, activation: str, alpha: float, limit: float,
                    fp16_operands: bool, interleaved: bool = True, bias: torch.Tensor | None = None,
                    expert_of_row: torch.Tensor | None = None) -> torch.Tensor:
    """[S, P, 2N] gate/up partial sums of S K splits (gate and up interleaved, or concatenated), plus each row's
    expert's bias [E, 2N] where given (its experts any stride apart: slot-pool views), -> [P, N] activations in
    `dtype`, as the unsplit gate/up launch writes them."""
    splits, pairs, two_n = partials.shape
    out = torch.empty(pairs, two_n // 2, dtype=dtype, device=partials.device)
    block = min(1024, triton.next_power_of_2(two_n // 2))
    _finish_gate_up_kernel[(pairs, triton.cdiv(two_n // 2, block))](
        partials, out, bias, 0 if bias is None else bias.stride(0), expert_of_row, pairs, two_n // 2, float(alpha),
        float(limit), SPLITS=splits, ACTIVATION=ACTIVATIONS[activation], FP16_OPERANDS=fp16_operands,
        INTERLEAVED=interleaved, HAS_BIAS=bias is not None, BLOCK=block, **_dependent_launch(partials.device))
    return out


@triton.jit
def _sum_sorted_pairs_kernel(projected, row_of_pair, expert_of_pair, pair_weights, bias, bias_stride, out, H, E,
                             TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Token program_id(0), columns tile program_id(1): its TOP_K pairs' down projections (rows of `projected` at
    `row_of_pair`) plus their expert's bias (experts `bias_stride` apart), times their routing weights, summed in
    fp32 in pair order, rounded once.
    Pairs of ids past the E experts (expert-parallel sentinels) add nothing."""
    token, columns = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = columns < H
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(expert_of_pair + pair).to(tl.int64)
        local = ok & (columns * 0 + expert < E)  # the comparison broadcast: a scalar mask part fails in the interpreter
        row = tl.load(row_of_pair + pair).to(tl.int64)
        y = tl.load(projected + row * H + columns, mask=local, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias + expert * bias_stride + columns, mask=local, other=0.0).to(tl.float32)
        total += y * tl.load(pair_weights + pair).to(tl.float32)
    tl.store(out + token * H + columns, total, mask=ok)  # in out's dtype


@triton.jit
def _e2m1(code):
    """E2M1 code (int32, 0..15) -> value: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and the same negated for 8..15."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    scale = tl.exp2((tl.maximum(exponent, 1) - 1).to(tl.float32))
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * scale)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _e4m3(byte):
    """float8_e4m3fn bits (int32, 0..255) -> value (the quantizers never write the NaN code)."""
    exponent = (byte >> 3) & 15
    mantissa = (byte & 7).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.001953125,  # subnormal: m * 2^-9
                         (1.0 + mantissa * 0.125) * tl.exp2((exponent - 7).to(tl.float32)))
    return tl.where((byte & 128) != 0, -magnitude, magnitude)


# MXFP4 -> bf16 for four packed bytes ($4, byte j = element j) of one group with its E8M0 exponent e ($5; $6-$8 are
# the same), into $j = byte j's two values (low nibble in the low half): columns in order, as the MMA operand holds
# them. Per word: the low nibbles and (shifted by 4) the high nibbles masked to 0x0F bytes. Per pair: a PRMT puts byte
# j's low nibble in the low half and its high nibble in the high half (selector 8, "replicate the sign of byte 0",
# fills the other bytes with zeros: every byte's top bit is clear), one multiply moves each nibble's exponent/mantissa
# bits to bf16 bits 6-8 and its sign to bit 15 (the two shifted copies cannot overlap), an AND keeps those bits, a
# bf16x2 multiply by 2^126 (the formats' exponent biases: E2M1's subnormal 0.5 lands on bf16's subnormal 2^-127) and
# one by the scale 2^(e-127) (e << 7; e = 0, 2^-127, becomes 0). ~2.9 instructions per value where `tl.dot_scaled`'s
# Hopper upcast took ~7.5 with byte-wise shared-memory reads.
_E2M1_BF16_ASM = tl.constexpr("""{
.reg .b32 low, high, pair, bits, bias, scale, minus_zero;
mov.b32 bias, 0x7E807E80;
mov.b32 minus_zero, 0x80008000;
mul.lo.u32 scale, $5, 0x00800080;
and.b32 low, $4, 0x0F0F0F0F;
shr.b32 high, $4, 4;
and.b32 high, high, 0x0F0F0F0F;
""" + "".join(f"""prmt.b32 pair, low, high, {j | 8 << 4 | (4 + j) << 8 | 8 << 12:#06x};
mul.lo.u32 bits, pair, 0x1040;
and.b32 bits, bits, 0x81C081C0;
fma.rn.bf16x2 bits, bits, bias, minus_zero;
fma.rn.bf16x2 ${j}, bits, scale, minus_zero;
""" for j in range(4)) + "}")


@triton.jit
def _mxfp4_tile(data, scales, rows, row_ok, k, K, COMPUTE_FP32: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_ROWS, BLOCK_K] MXFP4 weight values at `rows` x [k, k + BLOCK_K), scaled, columns in order: bf16 by
    inline PTX on the GPU (`_E2M1_BF16_ASM`), fp32 arithmetic in the fp32 path (the interpreter cannot run PTX)."""
    groups = k // 32 + tl.arange(0, BLOCK_K // 32)
    ok = row_ok[:, None] & (groups[None, :] < K // 32)
    byte_columns = groups[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    packed = tl.load(data + rows[:, None, None] * (K // 2) + byte_columns, mask=ok[:, :, None], other=0)
    exponent = tl.load(scales + rows[:, None] * (K // 32) + groups[None, :], mask=ok, other=127).to(tl.int32)
    if COMPUTE_FP32:  # each byte's two columns: the low nibble, then the high one
        scale = tl.exp2(exponent.to(tl.float32) - 127.0)[:, :, None]
        codes = packed.to(tl.int32)
        tile = tl.reshape(tl.join(_e2m1(codes & 15) * scale, _e2m1(codes >> 4) * scale), (rows.shape[0], BLOCK_K))
    else:  # `first` holds columns 8q..8q+3 of each 4-byte pack q, `second` 8q+4..8q+7
        first, second = tl.inline_asm_elementwise(_E2M1_BF16_ASM, "=r,=r,=r,=r,r,r,r,r,r",
                                                  [packed, tl.broadcast_to(exponent[:, :, None], packed.shape)],
                                                  dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        values = tl.join(tl.reshape(first, (rows.shape[0], BLOCK_K // 8, 4)),
                         tl.reshape(second, (rows.shape[0], BLOCK_K // 8, 4)))
        tile = tl.reshape(tl.permute(values, (0, 1, 3, 2)), (rows.shape[0], BLOCK_K))
    return tile


def _e2m1_word_pairs(word: str) -> str:
    """PTX for the four fp16x2 pairs `pair0`-`pair3` of a packed MXFP4 word's codes (pair i: K offsets
    `_row_pairs`()[i] and that + 2, low half first), each code times 2^-14: every low nibble's sign and
    exponent/mantissa bits moved to bits 7 and 3-1 of its byte (two shifts, two masks), then every high nibble's (one
    shift, two masks), and a PRMT per pair puts two such bytes over zero low bytes: fp16 bits 15 and 11-9, where
    E2M1's subnormal 0.5 lands on fp16's subnormal 2^-15. 11 instructions per 8 codes, where shifting each pair into
    place took 16."""
    return (f"shl.b32 low, {word}, 1;\nshl.b32 sign, {word}, 4;\nand.b32 low, low, 0x0E0E0E0E;\n"
            "and.b32 sign, sign, 0x80808080;\nor.b32 low, low, sign;\n"
            f"shr.b32 high, {word}, 3;\nand.b32 high, high, 0x0E0E0E0E;\nand.b32 sign, {word}, 0x80808080;\n"
            "or.b32 high, high, sign;\n"
            "prmt.b32 pair0, low, 0, 0x1404;\nprmt.b32 pair1, low, 0, 0x3424;\n"
            "prmt.b32 pair2, high, 0, 0x1404;\nprmt.b32 pair3, high, 0, 0x3424;\n")


def _e4m3_word_pairs(word: str) -> str:
    """PTX for the two fp16x2 pairs `pair0`, `pair1` of a word of four float8_e4m3fn bytes (pair i: K offsets 2i and
    2i + 1, low half first), exact: the hardware's e4m3x2 -> f16x2 conversion, one instruction per pair."""
    return (f"mov.b32 {{low16, high16}}, {word};\ncvt.rn.f16x2.e4m3x2 pair0, low16;\n"
            "cvt.rn.f16x2.e4m3x2 pair1, high16;\n")


def _row_group_asm(word_pairs, words: int, pairs: int) -> str:
    """PTX for one row of activations times one 32-code group of packed weights on the CUDA cores, `words` words of
    `pairs` fp16x2 pairs each (`word_pairs` decodes one): $1-$words the group's words, $(1 + words + words * i + j)
    the activations of word j's pair i as fp16x2 (scaled by 2^shift), then the group's scale, 2^(code exponent -
    shift) that undoes the activations' and the decode's powers of two, and the running sum -> $0 = running sum +
    scale * that * the group's 32 products. The products add in fp16x2, the two halves in fp32."""
    products = []
    for j in range(words):
        products.append(word_pairs(f"${1 + j}"))
        for i in range(pairs):
            activations = f"${1 + words + words * i + j}"
            products.append(f"mul.rn.f16x2 sum, pair{i}, {activations};\n" if i == j == 0 else
                            f"fma.rn.f16x2 sum, pair{i}, {activations}, sum;\n")
    scale = 1 + words * (1 + pairs)
    return ("{\n.reg .b32 low, high, sign, pair0, pair1, pair2, pair3, sum;\n"
            ".reg .b16 lowsum, highsum, low16, high16;\n.reg .f32 low32, high32;\n" + "".join(products)
            + "mov.b32 {lowsum, highsum}, sum;\ncvt.f32.f16 low32, lowsum;\ncvt.f32.f16 high32, highsum;\n"
            + f"add.rn.f32 low32, low32, high32;\nmul.rn.f32 low32, low32, ${scale + 1};\n"
            + f"fma.rn.f32 $0, low32, ${scale}, ${scale + 2};\n}}")


def _row_group_constraints(words: int, pairs: int) -> str:
    return ",".join(["=f"] + ["r"] * (words * (1 + pairs)) + ["f"] * 3)


# The row path's group PTX per format: MXFP4 words hold 8 codes (4 words, 4 pairs each, codes times 2^-14), FP8
# words 4 (8 words, 2 pairs each, exact).
_E2M1_ROW_ASM = tl.constexpr(_row_group_asm(_e2m1_word_pairs, 4, 4))
_E2M1_ROW_CONSTRAINTS = tl.constexpr(_row_group_constraints(4, 4))
_E4M3_ROW_ASM = tl.constexpr(_row_group_asm(_e4m3_word_pairs, 8, 2))
_E4M3_ROW_CONSTRAINTS = tl.constexpr(_row_group_constraints(8, 2))


@triton.jit
def _row_pairs():
    """Each fp16x2 pair's first K offset in a packed MXFP4 word, (0, 4, 1, 5): the order `_e2m1_word_pairs` makes
    them in (pair i: offsets _row_pairs()[i] and that + 2)."""
    i = tl.arange(0, 4)
    return i % 2 * 4 + i // 2


@triton.jit
def _word_pairs(FORMAT: tl.constexpr):
    """[pairs per word, 2]: the K offsets in a packed word of the fp16x2 pairs the row path decodes it into, in the
    decode's order: MXFP4 `_row_pairs`' (i, i + 2), FP8 (2i, 2i + 1)."""
    if FORMAT == 1:
        pairs = _row_pairs()[:, None] + 2 * tl.arange(0, 2)[None, :]
    else:
        pairs = 2 * tl.arange(0, 2)[:, None] + tl.arange(0, 2)[None, :]
    return pairs


@triton.jit
def _quarters(t):
    """The four slices of t's last axis (size 4), in order."""
    even, odd = tl.split(tl.reshape(t, t.shape[:-1] + (2, 2)))
    first, third = tl.split(even)
    second, fourth = tl.split(odd)
    return first, second, third, fourth


@triton.jit
def _slices(t, SIZE: tl.constexpr):
    """The slices of t's last axis (size SIZE: 2, 4 or 8), the same order for every t of that size."""
    if SIZE == 2:
        slices = tl.split(t)
    elif SIZE == 4:
        slices = _quarters(t)
    else:
        even, odd = tl.split(tl.reshape(t, t.shape[:-1] + (4, 2)))
        slices = _quarters(even) + _quarters(odd)
    return slices


@triton.jit
def _broadcast_slices(t, shape: tl.constexpr):
    """`_slices` of t broadcast to `shape` ([BLOCK_M, ROWS, GROUPS, words per group])."""
    return _slices(tl.broadcast_to(t, shape), shape[3])


@triton.jit
def _row_step_loads(words, scales, x_rows, rows, row_ok, k, stop, K, word, offset, FORMAT: tl.constexpr,
                    GROUPS: tl.constexpr, EVICTION: tl.constexpr, X_PAIRED: tl.constexpr):
    """One K step of `_row_project` from column k (nothing at or past `stop`): the packed words [ROWS, GROUPS,
    words per group], each group's scale [ROWS, GROUPS] in fp32 (MXFP4: 2^(e - 127) from its E8M0 exponent e; FP8:
    its 128 x 128 block's) and the activations: [BLOCK_M, GROUPS, words, pairs, 2 halves] in fp32, or with X_PAIRED
    (MXFP4) the fp16x2 pairs themselves [BLOCK_M, GROUPS, 4 words, 4 pairs] (`_paired_columns`). EVICTION: the
    weights' L2 eviction policy. Masks by whole groups: per-word masks cost Triton 3.6 5% more loop instructions in
    the MXFP4 launches and measured 0.86-0.94x for blocks of 2 on the H200 (session 21)."""
    CODES: tl.constexpr = 8 if FORMAT == 1 else 4  # per 4-byte word
    group = k // 32 + tl.arange(0, GROUPS)
    ok = row_ok[:, None] & (group[None, :] < stop // 32)  # whole groups: K is a multiple of 32
    packed = tl.load(words + rows[:, None, None] * (K // CODES) + (k // CODES + word)[None, :, :], mask=ok[:, :, None],
                     other=0, eviction_policy=EVICTION)
    if FORMAT == 1:
        exponent = tl.load(scales + rows[:, None] * (K // 32) + group[None, :], mask=ok, other=0,
                           eviction_policy=EVICTION).to(tl.int32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)  # e = 0, 2^-127, becomes 0
    else:
        scale = tl.load(scales + (rows // 128)[:, None] * tl.cdiv(K, 128) + (group // 4)[None, :], mask=ok,
                        other=0.0, eviction_policy=EVICTION)
    if X_PAIRED:
        pair_words = (k + word * 8)[:, :, None] // 2 + tl.arange(0, 4)[None, None, :]  # [GROUPS, 4 words, 4 pairs]
        xs = tl.load(x_rows.to(tl.pointer_type(tl.int32))[:, None, None, None] + pair_words[None, :, :, :],
                     mask=(k + word * 8 < stop)[None, :, :, None], other=0)
    else:
        xs = tl.load(x_rows[:, None, None, None, None] + k + offset[None, :, :, :, :],
                     mask=(k + offset < stop)[None, :, :, :, :], other=0.0).to(tl.float32)
    return packed, scale, xs


@triton.jit
def _tma_words(words_tma, tma_rows, k, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, CODES: tl.constexpr,
               TMA_LOADS: tl.constexpr):
    """One K step's packed words [BLOCK_ROWS, BLOCK_K / 32 groups, 32 / CODES words] from column k through
    `words_tma` (zeros past K), CODES codes per word: one tile from row tma_rows[0] (TMA_LOADS 1), or half tiles of
    gate rows from tma_rows[0] and of up rows from tma_rows[1] (TMA_LOADS 2: concatenated gate/up), interleaved
    gate, up, gate, ... as the gated tile orders its rows."""
    if TMA_LOADS == 2:
        gate = words_tma.load([tma_rows[0], k // CODES])
        up = words_tma.load([tma_rows[1], k // CODES])
        tile = tl.reshape(tl.permute(tl.join(gate, up), (0, 2, 1)), (BLOCK_ROWS, BLOCK_K // CODES))
    else:
        tile = words_tma.load([tma_rows[0], k // CODES])
    return tl.reshape(tile, (BLOCK_ROWS, BLOCK_K // 32, 32 // CODES))


@triton.jit
def _exp2i(e):
    """2^e in fp32 for integer e in [-126, 127], built from its exponent bits (exact, no transcendental)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp16_shift(largest, TOP: tl.constexpr = 14):
    """The power of two that puts `largest` (fp32 magnitudes, any shape) in [2^TOP, 2^(TOP + 1)), capped at 100 so
    that 2^shift stays finite in fp32 (an all-zero row: any shift)."""
    return tl.minimum(TOP - ((largest.to(tl.int32, bitcast=True) >> 23) - 127), 100)


@triton.jit
def _paired_columns(columns):
    """Where the gate/up launch stores activation column c for a down launch on the row path (PAIRED_SHIFT): within
    each 8 columns (one packed word's codes), at 4 * bit 0 + 2 * bit 2 + bit 1 of c, so that 32-bit word 4w + i
    holds word w's fp16x2 pair i (K offsets `_row_pairs`()[i] and that + 2)."""
    c = columns % 8
    return columns - c + (c % 2) * 4 + (c // 4) * 2 + (c // 2) % 2


@triton.jit
def _pair_rows_kernel(x, out, shifts, K, BLOCK: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    _wait_for_previous_launch(DEPENDENT_LAUNCH)
    _let_next_launch(DEPENDENT_LAUNCH)  # one program per row: no SMs to crowd
    row = tl.program_id(0).to(tl.int64)
    largest = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        columns = k + tl.arange(0, BLOCK)
        largest = tl.maximum(largest, tl.abs(tl.load(x + row * K + columns, mask=columns < K, other=0.0)))
    shift = _fp16_shift(tl.max(largest))
    scale = _exp2i(shift)
    for k in range(0, K, BLOCK):
        columns = k + tl.arange(0, BLOCK)
        values = tl.load(x + row * K + columns, mask=columns < K, other=0.0).to(tl.float32) * scale
        tl.store(out + row * K + _paired_columns(columns), values, mask=columns < K)  # in out's fp16
    tl.store(shifts + row, shift)


def _pair_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations (K a multiple of 8) -> (fp16 [M, K] in the row path's pair order, `_paired_columns`, each
    row times 2^shift; int32 [M] shifts): the shift puts the row's largest magnitude in [2^14, 2^15), as
    `_row_project` scales rows itself otherwise. One launch, a program per row."""
    rows, k = x.shape
    out = torch.empty(rows, k, dtype=torch.float16, device=x.device)
    shifts = torch.empty(rows, dtype=torch.int32, device=x.device)
    _pair_rows_kernel[(rows,)](x.contiguous(), out, shifts, k, BLOCK=min(1024, triton.next_power_of_2(k)),
                               **_dependent_launch(x.device))
    return out, shifts


@triton.jit
def _row_project(x, pair_rows, data, scales, rows, row_ok, K, k_start, k_stop, words_tma, tma_rows,
                 FORMAT: tl.constexpr, COMPUTE_FP32: tl.constexpr, FP16_OPERANDS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, TMA_LOADS: tl.constexpr,
                 x_shifts, X_PAIRED: tl.constexpr, SCAN: tl.constexpr):
    """[BLOCK_M, BLOCK_ROWS] fp32 = x[pair_rows] @ W[rows]^T over K in [k_start, k_stop) for a few rows of
    activations (BLOCK_M < 16), W MXFP4 or FP8, on the CUDA cores: no tensor-core tile padded to 16 rows, the codes
    decoded to fp16 pairs (`_e2m1_word_pairs`, `_e4m3_word_pairs`) and half an fp16x2 multiply-add per code and row
    of activations (`_E2M1_ROW_ASM`, `_E4M3_ROW_ASM`: one instance per row and 32-code group; the instances of one
    group share its words, so ptxas decodes them once for all rows). Each row of activations goes to fp16 scaled by
    a power of two that puts its largest magnitude in this share of K in [2^14, 2^15) for MXFP4 (whose codes decode
    times 2^-14) or [2^2, 2^3) for FP8 (up to 448: a group's 16 products per half stay under fp16's 65504): no fp16
    overflow, and products too small for fp16's normal range are below 2^-28 of the row's largest. With X_PAIRED
    (MXFP4), x is such fp16 already, each row times 2^x_shifts[row], in the pairs' order (`_paired_columns`;
    `_pair_rows` or the gate/up launch with PAIRED_SHIFT write them so), and each step loads its pairs as words:
    gpt-oss's loop instructions on sm_90 176 -> 141 (one token's down launch), 561 -> 455 and 937 -> 834 (blocks of
    2: down, gate/up). With FP16_OPERANDS an fp16 x is x times FP16_PRESCALE (`_activations`), which the result undoes.
    The packed bytes are read as 4-byte words (8 MXFP4 or 4 FP8 codes): with TMA_LOADS through `words_tma`
    (`_tma_words`, `_words_descriptor`), NUM_STAGES steps ahead into shared memory by the TMA unit, which takes the
    loads' instructions and registers off the warps (1.05x at one token, 1.3x for blocks of 2 rows, session 17);
    otherwise as pointer loads (the 16-byte loads that aligned addressing allows measured 16% slower on the H200 in
    session 14 and 0.98x in session 16, with the words' layout conversions gone)."""
    CODES: tl.constexpr = 8 if FORMAT == 1 else 4  # per 4-byte word
    WORDS: tl.constexpr = 32 // CODES  # per 32-code group
    PAIRS: tl.constexpr = CODES // 2  # fp16x2 pairs per word
    TOP: tl.constexpr = 14 if FORMAT == 1 else 2  # the scaled activations' largest is in [2^TOP, 2^(TOP + 1))
    CODE_EXPONENT: tl.constexpr = 14 if FORMAT == 1 else 0  # the decode's codes are times 2^-CODE_EXPONENT
    GROUPS: tl.constexpr = BLOCK_K // 32
    word = tl.arange(0, GROUPS)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # [GROUPS, WORDS]: the step's words
    pair = _word_pairs(FORMAT)  # [PAIRS, 2 halves]: K offsets in a word
    offset = word[:, :, None, None] * CODES + pair[None, None, :, :]  # [GROUPS, WORDS, PAIRS, 2]: each code's offset
    words = data.to(tl.pointer_type(tl.int32))
    x_rows = x + pair_rows.to(tl.int64) * K  # a block's padding rows read row 0: their results are not stored
    stop = tl.minimum(k_stop, K)
    # One token's launches read each weight once: marked first to leave L2 (1.02-1.03x on the H200, six A/Bs);
    # blocks of 2 may read an expert again for its third pair, and there it measured 0.99-1.01x.
    EVICTION: tl.constexpr = "evict_first" if BLOCK_M == 1 else ""
    # each step's pointer loads are issued one step ahead (the first before the scan below), so a warp has two steps'
    # weights in flight (num_stages=1 measured fastest with them; the TMA loads, issued in the step, pipeline
    # NUM_STAGES deep: the pointer load of words they replace is dead code)
    packed, scale, xs = _row_step_loads(words, scales, x_rows, rows, row_ok, k_start, stop, K, word, offset, FORMAT,
                                        GROUPS, EVICTION, X_PAIRED)
    if X_PAIRED:
        shift = tl.load(x_shifts + pair_rows)
    else:
        largest = tl.zeros((BLOCK_M, SCAN), dtype=tl.float32)
        for k in tl.range(k_start, k_stop, SCAN):  # one round trip for up to 4096 columns: 1.01-1.07x at one token
            columns = k + tl.arange(0, SCAN)
            step = tl.load(x_rows[:, None] + columns[None, :], mask=columns[None, :] < K, other=0.0)
            largest = tl.maximum(largest, tl.abs(step.to(tl.float32)))
        shift = _fp16_shift(tl.max(largest, axis=1), TOP)
    x_scale = _exp2i(shift)[:, None, None, None, None]
    undo = 0  # FP16_PRESCALE's exponent: under FP16_OPERANDS an fp16 x comes times it
    if FP16_OPERANDS:
        if x.dtype.element_ty == tl.float16:
            undo = 8
    unscale = _exp2i(CODE_EXPONENT - shift + undo)[:, None, None]
    acc = tl.zeros((BLOCK_M, BLOCK_ROWS, GROUPS), dtype=tl.float32)
    for k in tl.range(k_start, k_stop, BLOCK_K, num_stages=NUM_STAGES):
        next_packed, next_scale, next_xs = _row_step_loads(words, scales, x_rows, rows, row_ok, k + BLOCK_K, stop, K,
                                                           word, offset, FORMAT, GROUPS, EVICTION, X_PAIRED)
        if TMA_LOADS:
            packed = _tma_words(words_tma, tma_rows, k, BLOCK_ROWS, BLOCK_K, CODES, TMA_LOADS)
        if COMPUTE_FP32:
            bits = (32 // CODES) * pair  # a code's bits: its K offset in the word times its width
            codes = (packed[:, :, :, None, None] >> bits[None, None, None, :, :]) & ((1 << (32 // CODES)) - 1)
            if FORMAT == 1:
                values = _e2m1(codes)
            else:
                values = _e4m3(codes)
            products = values[None, :, :, :, :, :] * xs[:, None, :, :, :, :]
            acc += tl.sum(tl.sum(tl.sum(products, axis=5), axis=4), axis=3) * scale[None, :, :]
        else:  # one asm instance per row and group: words and activation pairs as separate [.., GROUPS] operands
            if X_PAIRED:
                pairs = xs  # [BLOCK_M, GROUPS, 4 words, 4 pairs]
            else:
                halves = (xs * x_scale).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                low, high = tl.split(halves)
                pairs = low | (high << 16)
            shape: tl.constexpr = (BLOCK_M, BLOCK_ROWS, GROUPS, WORDS)
            by_pair = _slices(pairs, PAIRS)  # pair i of every word: [BLOCK_M, GROUPS, WORDS] each
            operands = _broadcast_slices(packed[None, :, :, :], shape)
            for i in tl.static_range(PAIRS):
                operands = operands + _broadcast_slices(by_pair[i][:, None], shape)
            operands = operands + (tl.broadcast_to(scale[None, :, :], acc.shape), tl.broadcast_to(unscale, acc.shape),
                                   acc)
            ROW_ASM: tl.constexpr = _E2M1_ROW_ASM if FORMAT == 1 else _E4M3_ROW_ASM
            CONSTRAINTS: tl.constexpr = _E2M1_ROW_CONSTRAINTS if FORMAT == 1 else _E4M3_ROW_CONSTRAINTS
            acc = tl.inline_asm_elementwise(ROW_ASM, CONSTRAINTS, operands, dtype=tl.float32, is_pure=True, pack=1)
        packed, scale, xs = next_packed, next_scale, next_xs
    return tl.sum(acc, axis=2)


@triton.jit
def _dense_row_step(x_rows, w_rows, row_ok, k, stop, column_stride, BLOCK_K: tl.constexpr, EVICTION: tl.constexpr):
    """One K step of `_dense_row_project`: x [BLOCK_M, 1, BLOCK_K] and W [1, BLOCK_ROWS, BLOCK_K] (zeros past K)."""
    columns = k + tl.arange(0, BLOCK_K)[None, None, :]
    in_k = columns < stop
    w = tl.load(w_rows + columns * column_stride, mask=row_ok & in_k, other=0.0, eviction_policy=EVICTION)
    return tl.load(x_rows + columns, mask=in_k, other=0.0), w


@triton.jit
def _dense_row_project(x, pair_rows, data, rows, row_ok, K, k_start, k_stop, row_stride, column_stride,
                       BLOCK_M: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_ROWS] fp32 = x[pair_rows] @ W[rows]^T over K in [k_start, k_stop) for a few rows of
    activations (BLOCK_M < 16) times 16-bit (dense) weights on the CUDA cores: a tensor-core tile would pad each
    block to 16 rows, and a decode's few rows only need the weights streamed. Each step multiplies and adds into a
    [BLOCK_M, BLOCK_ROWS, BLOCK_K] fp32 accumulator, summed over K once at the end, and its loads are issued one
    step ahead (two steps' weights in flight per warp)."""
    x_rows = x + pair_rows.to(tl.int64)[:, None, None] * K
    w_rows = data + rows.to(tl.int64)[None, :, None] * row_stride
    row_ok = row_ok[None, :, None]
    stop = tl.minimum(k_stop, K)
    EVICTION: tl.constexpr = "evict_first" if BLOCK_M == 1 else ""  # one token reads each weight once
    xs, w = _dense_row_step(x_rows, w_rows, row_ok, k_start, stop, column_stride, BLOCK_K, EVICTION)
    acc = tl.zeros((BLOCK_M, BLOCK_ROWS, BLOCK_K), dtype=tl.float32)
    for k in tl.range(k_start, k_stop, BLOCK_K):
        next_xs, next_w = _dense_row_step(x_rows, w_rows, row_ok, k + BLOCK_K, stop, column_stride, BLOCK_K,
                                          EVICTION)
        acc += xs.to(tl.float32) * w.to(tl.float32)
        xs, w = next_xs, next_w
    return tl.sum(acc, axis=2)


@triton.jit
def _fp8_tile(data, rows, row_ok, columns, K, COMPUTE_FP32: tl.constexpr, FP16_OPERANDS: tl.constexpr):
    """[BLOCK_ROWS, BLOCK_K] float8_e4m3fn weight values, unscaled: the hardware conversion on the GPU (to fp16 or
    bf16), arithmetic decoding in the fp32 path (the interpreter's fp8 casts are unreliable). One return: Triton 3.6
    compiles the statements after a constexpr branch's return too, and two returns of different dtypes fail there."""
    byte = tl.load(data + rows[:, None] * K + columns[None, :], mask=row_ok[:, None] & (columns[None, :] < K),
                   other=0)
    if COMPUTE_FP32:
        tile = _e4m3(byte.to(tl.int32))
    elif FP16_OPERANDS:
        tile = byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        tile = byte.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    return tile


@triton.jit
def _dot(x_tile, w_tile, COMPUTE_FP32: tl.constexpr, FP16_OPERANDS: tl.constexpr = False):
    """x [BLOCK_M, k] @ w [BLOCK_ROWS, k]^T into fp32 on the tensor cores, fp32, fp16 or bf16 operands."""
    if COMPUTE_FP32:
        product = tl.dot(x_tile.to(tl.float32), tl.trans(w_tile.to(tl.float32)), input_precision="ieee")
    elif FP16_OPERANDS:
        product = tl.dot(x_tile, tl.trans(w_tile))
    else:
        product = tl.dot(x_tile.to(tl.bfloat16), tl.trans(w_tile.to(tl.bfloat16)))
    return product


@triton.jit
def _tile_project(x, data, scales, rows, row_ok, pair_rows, pair_ok, K, k_start, k_stop, row_stride, column_stride,
                  FORMAT: tl.constexpr, COMPUTE_FP32: tl.constexpr, FP16_OPERANDS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """`_project` on the tensor cores: BLOCK_M rows of activations, any weight format."""
    acc = tl.zeros((BLOCK_M, BLOCK_ROWS), dtype=tl.float32)
    x_rows = x + pair_rows[:, None].to(tl.int64) * K
    for k in tl.range(k_start, k_stop, BLOCK_K, num_stages=NUM_STAGES):
        columns = k + tl.arange(0, BLOCK_K)
        x_tile = tl.load(x_rows + columns[None, :], mask=pair_ok[:, None] & (columns[None, :] < K), other=0.0)
        if FORMAT == 1:
            acc += _dot(x_tile, _mxfp4_tile(data, scales, rows, row_ok, k, K, COMPUTE_FP32, BLOCK_K), COMPUTE_FP32)
        elif FORMAT == 2:  # BLOCK_K divides 128, so the tile lies in one 128-column scale block: scale per row
            row_scale = tl.load(scales + (rows // 128) * ((K + 127) // 128) + k // 128, mask=row_ok, other=0.0)
            if FP16_OPERANDS:  # undoes the activations' prescale with the block scale
                row_scale = row_scale / FP16_PRESCALE
                if x.dtype.element_ty != tl.float16:  # one token's activations come unscaled (`_activations`)
                    x_tile = (x_tile.to(tl.float32) * FP16_PRESCALE).to(tl.float16)
            acc += _dot(x_tile, _fp8_tile(data, rows, row_ok, columns, K, COMPUTE_FP32, FP16_OPERANDS),
                        COMPUTE_FP32, FP16_OPERANDS) * row_scale[None, :]
        else:
            w_tile = tl.load(data + rows[:, None] * row_stride + columns[None, :] * column_stride,
                             mask=row_ok[:, None] & (columns[None, :] < K), other=0.0)
            acc += _dot(x_tile, w_tile, COMPUTE_FP32)
    return acc


@triton.jit
def _project(x, data, scales, rows, row_ok, pair_rows, pair_ok, K, k_start, k_stop, row_stride, column_stride,
             words_tma, tma_rows, FORMAT: tl.constexpr, COMPUTE_FP32: tl.constexpr, FP16_OPERANDS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
             TMA_LOADS: tl.constexpr, x_shifts, X_PAIRED: tl.constexpr, SCAN: tl.constexpr):
    """[BLOCK_M, BLOCK_ROWS] fp32 = x[pair_rows] @ W[rows]^T over K in [k_start, k_stop), W the expert at `data` /
    `scales` (dense weights at any row / column strides, e.g. a transposed view of [E, in, out] parameters): on the
    tensor cores, or for a few rows of activations (BLOCK_M < 16) on the CUDA cores."""
    if FORMAT == 0 and BLOCK_M < 16:
        acc = _dense_row_project(x, pair_rows, data, rows, row_ok, K, k_start, k_stop, row_stride, column_stride,
                                 BLOCK_M, BLOCK_ROWS, BLOCK_K)
    elif BLOCK_M < 16:
        acc = _row_project(x, pair_rows, data, scales, rows, row_ok, K, k_start, k_stop, words_tma, tma_rows, FORMAT,
                           COMPUTE_FP32, FP16_OPERANDS, BLOCK_M, BLOCK_ROWS, BLOCK_K, NUM_STAGES, TMA_LOADS, x_shifts,
                           X_PAIRED, SCAN)
    else:
        acc = _tile_project(x, data, scales, rows, row_ok, pair_rows, pair_ok, K, k_start, k_stop, row_stride,
                            column_stride, FORMAT, COMPUTE_FP32, FP16_OPERANDS, BLOCK_M, BLOCK_ROWS, BLOCK_K,
                            NUM_STAGES)
    return acc


@triton.jit
def _first_split_bias(bias, rows, ok, split):
    """The bias at `rows` in fp32 for the first K split, zeros for the others: added once to the splits' sum."""
    return tl.where(split == 0, tl.load(bias + rows, mask=ok, other=0.0).to(tl.float32), 0.0)


@triton.jit
def _moe_gemm_kernel(
    x, data, scales, bias, out, pair_ids, block_expert, pair_weights, host_data, host_scales, host_bias, slot_of,
    words_tma, x_shifts, out_shifts, summed, arrivals,
    P, N, K, N_OUT, ROW_DIV, alpha, limit, data_stride, scales_stride, bias_stride, row_stride, column_stride, k_split,
    FORMAT: tl.constexpr, GATED: tl.constexpr, ACTIVATE: tl.constexpr, INTERLEAVED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr, APPLY_WEIGHT: tl.constexpr, COMPUTE_FP32: tl.constexpr, FP16_OPERANDS: tl.constexpr,
    HOST_FALLBACK: tl.constexpr, BLOCKING: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, TMA_LOADS: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr, X_PAIRED: tl.constexpr, PAIRED_SHIFT: tl.constexpr, SCAN: tl.constexpr,
    SUM_TOP_K: tl.constexpr,
):
    _wait_for_previous_launch(DEPENDENT_LAUNCH)
    block = tl.program_id(0)
    if BLOCKING == 2:  # ROWS_IN_ORDER: the one expert
        expert = tl.full((), 0, tl.int32)
    else:
        expert = tl.load(block_expert + block)
        if expert < 0:
            return
    row = expert.to(tl.int64)  # the expert's weights: strided, so slot pools (offload) serve as well
    if HOST_FALLBACK:  # the pool row of the expert's slot, or its host blob when it has none
        slot = tl.load(slot_of + expert).to(tl.int64)
        on_host = slot < 0
        row = tl.where(on_host, row, slot)
        data = tl.where(on_host, host_data, data)
        scales = tl.where(on_host, host_scales, scales)
        bias = tl.where(on_host, host_bias, bias)
    data += row * data_stride
    scales += row * scales_stride
    bias += row * bias_stride
    if BLOCKING == 1:  # PAIR_PER_BLOCK
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, block, P)
    elif BLOCKING == 2:  # ROWS_IN_ORDER
        pairs = block * BLOCK_M + tl.arange(0, BLOCK_M)
    else:
        pairs = tl.load(pair_ids + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < P
    pair_rows = tl.where(pair_ok, pairs // ROW_DIV, 0)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    column_ok = columns < N_OUT
    # this program's weight rows in `words_tma`, which spans every expert's rows: the first of its tile, or with
    # concatenated gate/up rows the first gate row and the first up row (`_tma_words`)
    first_row = (row * N + tl.program_id(1) * BLOCK_N * (2 if GATED and INTERLEAVED else 1)).to(tl.int32)
    tma_rows = (first_row, first_row + N_OUT)
    split = tl.program_id(2)  # this program's share of K: [k_start, k_stop), the whole of it without splits
    k_start = split * k_split
    k_stop = tl.minimum(k_start + k_split, tl.cdiv(K, BLOCK_K) * BLOCK_K)
    if GATED:
        # Output column j needs weight rows gate(j) and up(j): one tile of 2 * BLOCK_N rows ordered gate, up, gate,
        # up, ... (contiguous when the checkpoint interleaves them), so one K loop has both in flight.
        r = tl.arange(0, 2 * BLOCK_N)
        column = tl.program_id(1) * BLOCK_N + r // 2
        if INTERLEAVED:
            rows = 2 * column + r % 2
        else:
            rows = column + (r % 2) * N_OUT
        row_ok = column < N_OUT
        rows = tl.where(row_ok, rows, 0)
        both = _project(x, data, scales, rows, row_ok, pair_rows, pair_ok, K, k_start, k_stop, row_stride,
                        column_stride, words_tma, tma_rows, FORMAT, COMPUTE_FP32, FP16_OPERANDS, BLOCK_M,
                        2 * BLOCK_N, BLOCK_K, NUM_STAGES, TMA_LOADS, x_shifts, X_PAIRED, SCAN)
        if HAS_BIAS:
            both += _first_split_bias(bias, rows, row_ok, split)[None, :]
        if SPLIT_K > 1:  # this split's partial sums, gate and up interleaved; `_finish_gate_up` adds and activates
            result, out_width = both, 2 * N_OUT
            columns, column_ok = 2 * tl.program_id(1) * BLOCK_N + r, row_ok
        else:
            gate, up = tl.split(tl.reshape(both, (BLOCK_M, BLOCK_N, 2)))
            result, out_width = _activate(gate, up, ACTIVATION, alpha, limit), N_OUT
    else:
        rows = tl.where(column_ok, columns, 0)
        result = _project(x, data, scales, rows, column_ok, pair_rows, pair_ok, K, k_start, k_stop, row_stride,
                          column_stride, words_tma, tma_rows, FORMAT, COMPUTE_FP32, FP16_OPERANDS, BLOCK_M, BLOCK_N,
                          BLOCK_K, NUM_STAGES, TMA_LOADS, x_shifts, X_PAIRED, SCAN)
        out_width = N_OUT
        if HAS_BIAS:
            result += _first_split_bias(bias, rows, column_ok, split)[None, :]
        if ACTIVATE:  # experts without a gate: the activation of up alone (unsplit)
            result = _activate(result, result, ACTIVATION, alpha, limit)
    if ACTIVATE and SPLIT_K == 1:  # the down launch's activations
        if FP16_OPERANDS:
            result = result * FP16_PRESCALE
        if PAIRED_SHIFT:  # as the down launch's row path reads them (X_PAIRED)
            result = result * (2.0**PAIRED_SHIFT)
            columns = _paired_columns(columns)
            tl.store(out_shifts + pairs, tl.full(pairs.shape, PAIRED_SHIFT, tl.int32),
                     mask=pair_ok & (tl.program_id(1) == 0))
    _let_next_launch(DEPENDENT_LAUNCH)
    if APPLY_WEIGHT:
        result *= tl.load(pair_weights + pairs, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    out_rows = split * P + pairs[:, None].to(tl.int64)  # split 0 alone without splits
    tl.store(out + out_rows * out_width + columns[None, :], result, mask=pair_ok[:, None] & column_ok[None, :])
    if SUM_TOP_K:  # each token's pairs and shares added here, not by `_sum_pairs`
        _sum_when_last(out, summed, arrivals, pairs, pair_ok, columns, column_ok, P, out_width, SUM_TOP_K, SPLIT_K)


def _strides(weight: PackedWeight) -> tuple[int, ...]:
    """Elements between consecutive experts of data, scales and bias (any expert-major layout, e.g. slot pools),
    then between rows and columns of dense data (packed formats keep rows contiguous)."""
    experts = tuple(t.stride(0) if t is not None else 0 for t in (weight.data, weight.scales, weight.bias))
    dense = weight.format == "dense"
    return *experts, weight.data.stride(1) if dense else weight.shape[2], weight.data.stride(2) if dense else 1


def _launch(x, weight: PackedWeight, blocks: Blocks, pair_weights, rows_out, n_out, row_div, *, gated, interleaved,
            activation, alpha, limit, compute_fp32, block_m, block_n, block_k, num_warps, num_stages, splits=1,
            operands="bf16", weight_loads="pointers", host: PackedWeight | None = None,
            slot_of: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
            x_shifts: torch.Tensor | None = None, paired_shift: int = 0, out_shifts: torch.Tensor | None = None,
            sum_top_k: int = 0):
    """One GEMM launch over `blocks`; with fp16 operands `x` is fp16 times FP16_PRESCALE (`_activations`) or in its
    own dtype, scaled in the kernel; with `slot_of`, `weight` is a slot pool and `host` the same weight over the host
    blobs. The output: the first launch's (gate/up, or up alone for an activation in UNGATED_ACTIVATIONS) unsplit in
    the down launch's operand dtype, otherwise `out_dtype`. With `splits` > 1 each program takes one of that many
    shares of K and the launch returns [splits, rows_out, width] fp32 partial sums (gate/up: both projections,
    interleaved), for `_finish_gate_up` or `_sum_pairs` to add. `x_shifts`: x is
    fp16 pairs (`_pair_rows`), row r times 2^x_shifts[r] (X_PAIRED); `paired_shift`: a gate/up launch writes its
    output so, times 2^paired_shift, with `out_shifts` [rows_out] the shifts (PAIRED_SHIFT). `sum_top_k`: the
    rows are tokens' consecutive pairs, this many each, and the launch returns each token's sum over its pairs and
    splits [rows_out / sum_top_k, n_out] in `out_dtype`, added in the launch (`_sum_when_last`) where blocks are
    not grouped by expert (one token, dense rows), else by `_sum_pairs`. On the H200 (session 24) the in-launch sum
    took one token's call 1.02-1.05x faster (gpt-oss-20b 29.0 -> 27.6 us, Qwen3-30B-A3B-FP8 18.5 -> 17.8) and cost
    M = 16's grouped blocks 0.98-1.01x (there the sums fall to the launch's last programs)."""
    _, n, k = weight.shape
    activates = gated or activation in UNGATED_ACTIVATIONS  # the first launch: its output is the down launch's x
    fp16_operands = _fp16_operands(operands, compute_fp32)
    summed, arrivals = None, None
    if sum_top_k:
        tokens = rows_out // sum_top_k
        if blocks.blocking != GROUPED:
            arrivals = arrival_counts(x.device, tokens * triton.cdiv(n_out, block_n))
        summed = torch.empty(tokens, n_out, dtype=out_dtype, device=x.device) if arrivals is not None else None
        sum_dtype, out_dtype = out_dtype, torch.float32
    if splits > 1:
        out_dtype = torch.float32
    elif activates:
        out_dtype = torch.float16 if paired_shift else _gate_up_dtype(x.dtype, compute_fp32, fp16_operands)
    out = torch.empty(splits, rows_out, 2 * n_out if gated and splits > 1 else n_out, dtype=out_dtype, device=x.device)
    k_split = triton.cdiv(triton.cdiv(k, block_k), splits) * block_k
    grid = (blocks.count, triton.cdiv(n_out, block_n), splits)
    words_tma, tma_loads = None, 0
    if weight_loads == "tma":
        tma_loads, tile_rows = tma_tile(gated, interleaved, block_n)
        words_tma = _words_descriptor(weight, tile_rows, block_k)
    pointer = lambda t: t if t is not None else out  # noqa: E731  (any tensor stands in for an absent pointer)
    weight_pointers = lambda w: [pointer(part) for part in (w.data, w.scales, w.bias)]  # noqa: E731
    _moe_gemm_kernel[grid](
        x, *weight_pointers(weight), out, pointer(blocks.pair_ids), pointer(blocks.block_expert),
        pointer(pair_weights), *weight_pointers(host if host is not None else weight), pointer(slot_of), words_tma,
        pointer(x_shifts), pointer(out_shifts), pointer(summed), pointer(arrivals),
        rows_out, n, k, n_out, row_div, float(alpha), float(limit), *_strides(weight), k_split,
        FORMAT=FORMATS[weight.format], GATED=gated, ACTIVATE=activates, INTERLEAVED=interleaved,
        ACTIVATION=ACTIVATIONS[activation],
        HAS_BIAS=weight.bias is not None, APPLY_WEIGHT=pair_weights is not None, COMPUTE_FP32=compute_fp32,
        FP16_OPERANDS=fp16_operands, HOST_FALLBACK=slot_of is not None, BLOCKING=blocks.blocking,
        SPLIT_K=splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        TMA_LOADS=tma_loads, X_PAIRED=x_shifts is not None, PAIRED_SHIFT=paired_shift, SCAN=_scan_width(k_split),
        SUM_TOP_K=sum_top_k if summed is not None else 0, num_warps=num_warps,
        **_dependent_launch(x.device),
    )
    if sum_top_k:
        return summed if summed is not None else _sum_pairs(out.view(splits, tokens, sum_top_k, n_out), sum_dtype)
    return out if splits > 1 else out[0]


def _scan_width(k_split: int) -> int:
    """SCAN: columns per step of the row path's scan of its activations' largest magnitude (`_row_project`), the
    whole share of K up to 4096 in one step: each step is a round trip before the first weights are asked for."""
    return min(4096, triton.next_power_of_2(k_split))


def tma_tile(gated: bool, interleaved: bool, block_n: int) -> tuple[int, int]:
    """(TMA_LOADS, rows of one descriptor tile) for a launch reading its weight words by TMA (`_tma_words`): one
    tile of the program's rows (2 * block_n interleaved gate/up rows, or block_n rows), or for concatenated gate/up
    rows two half tiles of block_n gate and block_n up rows."""
    if gated and not interleaved:
        return 2, block_n
    return 1, 2 * block_n if gated else block_n


def _words_descriptor(weight: PackedWeight, block_rows: int, block_k: int) -> TensorDescriptor:
    """A TMA descriptor over every expert's packed rows (MXFP4 or FP8) as 4-byte words ([E * N, K / codes per
    word]; the rows must be whole 16-byte units, as TMA needs: `_tma_blocker`), in tiles of `block_rows` rows by one
    K step, for `_row_project` (`weight_loads="tma"`)."""
    experts, n, k = weight.shape
    words = weight.data.reshape(experts * n, -1).view(torch.int32)
    return TensorDescriptor(words, list(words.shape), [words.shape[1], 1],
                            [block_rows, block_k * words.shape[1] // k])


def _row_bytes(weight: PackedWeight) -> int:
    """Bytes of one packed weight row (K / 2 for MXFP4, K for FP8)."""
    return weight.data[0, 0].numel() * weight.data.element_size()


def _row_blocker(*weights: PackedWeight) -> str | None:
    """Why the CUDA-core path (block_m < 16) cannot read these weights, or None when it can: it reads packed rows in
    whole 32-code groups (MXFP4's K always is; FP8 needs K a multiple of 32) and dense rows along K, contiguous.
    Dense weights otherwise keep the tensor-core tiles, as measured: a transposed view (gpt-oss's [E, in, out] bf16
    experts) is not measured on that path. Offloaded experts take the path the resident ones take, so both compute
    a decode token with the same kernel: the same bits (its speed on experts read from the host is not measured
    yet, session 53)."""
    if not all(w.format == "dense" or w.shape[2] % 32 == 0 for w in weights):
        return ("the CUDA-core path reads weight rows in whole 32-code groups, and these rows are not (FP8: K a "
                "multiple of 32)")
    if not all(w.format != "dense" or w.data.stride(2) == 1 for w in weights):
        return "the CUDA-core path reads dense weight rows contiguous along K, and these are strided (transposed)"
    return None


def _tma_blocker(gate_up: PackedWeight, down: PackedWeight, compute_fp32: bool, host: tuple | None) -> str | None:
    """Why an MoE call (or, with gate_up = down, a dense layer) cannot read its weight words through TMA
    descriptors (`weight_loads="tma"`), or None when it can."""
    weights = (gate_up, down)
    if "tma" not in ROW_TILES.get(gate_up.format, {}):
        with_tma = sorted(format for format, by_loads in ROW_TILES.items() if "tma" in by_loads)
        return f"only {with_tma} weights have a TMA path, these are {gate_up.format}"
    if not all(_row_bytes(w) % 16 == 0 for w in weights):
        return f"TMA needs weight rows of whole 16-byte units, these have {[_row_bytes(w) for w in weights]} bytes"
    if compute_fp32:
        return "the fp32 compute path (the interpreter's) reads through pointers"
    if not all(_hopper_or_newer(w.data.device) for w in weights):
        return "TMA needs the weights on a Hopper or newer GPU (compute capability 9.0+)"
    if host is not None:
        return "offloaded experts are read from host memory through pointers"
    if not all(w.data.is_contiguous() and w.data.data_ptr() % 16 == 0 for w in weights):
        return "TMA needs each weight's experts contiguous, one after another, at a 16-byte aligned address"
    return None


def fused_blocker(format: str, device: torch.device, compute_fp32: bool = False) -> str | None:
    """Why the fused kernels cannot run `format` weights on `device`, or None where they can: FP8 outside the fp32
    path (the interpreter's, or fp32 activations, which decode arithmetically) needs the hardware's e4m3
    conversions, compute capability 8.9 or newer (Ada, Hopper): Triton's float8e4nv and the row path's
    cvt.rn.f16x2.e4m3x2 do not compile for sm_80 / sm_86."""
    if format != "fp8_block" or compute_fp32 or device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability >= (8, 9):
        return None
    return (f"FP8 weights need the e4m3 conversions of a GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}")


def _weight_loads(tiles: dict, blocker: str | None) -> str:
    """The call's weight loads: "tma" unless `blocker` says why not, or the `weight_loads` tile asked for; asking
    for "tma" where it cannot run is an error naming why."""
    asked = tiles.get("weight_loads")
    if asked is not None:
        _check_weight_loads(asked)
    if asked == "tma" and blocker:
        raise ValueError(f"weight_loads='tma' cannot be used here: {blocker}; use weight_loads='pointers'")
    return asked or ("pointers" if blocker else "tma")


def _paired_activations(tokens: int, splits: int, activation: str, alpha: float, limit: float) -> tuple[bool, int]:
    """For a call on the MXFP4 row path on the GPU: whether its gate/up launch takes `_pair_rows`' activations
    (blocks of rows; one token's row is scaled in the kernel instead, where the extra launch cost more than it saved,
    0.95-0.98x on the H200), and PAIRED_SHIFT for the down launch's (0 with K splits: `_finish_gate_up` writes
    those)."""
    return tokens > 1, _paired_shift(activation, alpha, limit) if splits == 1 else 0


def _paired_shift(activation: str, alpha: float, limit: float) -> int:
    """PAIRED_SHIFT for the activations between a call's launches on the MXFP4 row path: with clamped SwiGLU, whose
    outputs are at most (limit + 1) * max(limit, 0.28 / alpha) in magnitude, the power of two that puts that bound
    in [2^14, 2^15); 0 (off: each down program scales its bf16 rows itself) for SiLU and GELU, whose outputs have no
    bound."""
    if activation != "clamped_swiglu":
        return 0
    return max(0, 14 - math.floor(math.log2((limit + 1) * max(limit, 0.28 / alpha))))


def _fp16_operands(operands: str, compute_fp32: bool) -> bool:
    """Whether a launch takes fp16 operands (FP16_OPERANDS): asked for, and not the fp32 path."""
    return operands == "fp16" and not compute_fp32


def _gate_up_dtype(x_dtype: torch.dtype, compute_fp32: bool, fp16_operands: bool) -> torch.dtype:
    """The gate/up output's dtype, i.e. the down launch's x: fp32 on the fp32 path, else prescaled fp16 with fp16
    operands, else the activations' dtype."""
    if compute_fp32:
        return torch.float32
    return torch.float16 if fp16_operands else x_dtype


def _splits(split_k: int, blocks: Blocks) -> int:
    """K splits for an MoE call's launch from the tile `split_k`: only a single token's launches split
    (PAIR_PER_BLOCK), whose grids of top-k x column tiles leave SMs idle; larger calls fill the GPU already."""
    return split_k if blocks.blocking == PAIR_PER_BLOCK else 1


_WARPS_PER_SM = 64  # resident on one SM at once (sm_80 and newer): a launch's first wave


def _filling_splits(programs: int, k_steps: int, sms: int | None, share_steps: tuple[int, int, int],
                    num_warps: int) -> int:
    """Shares of K for a dense layer's launch of `programs` column tiles on a GPU of `sms` SMs: enough for the
    programs per SM of `share_steps` (fewest, most, per SM: `_share_steps`; DeepSeek-V3's q_a_proj has 24 output
    tiles over a 7168-long K) and for at most its most K steps per share (a long K is better read by more, shorter
    programs: o_proj, the dense MLP), each share keeping at least its fewest unless that leaves SMs without a program
    (a router's one to four tiles: shares of one step), and no more programs than the SMs hold at once
    (_WARPS_PER_SM): a second wave's few programs would finish alone (DeepSeek-V3's dense down_proj at one bf16 row,
    224 column tiles: 5 shares 75.4 us, 4 shares 67.1; session 50). From bench/packed_linear.py's sweeps on the H200
    (docs/benchmarks.md). One share without SMs (the interpreter)."""
    if sms is None:
        return 1
    fewest, most, per_sm = share_steps
    if programs * (k_steps // fewest) < sms:
        fewest = 1
    filling = max(per_sm * sms // programs, -(-k_steps // most))
    return max(1, min(k_steps // fewest, filling, _WARPS_PER_SM // num_warps * sms // programs))


def _share_steps(format: str, block_m: int, block_n: int) -> tuple[int, int, int]:
    """K steps per share at least and at most, and programs per SM, in a dense layer's launch (`_filling_splits`),
    from bench/packed_linear.py on the H200. Two programs per SM, but four on bf16's row path (DENSE_ROW_TILES), in
    shares of 4 to 32 steps there. Its shares once kept to at most 4 steps (session 46: Qwen3-30B-A3B's o_proj in 8
    shares 6.8 us against 8.1 in 4 and 8.9 in 16, gpt-oss-20b's in 8 10.6 against 10.0 in 4), which split
    DeepSeek-V3's o_proj and dense down_proj into 32 and 36 shares, 76.1 and 91.2 us against 59.8 and 67.1 in 4
    and cuBLAS's 59.6 and 67.5; four programs per SM in shares of at least 4 steps: gpt-oss-20b's o_proj in 5
    shares 9.4 us, DeepSeek-V3's q_a_proj in 11 8.4 (10.3 in 14), kv_a_proj_with_mqa in 14 5.5 (6.4 in 29; session
    50); the routers in shares of one step (session 46, Qwen3-30B-A3B's 16 2.5 us against 3.1 in 8, gpt-oss-20b's 23
    2.6 against 3.4). At most 16 steps on the tensor cores (steps of 128, session 13), 32 there with 128-column
    tiles (`_dense_tiles`: at 8-16 rows DeepSeek-V3's o_proj in 4 shares of 32 steps 37.0-38.1 us against 42.9-43.3
    on 64 columns in 8 or 16, session 25) and on MXFP4's row path (steps of 256: its decode-bound programs gain from
    more of them; 40 there lost 0.87-0.96x on DeepSeek-V3's o_proj and dense MLP shapes); 40 on FP8's row path
    (o_proj and dense down_proj at one row 33.5 and 38.2 us in 2 shares against 40.1 and 44.1 in 4, dense gate_proj
    35.4 in one against 41.6 in 2; session 22; two rows within 3% of the best share count on 7 of 9 shapes, session
    23)."""
    if format == "fp8_block" and block_m < 16:
        return 2, 40, 2
    if format == "dense" and block_m < 16:
        return 4, 32, 4
    return 2, 32 if block_m >= 16 and block_n >= 128 else 16, 2


def _dense_tiles(rows: int, n: int) -> dict:
    """Rows and output columns per program of an FP8 dense layer's tensor-core launch (3+ rows) by its rows and
    output width, from bench/packed_linear.py's sweeps on the H200 (session 25): up to 16 rows, 32 columns for a
    narrow layer (DeepSeek-V3's kv_a_proj_with_mqa, 576: more column tiles beside fewer K shares, 1.13-1.23x) and
    TILES' 64 otherwise (128 measured 0.95-1.15x there); up to 64 rows, 128 columns from 4096 up (fewer programs
    reading K in longer shares, `_share_steps`: 1.13-1.26x at 64 rows); above, blocks of 64 rows as well
    (each weight tile read by a quarter as many programs: 1.12-1.38x at 256 rows, where without tiles given the
    layer is now dequantized instead, DEQUANTIZE_ROWS), in TILES' K steps in flight (as measured; an MoE call's blocks
    of 32+ rows take WIDE_TILES' fewer)."""
    if rows <= 16:
        return {"block_n": 32 if n <= 1024 else 64}
    tiles = {"block_n": 128 if n >= 4096 else 64}
    return tiles | {"block_m": 64, "num_stages": TILES["fp8_block"]["num_stages"]} if rows > 64 else tiles


def _activations(x: torch.Tensor, settings: dict) -> torch.Tensor:
    """The activations as the kernel takes them: with fp16 operands x times FP16_PRESCALE in fp16, in one pass (the
    scaling is exact: a power of two); otherwise contiguous as they are. A single token's row is scaled inside the
    gate/up kernel instead (cheaper than a launch at decode; for a block of rows the kernel's own scaling adds 21% to
    the FP8 gate/up K loop, 357 -> 432 instructions on sm_90, so more rows take the launch), as are the rows of the
    CUDA-core path (block_m < 16, which scales them to fp16 its own way), unless they are fp16 already: the kernel
    takes fp16 activations as prescaled ones."""
    prescaled_in_kernel = (x.shape[0] == 1 or settings["block_m"] < 16) and x.dtype != torch.float16
    if not prescaled_in_kernel and _fp16_operands(settings.get("operands", "bf16"), settings["compute_fp32"]):
        return torch.mul(x, FP16_PRESCALE.value, out=torch.empty(x.shape, dtype=torch.float16, device=x.device))
    return x.contiguous()


# Tiles per weight format (one config each: the interpreter cannot autotune), from `bench/moe_kernels.py`'s sweep on
# the H200 (docs/benchmarks.md). block_m: pairs per block (tensor-core tiles: >= 16); block_n: output columns per
# program; block_k: K per step (FP8: a divisor of its 128-column scale block); num_stages: K steps in flight;
# operands (FP8): "bf16" or "fp16" tensor-core operands (see FP16_OPERANDS); split_k: shares of K for one token's
# launches (see `_splits`), > 1 adds a launch that sums the gate/up shares and activates them.
# (CUDA-core tiles of 1-4 pairs with MXFP4 decoded by fp32 bit construction measured 2-10x slower in session 4; the
# CUDA-core path for blocks of 1-2 rows with the fp16 PTX decode has tiles of its own: ROW_TILES.)
_COMMON = {"block_m": 16, "block_n": 32, "num_warps": 4, "split_k": 1}
TILES = {
    "mxfp4": _COMMON | {"block_n": 64, "block_k": 128, "num_stages": 4},
    "fp8_block": _COMMON | {"block_n": 64, "block_k": 128, "num_stages": 4, "operands": "fp16"},
    "dense": _COMMON | {"block_k": 64, "num_stages": 3},
}


# Tiles of launches with blocks of fewer than 16 rows where `_project` has a CUDA-core path: MXFP4 and FP8
# (`_row_project`), by how the weight words are read (weight_loads: "tma" descriptors or "pointers", see
# `_tma_blocker`), then by rows per block (more rows than the largest key: its tiles). The other settings mean what
# they mean in TILES. From `bench/moe_kernels.py` on the H200 (docs/benchmarks.md). Pointer loads: for one row
# (session 14, `--one-token-only`), 16 columns on 2 warps over the whole K (no split, so no launch to add shares)
# beat 32-64 columns, 4-8 warps, 128/512-wide steps and 2-3 shares by 4-30%; for two (session 15, `--tiles
# block_m=2 ...`), 32 columns on 4 warps (the same rows per warp; each step's activations converted once for twice
# the rows) beat 16 on 2 by 4-9%, and 128-wide steps, or 4 warps on 16 columns, by 7-17%. TMA (session 17): one
# row, 32 columns on 8 warps, 3 stages beat 16-64 columns on 1-8 warps, 2-6 stages and 128-wide steps by 3-20%;
# two rows, 64 columns on 4 warps, 3 stages beat 16-128 columns on 2-8 warps, 2-4 stages, and blocks of 4 or 8
# rows, by 12-60%. FP8 (session 21, Qwen3-30B-A3B-FP8; operands "fp16" as in TILES: the gate/up launch writes the
# down launch's x as prescaled fp16): one row, 32 columns on 4 warps, 256-wide steps, 3 stages (18.1-18.8 us) beat
# 16-64 columns on 2-8 warps, 128-1024-wide steps and 2-4 stages (18.7-35.0 us) and 2-3 shares (20.5, 23.4); two
# rows (up to 1.4 pairs per routed expert, `rows_per_block`), 128 columns on 4 warps, 128-wide steps beat
# 32-64 columns on 2-8 warps. FP8 pointer loads (session 24, `bench/pointer_rows.py`: GPUs without TMA, offload's
# host fallback): one row, 16 columns on 4 warps, 256-wide steps (19.6 us) beat 8-64 columns on 1-4 warps and
# 128-wide steps (20.6-381 us; MXFP4's bytes per step, the earlier tiles, 23.2) and the tensor cores (20.1 us); two
# rows (only by a block_m override: the tensor cores win, `PAIRS_PER_EXPERT_ON_CUDA_CORES`), 64 columns on 4 warps,
# 128-wide steps (M = 4 / 8: 63.4 / 109.7 us) beat the earlier 32 columns (77.5 / 114.6). One token's down launch
# apart (session 22, `--down-sweep`, tile "down_launch"): MXFP4's on 16 columns and 2 warps took the gpt-oss-20b
# call from 29.4 to 27.4 us in the sweep (32 columns on 2 warps or 64 on 4, both in 2 shares, tied) and measured
# 1.09x / 1.06x (20b / 120b) against its gate/up tiles; FP8's gained nothing beyond the noise (18.4-18.5 against
# 18.9 us), so it keeps them. Dense (bf16) weights at one row (session 44, `--sweep`, Qwen3-30B-A3B and
# Mixtral-8x7B experts): 16 columns on 8 warps, 128-wide steps (24.4 / 177.3 us) beat 8-64 columns on 2-4 warps and
# 64 / 256-wide steps, and the tensor-core tiles (29.6 / 207.7 us).
_ROW_STEP = {"block_k": 256, "split_k": 1}
_FP8_ROW_STEP = {"block_k": 128, "split_k": 1, "operands": "fp16"}
ROW_TILES = {
    "mxfp4": {"pointers": {1: _COMMON | _ROW_STEP | {"block_n": 16, "num_warps": 2, "num_stages": 1},
                           2: _COMMON | _ROW_STEP | {"block_n": 32, "num_warps": 4, "num_stages": 1}},
              "tma": {1: _COMMON | _ROW_STEP | {"block_n": 32, "num_warps": 8, "num_stages": 3,
                                                "down_launch": {"block_n": 16, "num_warps": 2}},
                      2: _COMMON | _ROW_STEP | {"block_n": 64, "num_warps": 4, "num_stages": 3}}},
    "fp8_block": {"pointers": {1: _COMMON | _FP8_ROW_STEP | {"block_n": 16, "num_warps": 4, "block_k": 256,
                                                             "num_stages": 1},
                               2: _COMMON | _FP8_ROW_STEP | {"block_n": 64, "num_warps": 4, "num_stages": 1}},
                  "tma": {1: _COMMON | _FP8_ROW_STEP | {"block_n": 32, "num_warps": 4, "block_k": 256, "num_stages": 3},
                          2: _COMMON | _FP8_ROW_STEP | {"block_n": 128, "num_warps": 4, "num_stages": 3}}},
    "dense": {"pointers": {1: _COMMON | {"block_n": 16, "block_k": 128, "num_warps": 8, "num_stages": 1}}},
}
WEIGHT_LOADS = ("pointers", "tma")
# What an MoE call's down launch may set apart from its gate/up launch (tile "down_launch"): the projections
# differ in shape (gpt-oss: 2 * 2880 gate/up rows per expert against 2880 down rows; Qwen3: K = 2048 against 768),
# and down shares of K cost no launch (the pair sum adds them). The rows per block and the operands stay the call's.
DOWN_TILES = ("block_n", "block_k", "num_warps", "num_stages", "split_k")


def _check_weight_loads(loads: str) -> str:
    if loads not in WEIGHT_LOADS:
        raise ValueError(f"weight_loads must be one of {WEIGHT_LOADS}, got {loads!r}")
    return loads


# At most this many pairs per routed expert: blocks of 2 rows on the CUDA cores, by format and the row path's
# weight loads (FP8 through pointers: the tensor cores above one token, 1.07x / 1.23x at M = 4 / 8 on
# Qwen3-30B-A3B-FP8 over the best blocks of 2, session 24's `bench/pointer_rows.py`; dense weights: the tensor cores
# above one token, 1.4-1.6x over blocks of 2 at M = 2-8 on Qwen3-30B-A3B, OLMoE and Mixtral experts, session 44).
PAIRS_PER_EXPERT_ON_CUDA_CORES = {"mxfp4": {"pointers": 1.3, "tma": 3.3}, "fp8_block": {"pointers": 0, "tma": 1.4},
                                  "dense": {"pointers": 0}}

# Prefill sizes: (from this many pairs per routed expert, tiles) by format, in rising order; the last threshold
# reached gives blocks of its tiles' rows (an expert's weight tiles decoded once for more rows; warpgroup MMAs) for
# 16-bit activations (fp32 tiles of 128 rows would take 64 KB of shared memory per K step). H200, `bench/
# moe_kernels.py --sweep`. Session 26: MXFP4 on blocks of 128 rows in 4 warps, 2 stages, 64 columns, at 128 / 256
# pairs 1.74x / 2.14x over blocks of 16 (gpt-oss-20b, M = 1024 / 2048), 1.74x (Qwen3-30B-A3B MXFP4, M = 2048).
# Session 27, the same tiles on 64 rows: at 64 pairs 1.33x / 1.43x / 1.44x over 16 rows (20b M = 512, 120b M = 2048,
# Qwen3-MXFP4 M = 1024; 128 rows 1.29x / 1.38x / 1.42x), at 32 1.07x / 1.15x / 1.17x, at 16 0.70x / 0.69x /
# 0.77x; at 128 / 256 pairs 128 rows beat 64 by 1.07-1.16x. FP8 on blocks of 32 rows in 3 stages: 1.04x / 1.07x /
# 1.13x at 32 / 64 / 128 pairs (Qwen3-30B-A3B-FP8, M = 512 / 1024 / 2048), 0.90x at 16; 64 rows 1.03x / 1.10x
# at 64 / 128 pairs, 0.86-0.88x at 32.
WIDE_TILES = {"mxfp4": ((32, TILES["mxfp4"] | {"block_m": 64, "num_stages": 2}),
                        (96, TILES["mxfp4"] | {"block_m": 128, "num_stages": 2})),
              "fp8_block": ((32, TILES["fp8_block"] | {"block_m": 32, "num_stages": 3}),)}


def _wide_tiles(format: str, block_m: int) -> dict | None:
    """The WIDE_TILES entry of the most rows up to block_m, None for none."""
    fitting = [tiles for _, tiles in WIDE_TILES.get(format, ()) if tiles["block_m"] <= block_m]
    return fitting[-1] if fitting else None


def pairs_per_routed_expert(tokens: int, top_k: int, experts: int) -> float:
    """Under uniform routing: tokens x top_k pairs over the E * (1 - (1 - k/E)^M) experts routed."""
    return tokens * top_k / (experts * (1 - (1 - top_k / experts) ** tokens))


def rows_per_block(tokens: int, top_k: int, experts: int, reads_host: bool = False,
                   weight_loads: str = "pointers", format: str = "mxfp4", compute_fp32: bool = False) -> int | None:
    """Rows per block for an MoE call whose experts get few or many pairs each (`tiles_for`'s rows), None for the
    format's TILES. Few, on the CUDA-core path: one token's pairs are a block each; up to
    PAIRS_PER_EXPERT_ON_CUDA_CORES pairs per routed expert under uniform routing (E * (1 - (1 - k/E)^M) experts
    routed), blocks of 2 (most experts get one or two pairs, so blocks of 16 on the tensor cores would be mostly
    padding). Many, with 16-bit activations: the rows of the last WIDE_TILES threshold reached. From
    bench/moe_kernels.py on the H200, gpt-oss-20b / 120b. Pointer loads (session 15): blocks of 2 beat the tensor
    cores by 1.25x / 1.26x at M = 4 (1.19 / 1.05 pairs per expert), 1.13x / 1.12x for 120b at M = 8 / 16 (1.13 /
    1.25); at 1.56 (20b, M = 8) by 1.05x only, and at 2.27 (20b, M = 16) they lose 1.26x, reading experts again for
    their third pair. TMA loads (session 17): they win 1.30x / 1.12x / 1.05x at 1.88 / 2.27 / 2.69 (20b, M = 12 /
    16 / 20) and 1.06x at 2.30 (120b, M = 64), and lost 0.92x at 3.13 (20b, M = 24); with the byte-permute decode
    (session 19) they win 1.04x at 3.20 (20b, M = 24) and lose 0.81x at 4.13 (M = 32). FP8 with TMA (session 21,
    Qwen3-30B-A3B-FP8, 128-column tiles): 1.01-1.03x at 1.14 (M = 4), 1.09x at 1.36 (M = 8), a tie at 1.51 (M =
    16, where the tensor cores read at 74% of copy). `reads_host`: experts without a slot are read from host memory
    (offload): no blocks of 2 beyond one token, since an expert's third pair would cross PCIe again (~240 us for a
    gpt-oss expert at 55 GB/s), where one tensor-core block reads it once for up to 16 pairs."""
    if tokens == 1:
        return 1
    pairs_per_expert = pairs_per_routed_expert(tokens, top_k, experts)
    wide = [tiles["block_m"] for least, tiles in WIDE_TILES.get(format, ()) if pairs_per_expert >= least]
    if wide and not compute_fp32:
        return wide[-1]
    if reads_host:
        return None
    return 2 if pairs_per_expert <= PAIRS_PER_EXPERT_ON_CUDA_CORES[format][weight_loads] else None


def tiles_for(format: str, overrides: dict, rows: int | None = None, weight_loads: str = "pointers",
              row_blocker: str | None = None) -> dict:
    """The format's tiles with `overrides` applied, checked against what the kernel can run. `rows`: the rows per
    block for a launch with few or many rows per expert (`rows_per_block`; one token: 1) where no block_m override
    says: fewer than 16 on the CUDA-core path (ROW_TILES), the WIDE_TILES entry of the most rows up to block_m
    where the format has one; `weight_loads`: how that path reads the weight words where no override says (the
    tensor-core tiles read through pointers); `row_blocker`: why that path cannot read the weights, if it cannot
    (`_row_blocker`). A `down_launch` dict (in the overrides or the chosen ROW_TILES entry) gives the down launch
    settings of its own (DOWN_TILES); the result carries it as "down_launch", {} for none."""
    known = set(TILES[format]) | {"weight_loads", "down_launch"}
    if set(overrides) - known:
        raise ValueError(f"unknown tile settings {sorted(set(overrides) - known)}; the kernel takes {sorted(known)}")
    preferred = rows if rows is not None and (rows >= 16 or not row_blocker) else TILES[format]["block_m"]
    block_m = overrides.get("block_m", preferred)
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if block_m < 16 and row_blocker:
        raise ValueError(f"block_m must be >= 16 here: {row_blocker}, got {block_m}")
    loads = _check_weight_loads(overrides.get("weight_loads", weight_loads if block_m < 16 else "pointers"))
    if loads == "tma" and block_m >= 16:
        raise ValueError(f"weight_loads='tma' is for the CUDA-core path (block_m < 16), got block_m {block_m}")
    if block_m >= 16:
        base = _wide_tiles(format, block_m) or TILES[format]
    else:
        by_rows = ROW_TILES[format][loads]
        base = by_rows[min(block_m, max(by_rows))]
    down = base.get("down_launch", {}) | overrides.get("down_launch", {})
    if set(down) - set(DOWN_TILES):
        raise ValueError(f"unknown down tile settings {sorted(set(down) - set(DOWN_TILES))}; the down launch takes "
                         f"its own {list(DOWN_TILES)}")
    tiles = base | overrides | {"block_m": block_m, "weight_loads": loads}
    for checked in (tiles, tiles | down):
        _check_steps(checked, format)
    return tiles | {"down_launch": down}


def _check_steps(tiles: dict, format: str) -> None:
    """Errors for K steps and shares that the kernel cannot run with these tiles."""
    block_k = tiles["block_k"]
    if block_k % 32 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two and a multiple of 32 (one MXFP4 group), got {block_k}")
    if format == "fp8_block" and block_k > 128 and tiles["block_m"] >= 16:
        raise ValueError(f"fp8_block tensor-core tiles need block_k <= 128 (one scale per 128 columns), got {block_k}")
    if not isinstance(tiles["split_k"], int) or tiles["split_k"] < 1:
        raise ValueError(f"split_k must be a positive integer (shares of K), got {tiles['split_k']!r}")
    if tiles.get("operands", "bf16") not in ("bf16", "fp16"):
        raise ValueError(f"operands must be 'bf16' or 'fp16', got {tiles['operands']!r}")


def fused_moe(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: PackedWeight,
              down: PackedWeight, *, interleaved: bool = False, activation: str = "silu", alpha: float = 1.702,
              limit: float = 7.0, compute_fp32: bool | None = None,
              host: tuple[PackedWeight, PackedWeight] | None = None, slot_of: torch.Tensor | None = None,
              routed_experts: int | None = None, **tiles) -> torch.Tensor:
    """Routed experts of one MoE layer: hidden [M, H], top_k_index / top_k_weights [M, k] -> [M, H] in
    hidden's dtype. gate_up is [E, 2I, H] (for an activation in UNGATED_ACTIVATIONS, up alone: [E, I, H]), down
    [E, H, I] (output-major), each packed in any format; `tiles` override the format's tiles for the call's size
    (`TILES`, or `ROW_TILES` for blocks of few rows, chosen by `rows_per_block`; block_m < 16 picks the CUDA-core
    path for MXFP4 and FP8). Without tiles, resident experts
    with DEQUANTIZE_PAIRS pairs or more each are dequantized for torch's grouped GEMM (`_dequantized_moe`). With
    `slot_of` ([E] int32 on the device: expert -> slot, -1 for none), gate_up and down are slot pools and `host` the
    (gate_up, down) views over all experts' host blobs (pinned memory on CUDA, same strides): experts without a slot
    are read from host memory by the kernel. `routed_experts`: how many distinct experts top_k_index can name when
    that is fewer than the weights hold (a slot pool read as one layer's experts: its E of the pool's slots), for
    the estimates of pairs per routed expert that pick the kernel."""
    if routed_experts is not None and routed_experts < 1:
        raise ValueError(f"routed_experts must be at least 1 (or None: every expert), got {routed_experts}")
    if (host is None) != (slot_of is None):
        raise ValueError("slot_of and host come together: the slot table and the host blobs it falls back to")
    if host is not None and any(_strides(on_host) != _strides(pooled)
                                for on_host, pooled in zip(host, (gate_up, down))):
        raise ValueError("the host weights must have the slot pool's strides (one blob layout for both)")
    experts = gate_up.shape[0] if slot_of is None else slot_of.numel()
    routable = min(experts, routed_experts or experts)
    _, first_rows, h = gate_up.shape
    gated = activation not in UNGATED_ACTIVATIONS
    inter = first_rows // 2 if gated else first_rows
    if down.shape != (gate_up.shape[0], h, inter):
        raise ValueError(f"down weight {list(down.shape)} does not match gate_up {list(gate_up.shape)}: expected "
                         f"[E, H, I] = {[gate_up.shape[0], h, inter]}")
    if hidden.shape[-1] != h:
        raise ValueError(f"hidden size {hidden.shape[-1]} differs from the experts' {h}")
    if hidden.ndim != 2 or top_k_index.ndim != 2 or top_k_weights.shape != top_k_index.shape \
            or top_k_index.shape[0] != hidden.shape[0]:
        raise ValueError(f"hidden {list(hidden.shape)}, top_k_index {list(top_k_index.shape)} and top_k_weights "
                         f"{list(top_k_weights.shape)} must be [M, H], [M, k] and [M, k]: flatten the tokens first")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise ValueError(f"top_k_index must hold integer expert ids, got {top_k_index.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} has no fused kernel; choose one of {sorted(ACTIVATIONS)}")
    tokens, top_k = top_k_index.shape
    compute_fp32 = hidden.dtype == torch.float32 if compute_fp32 is None else compute_fp32
    blocker = fused_blocker(gate_up.format, hidden.device, compute_fp32)
    if blocker:
        raise ValueError(f"{blocker}: run these experts through dflash_compile.expert_store.run_packed, which "
                         "dequantizes them there (reference_packed)")
    if tokens == 0:  # nothing routed: the grids would be empty
        return hidden.new_empty(hidden.shape)
    if (not tiles and host is None and not compute_fp32
            and cuda_rows.covers(hidden, top_k_index, gate_up, down, interleaved, activation)):
        return cuda_rows.one_token_moe(hidden, top_k_index, top_k_weights, gate_up, down, interleaved, alpha, limit,
                                       _paired_shift(activation, alpha, limit))
    if (not tiles and host is None and compute_fp32 == (hidden.dtype == torch.float32)
            and pairs_per_routed_expert(tokens, top_k, routable) >= DEQUANTIZE_PAIRS[gate_up.format]
            and not (hidden.is_cuda and torch.cuda.is_current_stream_capturing())):
        return _dequantized_moe(hidden, top_k_index, top_k_weights, gate_up, down, interleaved, activation, alpha,
                                limit)
    loads = _weight_loads(tiles, _tma_blocker(gate_up, down, compute_fp32, host))
    rows = rows_per_block(tokens, top_k, routable, host is not None, loads, gate_up.format, compute_fp32)
    settings = tiles_for(gate_up.format, tiles, rows, loads, _row_blocker(gate_up, down))
    blocks = _blocks(top_k_index, experts, settings["block_m"])
    down_tiles, split_k = settings.pop("down_launch"), settings.pop("split_k")
    # an ungated first launch is not split: `_finish_gate_up` adds gate/up pairs
    splits = _splits(split_k, blocks) if gated else 1
    down_splits = _splits(down_tiles.pop("split_k", split_k), blocks)
    settings |= dict(alpha=alpha, limit=limit, compute_fp32=compute_fp32, slot_of=slot_of)
    x, x_shifts = _activations(hidden, settings), None
    paired_shift, out_shifts = 0, None
    if gate_up.format == "mxfp4" and settings["block_m"] < 16 and not compute_fp32:  # the row path on the GPU
        paired_input, paired_shift = _paired_activations(tokens, splits, activation, alpha, limit)
        if paired_input:
            x, x_shifts = _pair_rows(hidden)
        out_shifts = torch.empty(tokens * top_k, dtype=torch.int32, device=x.device) if paired_shift else None
    intermediate = _launch(x, gate_up, blocks, None, tokens * top_k, inter, top_k,
                           gated=gated, interleaved=interleaved, activation=activation,
                           host=host[0] if host else None, x_shifts=x_shifts, paired_shift=paired_shift,
                           out_shifts=out_shifts, splits=splits, **settings)
    if splits > 1:
        fp16_operands = _fp16_operands(settings.get("operands", "bf16"), compute_fp32)
        intermediate = _finish_gate_up(intermediate, _gate_up_dtype(x.dtype, compute_fp32, fp16_operands),
                                       activation, alpha, limit, fp16_operands)
    weights = top_k_weights.reshape(-1).contiguous()
    return _launch(intermediate, down, blocks, weights, tokens * top_k, h, 1, gated=False, interleaved=False,
                   activation="silu", host=host[1] if host else None, x_shifts=out_shifts, splits=down_splits,
                   out_dtype=hidden.dtype, sum_top_k=top_k, **settings | down_tiles)


# Pairs per routed expert, by format, from which an MoE call (prefill sizes) dequantizes its experts to the
# activations' dtype and multiplies them by torch's grouped GEMM (cuBLAS on Hopper) rather than the fused launches,
# which are bound by their math there; the experts go a group at a time, at most DEQUANTIZE_EXPERT_ELEMENTS values
# (1 GiB of bf16: gpt-oss-20b's 32 experts at once). H200, `bench/moe_kernels.py --dequantize-pairs 1` (session 36):
# gpt-oss-20b at 128 / 256 / 512 pairs 0.62x / 0.93x / 1.25x of the fused launches (a layer's dequantize alone
# takes 669 us at 3 TB/s; its GEMMs 1370 us at 4096 tokens), gpt-oss-120b 0.36x / 0.47x / 0.69x at 32 / 64 / 128,
# Qwen3-30B-A3B-FP8 0.52x / 0.79x / 1.33x at 64 / 128 / 256. Dense weights need no dequantize: transformers'
# grouped_mm experts (the same GEMMs) beat the fused launches on bf16 weights from 32 pairs (0.53x fused at 32,
# 0.19-0.31x at 128-512; sessions 26 and 36).
DEQUANTIZE_PAIRS = {"mxfp4": 384, "fp8_block": 256, "dense": 32}
DEQUANTIZE_EXPERT_ELEMENTS = 1 << 29


def _expert_run(weight: PackedWeight, experts: list[int], buffer: torch.Tensor | None) -> torch.Tensor:
    """`experts` (ascending) of `weight` as a float [len(experts), N, K] tensor: dense weights as they are (a view:
    `experts` a run of consecutive ids), packed ones dequantized into the front of `buffer`."""
    first, stop = experts[0], experts[-1] + 1
    if weight.format == "dense":
        return weight.data[first:stop]
    _, n, k = weight.shape
    out = buffer[:len(experts) * n * k].view(len(experts), n, k)
    if stop - first == len(experts):
        return _dequantize(weight.format, weight.data[first:stop], weight.scales[first:stop], out)
    ids = torch.tensor(experts, dtype=torch.int32, device=buffer.device)
    return _dequantize(weight.format, weight.data, weight.scales, out, ids)


def _expert_groups(counts: list[int], format: str, group: int) -> list[list[int]]:
    """The experts `_dequantized_moe` runs, in groups of at most `group` ascending ids that hold every pair once:
    packed experts with pairs only (`group` fills the dequantize buffer; an expert without pairs, such as a slot
    pool's expert of another layer, is never dequantized), dense ones as views of consecutive experts (an expert
    without pairs is an empty group to torch's grouped GEMM, free), groups without pairs left out."""
    if format == "dense":
        windows = [range(first, min(len(counts), first + group)) for first in range(0, len(counts), group)]
        return [list(window) for window in windows if any(counts[e] for e in window)]
    routed = [e for e, count in enumerate(counts) if count]
    return [routed[first: first + group] for first in range(0, len(routed), group)]


def _dequantized_moe(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up: PackedWeight, down: PackedWeight, interleaved: bool, activation: str, alpha: float,
                     limit: float) -> torch.Tensor:
    """`fused_moe` for many pairs per routed expert: the pairs' rows sorted by expert, then per group of experts
    (`_expert_groups`) their weights (`_expert_run`: packed ones dequantized into one buffer, reused by each
    projection) and each projection one `torch._grouped_mm` over the group's rows, the gate/up's biases and
    activation in one launch (`_finish_gate_up`); then each token's pairs, with the down biases and routing weights,
    summed in fp32 in pair order (`_sum_sorted_pairs_kernel`). One host sync (the experts' pair counts), so never
    inside a CUDA graph capture."""
    tokens, top_k = top_k_index.shape
    experts, two_i, h = gate_up.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # ids past the experts (expert-parallel sentinels) sort last, unused
    row_of_pair = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    expert_of_row = flat[order]
    counts = torch.bincount(flat, minlength=experts)[:experts].tolist()
    x = hidden[order // top_k]
    projected = []
    groups = _expert_groups(counts, gate_up.format, max(1, DEQUANTIZE_EXPERT_ELEMENTS // (two_i * h)))
    largest = max(map(len, groups), default=0)  # a pool's unrouted slots take no room
    buffer = None if gate_up.format == "dense" else hidden.new_empty(largest * two_i * h)
    start = 0
    for experts_of_group in groups:
        ends = list(itertools.accumulate(counts[e] for e in experts_of_group))
        rows = slice(start, start + ends[-1])
        start = rows.stop
        offsets = torch.tensor(ends, dtype=torch.int32, device=hidden.device)
        gated = torch._grouped_mm(x[rows], _expert_run(gate_up, experts_of_group, buffer).transpose(1, 2),
                                  offs=offsets)
        if activation in UNGATED_ACTIVATIONS:  # relu(up)^2 in fp32, rounded once as `_finish_gate_up` rounds
            up = gated.float() if gate_up.bias is None else gated.float() + gate_up.bias[expert_of_row[rows]].float()
            activated = torch.relu(up).square().to(hidden.dtype)
        else:
            activated = _finish_gate_up(gated[None], hidden.dtype, activation, alpha, limit, False, interleaved,
                                        gate_up.bias, expert_of_row[rows])
        projected.append(torch._grouped_mm(activated, _expert_run(down, experts_of_group, buffer).transpose(1, 2),
                                           offs=offsets))
    projected = projected[0] if len(projected) == 1 else torch.cat(projected)  # rows of the routed pairs
    out = torch.empty_like(hidden)
    block = min(1024, triton.next_power_of_2(h))
    _sum_sorted_pairs_kernel[(tokens, triton.cdiv(h, block))](
        projected, row_of_pair, flat, top_k_weights.reshape(-1), down.bias, _strides(down)[2], out, h, experts,
        TOP_K=top_k, HAS_BIAS=down.bias is not None, BLOCK=block)
    return out


# A dense layer's rows at most in one block on the row path (its weights read once), by format and weight loads:
# MXFP4's 1-2; FP8's 1-2 with TMA loads, over the tensor cores on DeepSeek-V3's and Qwen3's projections one row
# 1.01-1.29x (session 22), two rows 1.12-1.41x (session 23; pointer loads not measured: block_m asks for them);
# bf16's one row on DENSE_ROW_TILES (the `split_k_linear` layers: o_proj, routers; session 44's probe, session 46).
ROWS_ON_CUDA_CORES = {"mxfp4": {"pointers": 2, "tma": 2}, "fp8_block": {"pointers": 0, "tma": 2},
                      "dense": {"pointers": 1}}

# A bf16 dense layer's row-path tiles, apart from an MoE call's (ROW_TILES["dense"]: one expert's 16 columns on 8
# warps): a whole layer's output is read by K shares (`_share_steps`), and 32 columns on 8 warps in more, shorter
# shares beat the experts' 16 columns (Qwen3-30B-A3B o_proj 6.8 against 10.5-11.5 us, session 44). Against the
# tensor-core tiles with their shares (session 46, `bench/packed_linear.py --format dense --tokens 1`): Qwen3-30B-A3B
# o_proj 6.8 vs 9.4 us, router 2.5 vs 3.1; gpt-oss-20b o_proj 10.6 vs 10.5-10.7, router 2.6 vs 3.4.
DENSE_ROW_TILES = {"block_n": 32, "num_warps": 8}


@triton.jit
def _dequantize_kernel(data, scales, out, N, K, expert_data, expert_scales, expert_ids, FORMAT: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COMPUTE_FP32: tl.constexpr):
    """Tile (program_id(0), program_id(1)) of expert program_id(2) (or of expert `expert_ids`[program_id(2)]) of an
    MXFP4 or FP8 block-scaled weight [E, N, K] (experts `expert_data` / `expert_scales` elements apart) into
    out[program_id(2)], scaled and rounded once to out's dtype (out [E, N, K]
    contiguous): the reference dequantizers' bits. An FP8 tile lies in one 128 x 128 scale block, so its scale is
    one load (per-element scale loads took 56 of the 696 instructions per thread on sm_90, Triton 3.6), and the
    codes go through fp16 (exact for every e4m3 value), not bf16 (a further conversion each)."""
    expert = tl.program_id(2).to(tl.int64)
    out += expert * N * K
    if expert_ids is not None:
        expert = tl.load(expert_ids + expert).to(tl.int64)
    data += expert * expert_data
    scales += expert * expert_scales
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    columns = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    if FORMAT == 1:
        values = _mxfp4_tile(data, scales, rows, rows < N, tl.program_id(1) * BLOCK_K, K, COMPUTE_FP32, BLOCK_K)
    else:
        tl.static_assert(BLOCK_K == 128 and 128 % BLOCK_N == 0, "a tile inside one 128 x 128 scale block")
        values = _fp8_tile(data, rows, rows < N, columns, K, COMPUTE_FP32, True).to(tl.float32)
        values *= tl.load(scales + (tl.program_id(0) * BLOCK_N // 128) * tl.cdiv(K, 128) + tl.program_id(1))
    tl.store(out + rows[:, None].to(tl.int64) * K + columns[None, :], values,
             mask=(rows < N)[:, None] & (columns < K)[None, :])


def _dequantize(format: str, data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                expert_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Packed expert weights (`data` / `scales`: a run of experts, or of one expert's rows from a multiple of 128;
    with `expert_ids` (int32 on the device), those experts of them) into out [experts, N, K] of a float dtype, by
    `_dequantize_kernel`."""
    experts, n, k = out.shape
    _dequantize_kernel[(triton.cdiv(n, DEQUANTIZE_TILES["BLOCK_N"]), triton.cdiv(k, 128), experts)](
        data, scales, out, n, k, data.stride(0), scales.stride(0), expert_ids, FORMAT=FORMATS[format], BLOCK_K=128,
        COMPUTE_FP32=out.dtype == torch.float32, **DEQUANTIZE_TILES)
    return out


# Rows from which an FP8 dense layer is dequantized to x's dtype (in slabs of at most DEQUANTIZE_ELEMENTS, so the
# transient copy stays small) and multiplied by torch (cuBLAS): at that many rows the fused launch is bound by its
# math (fp8 converted to fp16 per tile). From bench/packed_linear.py --dequantize-rows on the H200 (session 25):
# 1.19-1.88x faster on all nine DeepSeek-V3 / Qwen3 projections at 256 rows, 2.0-3.6x at 1024; at 128 rows
# 0.69-1.44x (the large projections lose), at 64 0.46-0.86x.
DEQUANTIZE_ROWS = 256
DEQUANTIZE_ELEMENTS = 1 << 25


# `_dequantize_kernel`'s tiles: rows of one 128 x 128 scale block per program (a divisor of 128), warps. 16-128
# rows on 2-8 warps measured within 1.04x of these on every DeepSeek-V3 / Qwen3 FP8 shape at 256 and 1024 rows
# (session 26, `bench/packed_linear.py --dequantize-sweep`). MXFP4 takes them unswept (gpt-oss-20b's layer: 669 us,
# 3.0 TB/s of reads and writes, session 36).
DEQUANTIZE_TILES = {"BLOCK_N": 64, "num_warps": 4}


def _dequantized_linear(rows: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """rows [M, K] @ dequantized FP8 weight [1, N, K]^T (+ bias), slab by slab of output columns."""
    _, n, k = weight.shape
    slab = max(128, DEQUANTIZE_ELEMENTS // k // 128 * 128)
    bias = weight.bias[0].to(rows.dtype) if weight.bias is not None else None
    # one buffer for every slab: on the one stream each slab's matmul reads it before the next slab is written
    outputs, buffer = [], torch.empty(min(n, slab), k, dtype=rows.dtype, device=rows.device)
    for start in range(0, n, slab):
        stop = min(n, start + slab)
        dense = _dequantize(weight.format, weight.data[:1, start:stop], weight.scales[:1, start // 128:],
                            buffer[None, :stop - start])[0]
        outputs.append(torch.nn.functional.linear(rows, dense, None if bias is None else bias[start:stop]))
    return torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]


def packed_linear(x: torch.Tensor, weight: PackedWeight, **tiles) -> torch.Tensor:
    """A dense linear layer over a packed [1, N, K] weight (FP8 block-scaled or MXFP4): the MoE kernel with every
    row on the one expert, blocks of rows in order (no grouping launch), K split to fill the GPU when the output
    has few column tiles (tile `split_k` fixes the count); FP8 from DEQUANTIZE_ROWS rows without tiles given: the
    weight dequantized slab by slab, then torch's linear. x [..., K] -> [..., N] in x's dtype."""
    if "down_launch" in tiles:
        raise ValueError("down_launch sets an MoE call's down launch apart; a dense layer has one projection: pass "
                         "its tiles directly")
    rows = x.reshape(-1, x.shape[-1])
    compute_fp32 = x.dtype == torch.float32
    blocker = fused_blocker(weight.format, x.device, compute_fp32)
    if blocker:
        raise ValueError(f"{blocker}: use dflash::fp8_block_linear, which dequantizes the weight there")
    _, n, k = weight.shape
    if rows.shape[0] == 0:  # as torch's linear: no rows, no launch
        return x.new_empty(*x.shape[:-1], n)
    if weight.format == "fp8_block" and rows.shape[0] >= DEQUANTIZE_ROWS and not tiles:
        return _dequantized_linear(rows, weight).view(*x.shape[:-1], n)
    loads = _weight_loads(tiles, _tma_blocker(weight, weight, compute_fp32, None))
    row_blocker = _row_blocker(weight)
    few_rows = rows.shape[0] if rows.shape[0] <= ROWS_ON_CUDA_CORES.get(weight.format, {}).get(loads, 0) else None
    if weight.format == "fp8_block" and few_rows is None and tiles.get("block_m", 16) >= 16:
        tiles = _dense_tiles(rows.shape[0], n) | tiles
    elif weight.format == "dense" and few_rows and not row_blocker and "block_m" not in tiles:
        tiles = DENSE_ROW_TILES | tiles
    settings = tiles_for(weight.format, tiles, few_rows, loads, row_blocker) | dict(compute_fp32=compute_fp32)
    settings.pop("down_launch")  # an MoE call's (MXFP4's one-row tiles have one): a dense layer runs on the tiles
    rows = _activations(rows, settings)
    blocks = Blocks(ROWS_IN_ORDER, triton.cdiv(rows.shape[0], settings["block_m"]))
    split_k = settings.pop("split_k")
    if "split_k" not in tiles:
        split_k = _filling_splits(blocks.count * triton.cdiv(n, settings["block_n"]),
                                  triton.cdiv(k, settings["block_k"]), sm_count(x.device),
                                  _share_steps(weight.format, settings["block_m"], settings["block_n"]),
                                  settings["num_warps"])
    out = _launch(rows, weight, blocks, None, rows.shape[0], n, 1, gated=False, interleaved=False,
                  activation="silu", alpha=0.0, limit=0.0, splits=split_k, out_dtype=x.dtype,
                  sum_top_k=1 if split_k > 1 else 0, **settings)
    return out.view(*x.shape[:-1], n)
