"""Probe (not the library's kernel): one token's gpt-oss MXFP4 MoE layer (or, `--shape qwen3-30b-a3b-fp8`, a Qwen3
FP8 one) as two CUDA C++ kernels on the CUDA cores, to measure how near the copy bandwidth a plain GEMV design gets
where the Triton row path stops at 45-47% (MXFP4) and 50% (FP8) on the H200.

Design: every lane of a warp owns 32-code groups lane, lane + 32, lane + 64 of a row (K = 2880: 90 groups), so a
warp reads a row's 1440 bytes as 16-byte loads, coalesced, with no shared-memory staging of weights and no CTA-wide
barrier in the loop; the activations sit in shared memory as fp16 pairs in the decode's order (padded: conflict
free 16-byte reads), the codes go to fp16x2 pairs by the library's 11-instruction word decode, products add in
fp16x2 per group and in fp32 across groups, a warp shuffle sums the lanes. Warps are persistent (a grid of CTAS
per SM) and keep DEPTH units' loads in flight.
- gate/up: a warp's unit is COLS output columns (their interleaved gate and up rows); activation; fp16 output times
  2^PAIRED_SHIFT in pair order for the down kernel.
- down, by expert: a CTA is a warp per routed expert, each staging only its own expert's activations; ROWS output
  rows a batch, the experts' weighted partials added in slot order through shared memory in the kernel (no
  pair-sum launch). (Session 58's version 3, a warp per output row over all top-k experts, took 1.04-1.07x as
  long on the H100 and is gone.) A programmatic dependent launch: it issues its first weight loads, then waits for
  gate/up.
- FP8 (`fp8_gate_up_kernel`, `fp8_down_kernel`): 16-byte chunks of 16 codes per lane, the hardware's e4m3x2 ->
  f16x2 conversion, each chunk's sum times its 128 x 128 block scale; gate and up rows concatenated, SiLU, fp32
  activations out; the down kernel by expert (8 warps, top-8) scales each expert's activations to fp16 itself.
  The library's header holds them (`fp8_one_token`, DFLASH_CUDA_ROWS=1); this probe times their depths and CTAs.
- SiLU MXFP4 (`--shape qwen3-30b-a3b-mxfp4`, `moe_silu`): the library's `mxfp4_layer<8, false>` launches (gate
  rows then up rows, no biases, fp32 activations; 2 groups a lane in gate/up, 1 in down) with the config's
  DEPTH2, CTAS1, CTAS2 and ROWS (DEPTH1 is 1).
- weights through shared memory (a config's STAGES1 for gate/up, STAGES2 for down: 2 or 3, and 4 for gpt-oss's
  gate/up; gpt-oss and FP8): each thread copies its own words of a unit's rows into its own slots of a STAGES-deep
  ring by cp.async and reads back only those (no barrier), so STAGES - 1 units stay in flight while a warp decodes
  one, where the register ring (DEPTH 1) has none in flight while it decodes.
- `--configs` DEPTH1,DEPTH2,CTAS1,CTAS2[,ROWS[,COLS[,STAGES1[,STAGES2]]]] (gate/up, down; ROWS 2 or 4, default 2;
  COLS 1 or 2, default 1; STAGES 0 or as above, default 0; gate/up's registers capped for CTAS1 CTAs per SM, up to
  3); each also
  timed with gate/up's loads alone (no decode) and its decode alone (words made up, no loads). `--ncu`: a few plain
  calls for a profiler.

Built with torch's load_inline (needs nvcc; sm_90a). Session 58 (docs/benchmarks.md): 1.24x the library on the H100
(69% of copy) with `--configs 1,2,2,3,2`; session 60 on the H100: 66% with `1,1,2,3,4` (the library's since).

    python3 bench/probe_cuda_rows.py --layers 4 --configs 1,1,2,3,4 1,1,3,3,4 1,1,2,4,4 1,2,2,3,2
    python3 bench/probe_cuda_rows.py --shape qwen3-30b-a3b-fp8 --configs 1,1,2,2,2 1,1,2,4,2 1,1,2,2,4 1,2,2,2,2
    python3 bench/probe_cuda_rows.py --shape qwen3-30b-a3b-mxfp4 --configs 1,1,2,3,4 1,1,2,1,4 1,2,2,1,2 1,1,3,2,4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernels import (SHAPES, copy_bandwidth, expert_bytes, graph_time_us, random_packed,  # noqa: E402
                         random_routing, read_time_us, reference)

from dflash_compile.kernels.moe import fused_moe  # noqa: E402

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "moe_rows_cuda.cuh"  # the library's MXFP4 kernels
CUDA = HEADER.read_text().replace("#pragma once\n", "") + r"""
constexpr int WARPS = 8;

// ---- weights in flight through shared memory (cp.async), not registers (a config's STAGES1 / STAGES2 > 0) ----
// Each thread copies its own 16-byte words of a unit's rows into its own slots of a STAGES-deep ring (cp.async.cg,
// evict-first) and reads back only those, so no barrier or mbarrier orders them: STAGES - 1 units stay in flight
// while the warp decodes one, at no register cost (the register rings at depth 1 hold none while a warp decodes).
// A ring is [STAGES][WORDS][THREADS] 16-byte words after the activations; units past a warp's (CTA's) last are not
// loaded. The MXFP4 kernels take gpt-oss's layout (COLS 1), the FP8 ones Qwen3-FP8's, as the register kernels.
__device__ __forceinline__ void copy_async16(uint4* to, const uint4* from, uint64_t policy) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(to));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(address), "l"(from), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory"); }

__device__ __forceinline__ uint64_t evict_first() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// bytes of a kernel's shared memory: `activations` bytes, then a ring of `stages` x `words` 16-byte words a thread
inline int ring_bytes(int activations, int stages, int words, int threads) {
  return activations + stages * words * threads * 16;
}

// The loop of a staged kernel: its units 0 .. iters - 1 (iters uniform over the warp, or the CTA where `step`
// holds a barrier), unit n in stage n % STAGES; `issue(stage, n)` copies unit n (units from STAGES - 1 on, here;
// 0 .. STAGES - 2 before) and commits a group even past the last unit, so that STAGES - 1 groups pending means
// unit n's have landed before `step(stage, n)` reads them
template <int STAGES, typename Issue, typename Step>
__device__ __forceinline__ void staged_loop(int iters, Issue issue, Step step) {
  for (int it = 0; it < iters; it += STAGES) {
#pragma unroll
    for (int d = 0; d < STAGES; ++d) {
      issue((d + STAGES - 1) % STAGES, it + d + STAGES - 1);
      if (it + d >= iters) break;
      wait_copies<STAGES - 1>();
      step(d, it + d);
    }
  }
}

template <int ROWS, int GPL>
struct RowMeta {  // what an MXFP4 unit's copies leave in registers: its groups' exponents, lane j's row-j bias
  uint8_t e[ROWS][GPL];
  float bias;
};

// Rows first, first + 1, ... (clamped to last) of the [rows, G] views of blocks and scales into this thread's slots
// of `stage` and `m`
template <int ROWS, int GPL, int THREADS>
__device__ __forceinline__ void copy_rows(uint4* stage, RowMeta<ROWS, GPL>& m, const uint4* blocks,
                                          const uint8_t* scales, const __nv_bfloat16* bias, int first, int last,
                                          int lane, int G, uint64_t policy) {
  m.bias = bias && lane < ROWS ? __bfloat162float(bias[min(first + lane, last)]) : 0.f;
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int i = 0; i < GPL; ++i) {
      const int g = lane + 32 * i, word = min(first + r, last) * G + g;
      if (g < G) copy_async16(stage + (r * GPL + i) * THREADS + threadIdx.x, blocks + word, policy);
      m.e[r][i] = g < G ? __ldcs(scales + word) : uint8_t(0);  // past G: any words, exponent 0 (finite codes)
    }
}

// this thread's part of row j's dot from its words of `stage` (as row_dot, the bias on lane j)
template <int MODE, int ROWS, int GPL, int THREADS>
__device__ __forceinline__ float staged_row_dot(const uint4* stage, const RowMeta<ROWS, GPL>& m, int j,
                                                const uint4* xs, int lane, int G, float bias_scale) {
  return (lane == j ? m.bias * bias_scale : 0.f) + lane_dot<GPL>([&](int i) {
    const uint4 w = stage[(j * GPL + i) * THREADS + threadIdx.x];
    if (MODE == 1) return __int_as_float((w.x ^ w.y ^ w.z ^ w.w) & 0x3FFFFF) + float(m.e[j][i]);
    return group_dot(w, xs, min(lane + 32 * i, G - 1), m.e[j][i]);
  });
}

// gate/up (gate_up_kernel's gpt-oss path, COLS 1) through the ring
template <int STAGES, int MIN_CTAS, int MODE, int GPL = 3>
__global__ void __launch_bounds__(WARPS * 32, MIN_CTAS) gate_up_async_kernel(
    const __nv_bfloat16* __restrict__ x, const uint4* __restrict__ blocks, const uint8_t* __restrict__ scales,
    const __nv_bfloat16* __restrict__ bias, const int64_t* __restrict__ experts, __half* __restrict__ h, int I, int G,
    int units, float alpha, float limit, int paired_shift) {
  constexpr int ROWS = 2, WORDS = ROWS * GPL, THREADS = WARPS * 32;
  extern __shared__ uint4 xs[];  // the activations' quads, then the ring
  uint4* ring = xs + G * QUADS;
  __shared__ float warp_max[WARPS];
  __shared__ int expert_rows[8];
  const PersistentWarp me(WARPS, units);
  const int lane = me.lane, stride = me.stride, first = me.first, iters = me.iters;
  wait_previous();
  const int slots = units / I;
  if (threadIdx.x < slots) expert_rows[threadIdx.x] = int(experts[threadIdx.x]) * 2 * I;
  __syncthreads();
  const uint64_t policy = evict_first();
  RowMeta<ROWS, GPL> meta[STAGES];
  Unit in_ring[STAGES], next{first / I, first % I};
  auto issue = [&](int stage, int n) {  // called for n = 0, 1, ... in order: `next` is unit n
    in_ring[stage] = next;
    const int row = expert_rows[min(next.slot, slots - 1)] + 2 * next.column;
    if (n < iters)
      copy_rows<ROWS, GPL, THREADS>(ring + stage * WORDS * THREADS, meta[stage], blocks, scales, bias, row, row + 1,
                                    lane, G, policy);
    commit_copies();
    next.advance(stride, I);
  };
#pragma unroll
  for (int d = 0; d < STAGES - 1; ++d) issue(d, d);
  const int shift = stage_token<WARPS>(x, G, xs, warp_max);
  __syncthreads();
  let_next();
  const float unscale = exp2i(14 - shift), bias_scale = exp2i(shift - 14), out_scale = exp2i(paired_shift);
  staged_loop<STAGES>(iters, issue, [&](int d, int) {
    float dots[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
      dots[j] = staged_row_dot<MODE, ROWS, GPL, THREADS>(ring + d * WORDS * THREADS, meta[d], j, xs, lane, G,
                                                         bias_scale);
    const float sum = lane_sums<ROWS>(dots, lane), up_sum = __shfl_down_sync(0xffffffffu, sum, 16);
    if (lane == 0) {
      const float gate = fminf(sum * unscale, limit), up = fminf(fmaxf(up_sum * unscale, -limit), limit);
      const float act = (up + 1.f) * __fdividef(gate, 1.f + __expf(-gate * alpha));
      h[in_ring[d].slot * I + paired_column(in_ring[d].column)] = __float2half_rn(act * out_scale);
    }
  });
}

// down by expert (down_by_expert_kernel, fp16 activations) through the ring; its first STAGES - 1 batches are
// copied before it waits for gate/up
template <int STAGES, int ROWS, int TOPK = 4, int GPL = 3>
__global__ void __launch_bounds__(TOPK * 32) down_async_kernel(
    const __half* __restrict__ h, const uint4* __restrict__ blocks, const uint8_t* __restrict__ scales,
    const __nv_bfloat16* __restrict__ bias, const int64_t* __restrict__ experts, RoutingWeights weights,
    __nv_bfloat16* __restrict__ out, int H, int G, int paired_shift) {
  constexpr int WORDS = ROWS * GPL, THREADS = TOPK * 32;
  extern __shared__ uint4 xs[];  // TOPK x activation_bytes(G), then the ring
  uint4* ring = xs + TOPK * G * QUADS;
  __shared__ float partial[2][TOPK][ROWS];
  const int lane = threadIdx.x & 31, k = threadIdx.x >> 5;
  const int batches = (H + ROWS - 1) / ROWS;
  const int iters = int(blockIdx.x) < batches ? (batches - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int e = int(experts[k]);
  const uint64_t policy = evict_first();
  RowMeta<ROWS, GPL> meta[STAGES];
  auto issue = [&](int stage, int n) {  // the CTA's n-th batch
    if (n < iters)
      copy_rows<ROWS, GPL, THREADS>(ring + stage * WORDS * THREADS, meta[stage], blocks, scales, bias,
                                    e * H + (blockIdx.x + n * gridDim.x) * ROWS, e * H + H - 1, lane, G, policy);
    commit_copies();
  };
#pragma unroll
  for (int d = 0; d < STAGES - 1; ++d) issue(d, d);
  wait_previous();  // gate/up's activations
  uint4* mine = xs + k * G * QUADS;
  const uint4* hq = reinterpret_cast<const uint4*>(h) + k * G * 4;
  for (int i = lane; i < G * 4; i += 32) mine[quad(i / 4, i % 4)] = hq[i];
  __syncwarp();
  let_next();
  const float scale = weights[k] * exp2i(14 - paired_shift), bias_scale = exp2i(paired_shift - 14);
  staged_loop<STAGES>(iters, issue, [&](int d, int n) {
    float acc[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
      acc[j] = staged_row_dot<0, ROWS, GPL, THREADS>(ring + d * WORDS * THREADS, meta[d], j, mine, lane, G,
                                                     bias_scale);
    const float sum = lane_sums<ROWS>(acc, lane);
    sum_slots<ROWS, TOPK>(partial, scale * sum, n, true, blockIdx.x + n * gridDim.x, k, lane, H, out);
  });
}

template <int ROWS, int CPL>
struct ChunkScales {  // what an FP8 unit's copies leave in registers: each chunk's block scale
  float s[ROWS][CPL];
};

// FP8 rows rows[0 .. ROWS - 1] (chunks lane + 32 i) into this thread's slots of `stage`, scales[r] each row's
// block-row of scales. Slots past C are never copied: `clear_past_row` zeroes them once (e4m3 NaN bytes times a
// scale of 0 would still be NaN)
template <int ROWS, int CPL, int THREADS>
__device__ __forceinline__ void copy_rows8(uint4* stage, ChunkScales<ROWS, CPL>& m, const uint4* const* rows,
                                           const float* const* scales, int lane, int C, uint64_t policy) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = lane + 32 * i;
      if (c < C) copy_async16(stage + (r * CPL + i) * THREADS + threadIdx.x, rows[r] + c, policy);
      m.s[r][i] = c < C ? __ldg(scales[r] + c / 8) : 0.f;
    }
}

template <int STAGES, int WORDS_PER_ROW, int ROWS, int THREADS>
__device__ __forceinline__ void clear_past_row(uint4* ring, int lane, int C) {
#pragma unroll
  for (int i = 0; i < STAGES * ROWS * WORDS_PER_ROW; ++i)
    if (lane + 32 * (i % WORDS_PER_ROW) >= C) ring[i * THREADS + threadIdx.x] = make_uint4(0, 0, 0, 0);
}

template <int ROWS, int CPL, int THREADS>
__device__ __forceinline__ float staged_row_dot8(const uint4* stage, const ChunkScales<ROWS, CPL>& m, int j,
                                                 const uint4* xs, int lane, int C) {
  return lane_dot<CPL>([&](int i) {
    const int c = min(lane + 32 * i, C - 1);
    return chunk_dot8(stage[(j * CPL + i) * THREADS + threadIdx.x], xs[quad8(c, 0)], xs[quad8(c, 1)]) * m.s[j][i];
  });
}

// FP8 gate/up (fp8_gate_up_kernel) through the ring
template <int STAGES, int CPL>
__global__ void __launch_bounds__(WARPS * 32) fp8_gate_up_async_kernel(
    const __nv_bfloat16* __restrict__ x, const uint4* __restrict__ blocks, const float* __restrict__ scales,
    const int64_t* __restrict__ experts, float* __restrict__ h, int I, int C, int units) {
  constexpr int ROWS = 2, WORDS = ROWS * CPL, THREADS = WARPS * 32;
  extern __shared__ uint4 xs[];  // C x 2 quads, then the ring
  uint4* ring = xs + C * 2;
  __shared__ float warp_max[WARPS];
  __shared__ int64_t experts_of[16];
  const PersistentWarp me(WARPS, units);
  const int lane = me.lane, stride = me.stride, first = me.first, iters = me.iters;
  const int slots = units / I, scale_columns = (C + 7) / 8, scale_rows = (2 * I + 127) / 128;
  wait_previous();
  if (threadIdx.x < slots) experts_of[threadIdx.x] = experts[threadIdx.x];
  __syncthreads();
  const uint64_t policy = evict_first();
  clear_past_row<STAGES, CPL, ROWS, THREADS>(ring, lane, C);
  ChunkScales<ROWS, CPL> meta[STAGES];
  Unit in_ring[STAGES], next{first / I, first % I};
  auto issue = [&](int stage, int n) {  // called for n = 0, 1, ... in order: `next` is unit n
    in_ring[stage] = next;
    if (n < iters) {
      const int64_t e = experts_of[next.slot], gate = e * 2 * I + next.column, up = gate + I;
      const uint4* r[2] = {blocks + gate * C, blocks + up * C};
      const float* base = scales + e * scale_rows * scale_columns;
      const float* s[2] = {base + (next.column / 128) * scale_columns,
                           base + ((I + next.column) / 128) * scale_columns};
      copy_rows8<ROWS, CPL, THREADS>(ring + stage * WORDS * THREADS, meta[stage], r, s, lane, C, policy);
    }
    commit_copies();
    next.advance(stride, I);
  };
#pragma unroll
  for (int d = 0; d < STAGES - 1; ++d) issue(d, d);
  const float unscale = stage8(x, C * 16, xs, threadIdx.x, THREADS, warp_max, false);
  __syncthreads();
  let_next();
  staged_loop<STAGES>(iters, issue, [&](int d, int) {
    float dots[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
      dots[j] = staged_row_dot8<ROWS, CPL, THREADS>(ring + d * WORDS * THREADS, meta[d], j, xs, lane, C);
    const float sum = lane_sums<ROWS>(dots, lane), up_sum = __shfl_down_sync(0xffffffffu, sum, 16);
    const float gate = sum * unscale, up = up_sum * unscale;
    if (lane == 0) h[(int64_t)in_ring[d].slot * I + in_ring[d].column] = __fdividef(gate, 1.f + __expf(-gate)) * up;
  });
}

// FP8 down by expert (fp8_down_kernel) through the ring
template <int STAGES, int ROWS, int TOPK, int CPL>
__global__ void __launch_bounds__(TOPK * 32) fp8_down_async_kernel(
    const float* __restrict__ h, const uint4* __restrict__ blocks, const float* __restrict__ scales,
    const int64_t* __restrict__ experts, RoutingWeights weights, __nv_bfloat16* __restrict__ out, int H, int C) {
  constexpr int WORDS = ROWS * CPL, THREADS = TOPK * 32;
  extern __shared__ uint4 xs[];  // TOPK x C x 2 quads, then the ring
  uint4* ring = xs + TOPK * C * 2;
  __shared__ float partial[2][TOPK][ROWS];
  const int lane = threadIdx.x & 31, k = threadIdx.x >> 5;
  const int batches = (H + ROWS - 1) / ROWS;
  const int iters = int(blockIdx.x) < batches ? (batches - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int scale_columns = (C + 7) / 8, scale_rows = (H + 127) / 128;
  const int64_t e = experts[k];
  const uint64_t policy = evict_first();
  clear_past_row<STAGES, CPL, ROWS, THREADS>(ring, lane, C);
  ChunkScales<ROWS, CPL> meta[STAGES];
  auto issue = [&](int stage, int n) {  // the CTA's n-th batch
    if (n < iters) {
      const uint4* r[ROWS];
      const float* s[ROWS];
#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        const int row = min((int(blockIdx.x) + n * int(gridDim.x)) * ROWS + j, H - 1);
        r[j] = blocks + (e * H + row) * C;
        s[j] = scales + (e * scale_rows + row / 128) * scale_columns;
      }
      copy_rows8<ROWS, CPL, THREADS>(ring + stage * WORDS * THREADS, meta[stage], r, s, lane, C, policy);
    }
    commit_copies();
  };
#pragma unroll
  for (int d = 0; d < STAGES - 1; ++d) issue(d, d);
  wait_previous();  // gate/up's activations
  uint4* mine = xs + k * C * 2;
  const float unscale = stage8(h + (int64_t)k * C * 16, C * 16, mine, lane, 32, nullptr, true);
  __syncwarp();
  let_next();
  const float scale = weights[k] * unscale;
  staged_loop<STAGES>(iters, issue, [&](int d, int n) {
    float acc[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
      acc[j] = staged_row_dot8<ROWS, CPL, THREADS>(ring + d * WORDS * THREADS, meta[d], j, mine, lane, C);
    const float sum = lane_sums<ROWS>(acc, lane);
    sum_slots<ROWS, TOPK>(partial, scale * sum, n, true, blockIdx.x + n * gridDim.x, k, lane, H, out);
  });
}

template <int STAGES, int MIN_CTAS>
auto gate_up_async_mode(int64_t mode) {
  return mode == 1 ? gate_up_async_kernel<STAGES, MIN_CTAS, 1> : gate_up_async_kernel<STAGES, MIN_CTAS, 0>;
}

template <int STAGES>
auto gate_up_async_for(int64_t mode, int64_t ctas1) {
  return ctas1 >= 3 ? gate_up_async_mode<STAGES, 3>(mode) : gate_up_async_mode<STAGES, 2>(mode);
}

// gate/up as `mode` asks (0: whole, 1: loads only, 2: decode only), registers capped for `ctas1` CTAs per SM (up to
// 3; offline: COLS 1 needs 95 registers uncapped, 79 at 3 CTAs; COLS 2 146, 127 at 2 CTAs, spills at 3)
template <int DEPTH1, int COLS, int MIN_CTAS>
auto gate_up_mode(int64_t mode) {
  return mode == 1 ? gate_up_kernel<WARPS, DEPTH1, 1, MIN_CTAS, COLS> : mode == 2
         ? gate_up_kernel<WARPS, DEPTH1, 2, MIN_CTAS, COLS> : gate_up_kernel<WARPS, DEPTH1, 0, MIN_CTAS, COLS>;
}

template <int DEPTH1, int COLS>
auto gate_up_for(int64_t mode, int64_t ctas1) {
  return ctas1 >= 3 ? gate_up_mode<DEPTH1, COLS, 3>(mode) : ctas1 == 2 ? gate_up_mode<DEPTH1, COLS, 2>(mode)
         : gate_up_mode<DEPTH1, COLS, 1>(mode);
}

template <int DEPTH1, int DEPTH2>
void moe_config(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor b1, torch::Tensor w2,
                torch::Tensor s2, torch::Tensor b2, torch::Tensor experts, torch::Tensor weights, torch::Tensor h,
                torch::Tensor out, double alpha, double limit, int64_t paired_shift, int64_t ctas1, int64_t ctas2,
                int64_t rows, int64_t cols, int64_t stages, int64_t stages2, int64_t parts, bool pdl, int64_t mode) {
  constexpr int TOPK = 4;
  const int I = w1.size(1) / 2, G = w1.size(2), H = w2.size(1);
  const int sms = multiprocessors();
  auto gate_up = cols == 2 ? gate_up_for<DEPTH1, 2>(mode, ctas1) : gate_up_for<DEPTH1, 1>(mode, ctas1);
  const int units = TOPK * I / cols;
  const int64_t gate_up_ctas = std::min<int64_t>(sms * ctas1, (units + WARPS - 1) / WARPS);
  if ((parts & 1) && stages) {
    auto async = stages == 2 ? gate_up_async_for<2>(mode, ctas1) : stages == 3 ? gate_up_async_for<3>(mode, ctas1)
                                                                  : gate_up_async_for<4>(mode, ctas1);
    const int smem = ring_bytes(activation_bytes(G), stages, 2 * 3, WARPS * 32);
    launch(async, dim3(gate_up_ctas), dim3(WARPS * 32), smem, pdl,
           (const __nv_bfloat16*)x.data_ptr(), (const uint4*)w1.data_ptr(), (const uint8_t*)s1.data_ptr(),
           (const __nv_bfloat16*)b1.data_ptr(), (const int64_t*)experts.data_ptr(), (__half*)h.data_ptr(), I, G,
           units, float(alpha), float(limit), int(paired_shift));
  } else if (parts & 1)
    launch(gate_up, dim3(gate_up_ctas), dim3(WARPS * 32), activation_bytes(G), pdl,
           (const __nv_bfloat16*)x.data_ptr(), (const uint4*)w1.data_ptr(), (const uint8_t*)s1.data_ptr(),
           (const __nv_bfloat16*)b1.data_ptr(), (const int64_t*)experts.data_ptr(), (__half*)h.data_ptr(), I, G,
           units, float(alpha), float(limit), int(paired_shift));
  auto down = rows == 2 ? down_by_expert_kernel<DEPTH2, 2, TOPK> : down_by_expert_kernel<DEPTH2, 4, TOPK>;
  const int64_t down_ctas = std::min<int64_t>(sms * ctas2, (H + rows - 1) / rows);
  if ((parts & 2) && stages2) {
    auto async = rows == 2 ? (stages2 == 2 ? down_async_kernel<2, 2> : down_async_kernel<3, 2>)
                           : (stages2 == 2 ? down_async_kernel<2, 4> : down_async_kernel<3, 4>);
    const int smem = ring_bytes(TOPK * activation_bytes(G), stages2, rows * 3, TOPK * 32);
    launch(async, dim3(down_ctas), dim3(TOPK * 32), smem, pdl, (const __half*)h.data_ptr(),
           (const uint4*)w2.data_ptr(), (const uint8_t*)s2.data_ptr(),
           (const __nv_bfloat16*)b2.data_ptr(), (const int64_t*)experts.data_ptr(), routing_weights(weights),
           (__nv_bfloat16*)out.data_ptr(), H, G, int(paired_shift));
  } else if (parts & 2)
    launch(down, dim3(down_ctas), dim3(TOPK * 32), TOPK * activation_bytes(G), pdl,
           (const __half*)h.data_ptr(), (const uint4*)w2.data_ptr(), (const uint8_t*)s2.data_ptr(),
           (const __nv_bfloat16*)b2.data_ptr(), (const int64_t*)experts.data_ptr(), routing_weights(weights),
           (__nv_bfloat16*)out.data_ptr(), H, G, int(paired_shift));
}

void moe(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor b1, torch::Tensor w2, torch::Tensor s2,
         torch::Tensor b2, torch::Tensor experts, torch::Tensor weights, torch::Tensor h, torch::Tensor out,
         double alpha, double limit, int64_t paired_shift, int64_t depth1, int64_t depth2, int64_t ctas1,
         int64_t ctas2, int64_t rows, int64_t cols, int64_t stages, int64_t stages2, int64_t parts, bool pdl,
         int64_t mode) {
  TORCH_CHECK(w1.size(2) <= 96 && w2.size(2) <= 96, "the probe's kernels take 3 groups a lane: K <= 3072");
  TORCH_CHECK(stages == 0 || (stages >= 2 && stages <= 4 && cols == 1 && mode != 2),
              "gate/up's shared-memory ring: 2 to 4 stages, one column a unit, no decode-only mode");
  TORCH_CHECK(stages2 == 0 || stages2 == 2 || stages2 == 3, "down's shared-memory ring: 2 or 3 stages");
  TORCH_CHECK(rows == 2 || rows == 4, "down rows per batch: 2 or 4");
  TORCH_CHECK((cols == 1 || cols == 2) && w1.size(1) / 2 % cols == 0, "gate/up columns per unit: 1 or 2, dividing I");
#define CASE(A, B) \
  if (depth1 == A && depth2 == B) \
    return moe_config<A, B>(x, w1, s1, b1, w2, s2, b2, experts, weights, h, out, alpha, limit, paired_shift, ctas1, \
                            ctas2, rows, cols, stages, stages2, parts, pdl, mode);
  CASE(1, 1) CASE(1, 2)
  TORCH_CHECK(false, "no such config");
}

// one token's SiLU MXFP4 layer, Qwen3-30B-A3B's shape (K 2048: 2 groups a lane; I 768: 1), as the library's
// mxfp4_layer<8, false> launches it but for the depths, CTAs per SM and down rows
template <int DEPTH2, int ROWS>
void moe_silu_config(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor w2, torch::Tensor s2,
                     torch::Tensor experts, torch::Tensor weights, torch::Tensor h, torch::Tensor out, int64_t ctas1,
                     int64_t ctas2, int64_t parts, bool pdl) {
  constexpr int TOPK = 8;
  const int I = w1.size(1) / 2, G = w1.size(2), H = w2.size(1), G2 = w2.size(2);
  const int sms = multiprocessors();
  const int64_t gate_up_ctas = std::min<int64_t>(sms * ctas1, (TOPK * I + WARPS - 1) / WARPS);
  if (parts & 1)
    launch(gate_up_kernel<WARPS, 1, 0, 1, 1, false, 2>, dim3(gate_up_ctas), dim3(WARPS * 32), activation_bytes(G),
           pdl, (const __nv_bfloat16*)x.data_ptr(), (const uint4*)w1.data_ptr(), (const uint8_t*)s1.data_ptr(),
           (const __nv_bfloat16*)nullptr, (const int64_t*)experts.data_ptr(), (float*)h.data_ptr(), I, G, TOPK * I,
           1.f, 0.f, 0);
  const int64_t down_ctas = std::min<int64_t>(sms * ctas2, (H + ROWS - 1) / ROWS);
  if (parts & 2)
    launch(down_by_expert_kernel<DEPTH2, ROWS, TOPK, float, 1>, dim3(down_ctas), dim3(TOPK * 32),
           TOPK * activation_bytes(G2), pdl, (const float*)h.data_ptr(), (const uint4*)w2.data_ptr(),
           (const uint8_t*)s2.data_ptr(), (const __nv_bfloat16*)nullptr, (const int64_t*)experts.data_ptr(),
           routing_weights(weights), (__nv_bfloat16*)out.data_ptr(), H, G2, 0);
}

void moe_silu(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor w2, torch::Tensor s2,
              torch::Tensor experts, torch::Tensor weights, torch::Tensor h, torch::Tensor out, int64_t depth2,
              int64_t ctas1, int64_t ctas2, int64_t rows, int64_t parts, bool pdl) {
  TORCH_CHECK(w1.size(2) > 32 && w1.size(2) <= 64 && w2.size(2) <= 32 && experts.numel() == 8,
              "the SiLU probe takes 33-64 groups (gate/up), up to 32 (down) and top-8");
#define CASES(D, R) \
  if (depth2 == D && rows == R) \
    return moe_silu_config<D, R>(x, w1, s1, w2, s2, experts, weights, h, out, ctas1, ctas2, parts, pdl);
  CASES(1, 2) CASES(1, 4) CASES(2, 2) CASES(2, 4)
  TORCH_CHECK(false, "no such SiLU config (depth2, rows)");
}

// one token's FP8 layer: gate/up (CPL 4: K <= 2048) then down by expert (TOPK 8, CPL 2: I <= 1024)
template <int DEPTH1, int DEPTH2, int ROWS>
void moe_fp8_config(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor w2, torch::Tensor s2,
                    torch::Tensor experts, torch::Tensor weights, torch::Tensor h, torch::Tensor out, int64_t ctas1,
                    int64_t ctas2, int64_t stages1, int64_t stages2, int64_t parts, bool pdl) {
  constexpr int TOPK = 8;
  const int I = w1.size(1) / 2, C1 = w1.size(2) / 16, H = w2.size(1), C2 = w2.size(2) / 16;
  const int sms = multiprocessors();
  const int64_t gate_up_ctas = std::min<int64_t>(sms * ctas1, (TOPK * I + WARPS - 1) / WARPS);
  auto gate_up = stages1 == 0 ? fp8_gate_up_kernel<WARPS, DEPTH1, 4>
                 : stages1 == 2 ? fp8_gate_up_async_kernel<2, 4> : fp8_gate_up_async_kernel<3, 4>;
  if (parts & 1)
    launch(gate_up, dim3(gate_up_ctas), dim3(WARPS * 32), ring_bytes(C1 * 2 * 16, stages1, 2 * 4, WARPS * 32), pdl,
           (const __nv_bfloat16*)x.data_ptr(), (const uint4*)w1.data_ptr(), (const float*)s1.data_ptr(),
           (const int64_t*)experts.data_ptr(), (float*)h.data_ptr(), I, C1, TOPK * I);
  const int64_t down_ctas = std::min<int64_t>(sms * ctas2, (H + ROWS - 1) / ROWS);
  auto down = stages2 == 0 ? fp8_down_kernel<DEPTH2, ROWS, TOPK, 2>
              : stages2 == 2 ? fp8_down_async_kernel<2, ROWS, TOPK, 2> : fp8_down_async_kernel<3, ROWS, TOPK, 2>;
  if (parts & 2)
    launch(down, dim3(down_ctas), dim3(TOPK * 32), ring_bytes(TOPK * C2 * 2 * 16, stages2, ROWS * 2, TOPK * 32), pdl,
           (const float*)h.data_ptr(), (const uint4*)w2.data_ptr(), (const float*)s2.data_ptr(),
           (const int64_t*)experts.data_ptr(), routing_weights(weights), (__nv_bfloat16*)out.data_ptr(), H,
           C2);
}

void moe_fp8(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor w2, torch::Tensor s2,
             torch::Tensor experts, torch::Tensor weights, torch::Tensor h, torch::Tensor out, int64_t depth1,
             int64_t depth2, int64_t ctas1, int64_t ctas2, int64_t rows, int64_t stages1, int64_t stages2,
             int64_t parts, bool pdl) {
  TORCH_CHECK(w1.size(2) <= 16 * 32 * 4 && w2.size(2) <= 16 * 32 * 2 && experts.numel() == 8,
              "the FP8 probe takes K <= 2048, I <= 1024 and top-8");
  TORCH_CHECK(stages1 >= 0 && stages1 <= 3 && stages1 != 1 && stages2 >= 0 && stages2 <= 3 && stages2 != 1,
              "the FP8 shared-memory rings: 2 or 3 stages (0: registers)");
#define CASE8(A, B, R) \
  if (depth1 == A && depth2 == B && rows == R) \
    return moe_fp8_config<A, B, R>(x, w1, s1, w2, s2, experts, weights, h, out, ctas1, ctas2, stages1, stages2, \
                                   parts, pdl);
  CASE8(1, 1, 2) CASE8(1, 1, 4) CASE8(2, 1, 2) CASE8(1, 2, 2) CASE8(2, 2, 2)
  TORCH_CHECK(false, "no such FP8 config (depth1, depth2, rows)");
}
"""

CPP = ("void moe(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor b1, torch::Tensor w2, "
       "torch::Tensor s2, torch::Tensor b2, torch::Tensor experts, torch::Tensor weights, torch::Tensor h, "
       "torch::Tensor out, double alpha, double limit, int64_t paired_shift, int64_t depth1, int64_t depth2, "
       "int64_t ctas1, int64_t ctas2, int64_t rows, int64_t cols, int64_t stages, int64_t stages2, int64_t parts, "
       "bool pdl, int64_t mode);\n"
       "void moe_fp8(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor w2, torch::Tensor s2, "
       "torch::Tensor experts, torch::Tensor weights, torch::Tensor h, torch::Tensor out, int64_t depth1, "
       "int64_t depth2, int64_t ctas1, int64_t ctas2, int64_t rows, int64_t stages1, int64_t stages2, int64_t parts, "
       "bool pdl);\n"
       "void moe_silu(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor w2, torch::Tensor s2, "
       "torch::Tensor experts, torch::Tensor weights, torch::Tensor h, torch::Tensor out, int64_t depth2, "
       "int64_t ctas1, int64_t ctas2, int64_t rows, int64_t parts, bool pdl);")

ALPHA, LIMIT, PAIRED_SHIFT = 1.702, 7.0, 9  # gpt-oss' clamped SwiGLU; its outputs times 2^9 stay in fp16
PROBED = ("gpt-oss-20b", "qwen3-30b-a3b-fp8", "qwen3-30b-a3b-mxfp4")


def parse_config(text: str) -> tuple[int, ...]:
    """DEPTH1,DEPTH2,CTAS1,CTAS2[,ROWS[,COLS[,STAGES1[,STAGES2]]]] -> the eight ints `moe` takes before its parts
    (ROWS 2, COLS 1, STAGES1 and STAGES2 0 when left out; `moe_fp8` takes the first five)."""
    values = tuple(map(int, text.split(",")))
    return values + (2, 1, 0, 0)[len(values) - 4:]


def register_ring(config: tuple[int, ...]) -> tuple[int, ...]:
    """The config with gate/up's weights through registers (STAGES1 0): its decode-only mode has no loads to stage."""
    return config[:6] + (0,) + config[7:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=PROBED, default="gpt-oss-20b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ncu", action="store_true", help="a few plain calls of the first config, for a profiler")
    parser.add_argument("--configs", nargs="+", default=["1,1,2,3,4", "1,2,2,3,2"],
                        help="DEPTH1,DEPTH2,CTAS1,CTAS2[,ROWS[,COLS[,STAGES1[,STAGES2]]]]: units in flight per warp "
                             "and CTAs per SM (gate/up, down), the down kernel's rows per batch (2 or 4; default 2), "
                             "gate/up's columns per unit (1 or 2; default 1), gate/up's and down's weights through a "
                             "shared-memory ring of STAGES units (2-3, gpt-oss's gate/up 2-4; default 0: registers)")
    args = parser.parse_args()
    module = load_inline("probe_cuda_rows", CPP, cuda_sources=CUDA, functions=["moe", "moe_fp8", "moe_silu"],
                         extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo", "-Xptxas=-v"],
                         verbose=True)  # ptxas' registers and spills
    experts, top_k, hidden, inter, format, gpt_oss = SHAPES[args.shape]
    activation = "clamped_swiglu" if gpt_oss else "silu"
    torch.manual_seed(0)
    layers = [(random_packed(format, experts, 2 * inter, hidden, gpt_oss),
               random_packed(format, experts, hidden, inter, gpt_oss)) for _ in range(args.layers)]
    index = random_routing(1, experts, top_k)
    weights = torch.softmax(torch.randn(1, top_k, device="cuda"), dim=-1)
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    h = torch.empty(top_k, inter, device="cuda", dtype=torch.float16 if gpt_oss else torch.float32)
    out = torch.empty(1, hidden, device="cuda", dtype=torch.bfloat16)
    flat_index, flat_weights = index.reshape(-1).contiguous(), weights.reshape(-1).contiguous()

    def probe(gate_up, down, config, parts=3, pdl=True, mode=0):
        if gpt_oss:
            module.moe(x, gate_up.data, gate_up.scales, gate_up.bias, down.data, down.scales, down.bias, flat_index,
                       flat_weights, h, out, ALPHA, LIMIT, PAIRED_SHIFT, *config, parts, pdl, mode)
        elif format == "mxfp4":  # DEPTH1 is 1 here
            module.moe_silu(x, gate_up.data, gate_up.scales, down.data, down.scales, flat_index, flat_weights, h, out,
                            *config[1:5], parts, pdl)
        else:
            module.moe_fp8(x, gate_up.data, gate_up.scales, down.data, down.scales, flat_index, flat_weights, h, out,
                           *config[:5], *config[6:8], parts, pdl)
        return out

    def library(gate_up, down):
        gate = dict(alpha=ALPHA, limit=LIMIT) if gpt_oss else {}
        return fused_moe(x, index, weights, gate_up, down, interleaved=gpt_oss, activation=activation, **gate)

    if args.ncu:
        config = parse_config(args.configs[0])
        for mode in (0, 1, 2) if gpt_oss else (0,):
            for g, d in layers:
                probe(g, d, register_ring(config) if mode == 2 else config, parts=3 if mode == 0 else 1, mode=mode)
        torch.cuda.synchronize()
        return
    expected = reference(x, index, weights, *layers[0], gpt_oss, activation)
    error = lambda got: ((got.double() - expected).norm() / expected.norm()).item()  # noqa: E731
    moved = top_k * sum(expert_bytes(weight) for weight in layers[0])
    copy = copy_bandwidth() / 1e9
    read_us = read_time_us(moved, args.layers)
    library_us = graph_time_us([lambda g=g, d=d: library(g, d) for g, d in layers])
    print(f"device {torch.cuda.get_device_name()}, copy {copy:.0f} GB/s; {args.shape}: {moved / 1e6:.1f} MB per "
          f"call; one read {read_us:.1f} us ({moved / read_us / 1e3 / copy:.0%})", flush=True)
    print(f"library fused_moe {library_us:.1f} us ({moved / library_us / 1e3 / copy:.0%} of copy), "
          f"err {error(library(*layers[0])):.1e}", flush=True)
    for config in args.configs:
        config = parse_config(config)
        err = error(probe(*layers[0], config))
        both = graph_time_us([lambda g=g, d=d: probe(g, d, config) for g, d in layers])
        no_pdl = graph_time_us([lambda g=g, d=d: probe(g, d, config, pdl=False) for g, d in layers])
        first = graph_time_us([lambda g=g, d=d: probe(g, d, config, parts=1) for g, d in layers])
        second = graph_time_us([lambda g=g, d=d: probe(g, d, config, parts=2) for g, d in layers])
        print(f"depths, CTAs per SM {config}: {both:6.1f} us ({moved / both / 1e3 / copy:.0%} of copy, "
              f"{library_us / both:.2f}x library), no PDL {no_pdl:6.1f}, gate/up alone {first:6.1f}, "
              f"down alone {second:6.1f}; err {err:.1e}", flush=True)
        if gpt_oss:
            loads = graph_time_us([lambda g=g, d=d: probe(g, d, config, parts=1, mode=1) for g, d in layers])
            decode = graph_time_us([lambda g=g, d=d: probe(g, d, register_ring(config), parts=1, mode=2)
                                    for g, d in layers])
            print(f"    gate/up loads only {loads:6.1f} us, decode only {decode:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
