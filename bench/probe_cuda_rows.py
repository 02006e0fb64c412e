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
- bulk copies (`--bulk`, gpt-oss' layout or FP8's, `moe_bulk`): the same arithmetic, but each CTA's weights
  come through a shared-memory ring of STAGES tiles that one producer thread fills by `cp.async.bulk` (an mbarrier
  a stage for "landed" and one for "read"), so the bytes in flight an SM no longer hang on the warps' registers
  (the row kernels' Nsight profile: latency-bound, global-load waits the largest stall). gate/up: a tile is
  CONSUMERS columns of one slot, a consumer warp a column; down: a tile is CONSUMERS output rows of every slot's
  expert, a consumer warp an output row over the slots, added in slot order in the warp.
- `--configs` DEPTH1,DEPTH2,CTAS1,CTAS2[,ROWS[,COLS]] (gate/up, down; ROWS 2 or 4, default 2; COLS 1 or 2, default
  1; gate/up's registers capped for CTAS1 CTAs per SM, up to 3); each also timed with gate/up's
  loads alone (no decode) and its decode alone (words made up, no loads). `--ncu`: a few plain calls for a
  profiler.

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
                int64_t rows, int64_t cols, int64_t parts, bool pdl, int64_t mode) {
  constexpr int TOPK = 4;
  const int I = w1.size(1) / 2, G = w1.size(2), H = w2.size(1);
  const int sms = multiprocessors();
  auto gate_up = cols == 2 ? gate_up_for<DEPTH1, 2>(mode, ctas1) : gate_up_for<DEPTH1, 1>(mode, ctas1);
  const int units = TOPK * I / cols;
  const int64_t gate_up_ctas = std::min<int64_t>(sms * ctas1, (units + WARPS - 1) / WARPS);
  if (parts & 1)
    launch(gate_up, dim3(gate_up_ctas), dim3(WARPS * 32), activation_bytes(G), pdl,
           (const __nv_bfloat16*)x.data_ptr(), (const uint4*)w1.data_ptr(), (const uint8_t*)s1.data_ptr(),
           (const __nv_bfloat16*)b1.data_ptr(), (const int64_t*)experts.data_ptr(), (__half*)h.data_ptr(), I, G,
           units, float(alpha), float(limit), int(paired_shift));
  auto down = rows == 2 ? down_by_expert_kernel<DEPTH2, 2, TOPK> : down_by_expert_kernel<DEPTH2, 4, TOPK>;
  const int64_t down_ctas = std::min<int64_t>(sms * ctas2, (H + rows - 1) / rows);
  if (parts & 2)
    launch(down, dim3(down_ctas), dim3(TOPK * 32), TOPK * activation_bytes(G), pdl,
           (const __half*)h.data_ptr(), (const uint4*)w2.data_ptr(), (const uint8_t*)s2.data_ptr(),
           (const __nv_bfloat16*)b2.data_ptr(), (const int64_t*)experts.data_ptr(), routing_weights(weights),
           (__nv_bfloat16*)out.data_ptr(), H, G, int(paired_shift));
}

void moe(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor b1, torch::Tensor w2, torch::Tensor s2,
         torch::Tensor b2, torch::Tensor experts, torch::Tensor weights, torch::Tensor h, torch::Tensor out,
         double alpha, double limit, int64_t paired_shift, int64_t depth1, int64_t depth2, int64_t ctas1,
         int64_t ctas2, int64_t rows, int64_t cols, int64_t parts, bool pdl, int64_t mode) {
  TORCH_CHECK(w1.size(2) <= 96 && w2.size(2) <= 96, "the probe's kernels take 3 groups a lane: K <= 3072");
  TORCH_CHECK(rows == 2 || rows == 4, "down rows per batch: 2 or 4");
  TORCH_CHECK((cols == 1 || cols == 2) && w1.size(1) / 2 % cols == 0, "gate/up columns per unit: 1 or 2, dividing I");
#define CASE(A, B) \
  if (depth1 == A && depth2 == B) \
    return moe_config<A, B>(x, w1, s1, b1, w2, s2, b2, experts, weights, h, out, alpha, limit, paired_shift, ctas1, \
                            ctas2, rows, cols, parts, pdl, mode);
  CASE(1, 1) CASE(1, 2)
  TORCH_CHECK(false, "no such config");
}

// ---- the bulk-copy variant: weights staged into a shared-memory ring by cp.async.bulk ----
// One producer thread a CTA copies each tile (contiguous rows of an expert, and their scales) by bulk copies,
// STAGES tiles in flight, an mbarrier a stage completing when its bytes land (`full`) and one when the consumer
// warps are done with it (`empty`); the consumer warps read their rows' words from shared memory, not registers, so
// the bytes in flight an SM are STAGES tiles whatever the warps' registers.
__device__ __forceinline__ uint32_t shared_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void barrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void barrier_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}
__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile("{\n.reg .pred done;\nwaiting:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               "@!done bra waiting;\n}" ::"r"(shared_address(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(shared_address(dst)), "l"(src), "r"(bytes), "r"(shared_address(bar)) : "memory");
}

// bytes [first, first + n) of `src` (no 16-byte multiples: a row of 90 scales, of 6 fp32 block scales) copied from
// the 16-byte boundary below into `dst`, which holds `capacity(n)`; they start `first & 15` bytes in. Returns the
// bytes copied.
__host__ __device__ constexpr int capacity(int n) { return (n + 45) & ~15; }
__device__ __forceinline__ uint32_t copy_unaligned(uint8_t* dst, const uint8_t* src, int64_t first, int n,
                                                   uint64_t* bar) {
  const int64_t start = first & ~int64_t(15), end = (first + n + 15) & ~int64_t(15);
  bulk_load(dst, src + start, uint32_t(end - start), bar);
  return uint32_t(end - start);
}

// The ring of a CTA of CONSUMERS consumer warps and a producer warp after them. `fill(i, bar)` issues tile i's
// copies into stage i % STAGES and returns their bytes; the producer primes the first STAGES tiles (`prime`, before
// the CTA stages its activations) and refills each stage once its consumers release it (`refill`).
template <int STAGES, int CONSUMERS>
struct BulkRing {
  uint64_t full[STAGES], empty[STAGES];
  __device__ void init() {  // thread 0, then a CTA barrier
    for (int s = 0; s < STAGES; ++s) barrier_init(&full[s], 1), barrier_init(&empty[s], CONSUMERS);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  template <typename Fill>
  __device__ void issue(int i, Fill fill) { barrier_expect(&full[i % STAGES], fill(i, &full[i % STAGES])); }
  template <typename Fill>
  __device__ void prime(int iters, Fill fill) {
    if (threadIdx.x == CONSUMERS * 32)
      for (int i = 0; i < min(STAGES, iters); ++i) issue(i, fill);
  }
  template <typename Fill>
  __device__ void refill(int iters, Fill fill) {
    if (threadIdx.x == CONSUMERS * 32)
      for (int i = STAGES; i < iters; ++i) {
        barrier_wait(&empty[i % STAGES], (i / STAGES - 1) & 1);
        issue(i, fill);
      }
  }
  __device__ void acquire(int i) { barrier_wait(&full[i % STAGES], (i / STAGES) & 1); }
  __device__ void release(int i, int lane) {
    __syncwarp();
    if (lane == 0) barrier_arrive(&empty[i % STAGES]);
  }
};

__device__ __forceinline__ int ring_iters(int tiles) {
  return int(blockIdx.x) < tiles ? (tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
}

// ---- MXFP4 (gpt-oss' layout). A part: `rows` rows of G groups, their codes then their scales ----
__host__ __device__ constexpr int part_bytes(int rows, int G) { return rows * G * 16 + capacity(rows * G); }

__device__ __forceinline__ uint32_t copy_part(uint8_t* part, const uint8_t* blocks, const uint8_t* scales,
                                              int64_t row, int rows, int G, uint64_t* bar) {
  bulk_load(part, blocks + row * G * 16, rows * G * 16, bar);
  return rows * G * 16 + copy_unaligned(part + rows * G * 16, scales, row * G, rows * G, bar);
}

// row j's dot from a part staged from row `row`, the bias in lane j's share
template <int GPL>
__device__ __forceinline__ float staged_row_dot(const uint8_t* part, int64_t row, int rows, int j, const uint4* xs,
                                                int lane, int G, float bias) {
  const uint4* w = reinterpret_cast<const uint4*>(part) + j * G;
  const uint8_t* e = part + rows * G * 16 + ((row * G) & 15) + j * G;
  return bias + lane_dot<GPL>([&](int i) {
    const int g = lane + 32 * i, in_row = min(g, G - 1);
    return group_dot(w[in_row], xs, in_row, g < G ? e[in_row] : uint8_t(0));
  });
}

// gate/up: a tile is CONSUMERS columns of one slot (their 2 CONSUMERS interleaved gate and up rows), consumer warp w
// column w; clamped SwiGLU, fp16 out times 2^paired_shift in pair order (as gate_up_kernel)
template <int CONSUMERS, int STAGES, int GPL>
__global__ void __launch_bounds__((CONSUMERS + 1) * 32, 1) gate_up_bulk_kernel(
    const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ blocks, const uint8_t* __restrict__ scales,
    const __nv_bfloat16* __restrict__ bias, const int64_t* __restrict__ experts, __half* __restrict__ h, int I,
    int G, int slots, float alpha, float limit, int paired_shift) {
  constexpr int ROWS = 2 * CONSUMERS;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ BulkRing<STAGES, CONSUMERS> ring;
  __shared__ float warp_max[CONSUMERS + 1];
  __shared__ int expert_rows[8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, stage_bytes = part_bytes(ROWS, G);
  uint4* xs = reinterpret_cast<uint4*>(smem + STAGES * stage_bytes);
  const int per_slot = 2 * I / ROWS, iters = ring_iters(slots * per_slot);
  if (threadIdx.x == 0) ring.init();
  wait_previous();
  if (threadIdx.x < slots) expert_rows[threadIdx.x] = int(experts[threadIdx.x]) * 2 * I;
  __syncthreads();
  auto tile = [&](int i) { return int(blockIdx.x + i * gridDim.x); };
  auto tile_row = [&](int i) { return expert_rows[tile(i) / per_slot] + (tile(i) % per_slot) * ROWS; };
  auto fill = [&](int i, uint64_t* bar) {
    return copy_part(smem + i % STAGES * stage_bytes, blocks, scales, tile_row(i), ROWS, G, bar);
  };
  ring.prime(iters, fill);
  const int shift = stage_activations(x, G * 32, xs, warp_max, CONSUMERS + 1);
  __syncthreads();
  let_next();
  if (warp == CONSUMERS) return ring.refill(iters, fill);
  const float unscale = exp2i(14 - shift), bias_scale = exp2i(shift - 14), out_scale = exp2i(paired_shift);
  for (int i = 0; i < iters; ++i) {
    const int row = tile_row(i);
    const float b = lane < 2 ? __bfloat162float(bias[row + 2 * warp + lane]) * bias_scale : 0.f;
    ring.acquire(i);
    float dots[2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
      dots[j] = staged_row_dot<GPL>(smem + i % STAGES * stage_bytes, row, ROWS, 2 * warp + j, xs, lane, G,
                                    lane == j ? b : 0.f);
    ring.release(i, lane);
    const float sum = lane_sums<2>(dots, lane), up_sum = __shfl_down_sync(0xffffffffu, sum, 16);
    if (lane == 0)
      h[tile(i) / per_slot * I + paired_column(tile(i) % per_slot * CONSUMERS + warp)] =
          __float2half_rn(clamped_swiglu(sum * unscale, up_sum * unscale, alpha, limit) * out_scale);
  }
}

// down: a tile is CONSUMERS output rows, every slot's expert's CONSUMERS rows there (TOPK parts), consumer warp w
// output row w over the TOPK slots, weighted and added in slot order in the warp
template <int CONSUMERS, int STAGES, int TOPK, int GPL>
__global__ void __launch_bounds__((CONSUMERS + 1) * 32, 1) down_bulk_kernel(
    const __half* __restrict__ h, const uint8_t* __restrict__ blocks, const uint8_t* __restrict__ scales,
    const __nv_bfloat16* __restrict__ bias, const int64_t* __restrict__ experts, RoutingWeights weights,
    __nv_bfloat16* __restrict__ out, int H, int G, int paired_shift) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ BulkRing<STAGES, CONSUMERS> ring;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = part_bytes(CONSUMERS, G);
  const int stage_bytes = TOPK * part, iters = ring_iters(H / CONSUMERS);
  uint4* xs = reinterpret_cast<uint4*>(smem + STAGES * stage_bytes);  // TOPK x G padded quads
  if (threadIdx.x == 0) ring.init();
  __syncthreads();
  auto first_row = [&](int i) { return int(blockIdx.x + i * gridDim.x) * CONSUMERS; };
  auto fill = [&](int i, uint64_t* bar) {
    uint32_t bytes = 0;
#pragma unroll
    for (int k = 0; k < TOPK; ++k)
      bytes += copy_part(smem + i % STAGES * stage_bytes + k * part, blocks, scales, experts[k] * H + first_row(i),
                         CONSUMERS, G, bar);
    return bytes;
  };
  ring.prime(iters, fill);  // the routing is the previous launch's input: already there
  wait_previous();  // gate/up's activations
  const uint4* hq = reinterpret_cast<const uint4*>(h);
  for (int q = threadIdx.x; q < TOPK * G * 4; q += (CONSUMERS + 1) * 32)
    xs[q / (G * 4) * G * QUADS + quad(q % (G * 4) / 4, q % 4)] = hq[q];
  __syncthreads();
  let_next();
  if (warp == CONSUMERS) return ring.refill(iters, fill);
  const float bias_scale = exp2i(paired_shift - 14);
  float slot_scale[TOPK];
  int64_t expert_row[TOPK];
#pragma unroll
  for (int k = 0; k < TOPK; ++k) slot_scale[k] = weights[k] * exp2i(14 - paired_shift), expert_row[k] = experts[k] * H;
  for (int i = 0; i < iters; ++i) {
    const int n = first_row(i) + warp;
    float b = 0.f;
#pragma unroll
    for (int k = 0; k < TOPK; ++k)
      if (lane == k && bias) b = __bfloat162float(bias[expert_row[k] + n]) * bias_scale;
    ring.acquire(i);
    float dots[TOPK];
#pragma unroll
    for (int k = 0; k < TOPK; ++k)
      dots[k] = staged_row_dot<GPL>(smem + i % STAGES * stage_bytes + k * part, expert_row[k] + first_row(i),
                                    CONSUMERS, warp, xs + k * G * QUADS, lane, G, lane == k ? b : 0.f);
    ring.release(i, lane);
    const float sum = lane_sums<TOPK>(dots, lane);  // lane 32 k / TOPK: slot k's
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < TOPK; ++k) total += slot_scale[k] * __shfl_sync(0xffffffffu, sum, k * (32 / TOPK));
    if (lane == 0) out[n] = __float2bfloat16_rn(total);
  }
}

// ---- FP8 (Qwen3-FP8's layout: gate rows then up rows, 128 x 128 block scales). A part: `rows` rows of C chunks
// inside one 128-row block, their codes then that block's row of fp32 scales ----
__host__ __device__ constexpr int part_bytes8(int rows, int C) { return rows * C * 16 + capacity((C + 7) / 8 * 4); }

__device__ __forceinline__ uint32_t copy_part8(uint8_t* part, const uint8_t* blocks, const float* scales,
                                               int64_t row, int rows, int C, int64_t scale_row, uint64_t* bar) {
  bulk_load(part, blocks + row * C * 16, rows * C * 16, bar);
  const int columns = (C + 7) / 8;
  return rows * C * 16 + copy_unaligned(part + rows * C * 16, reinterpret_cast<const uint8_t*>(scales),
                                        scale_row * columns * 4, columns * 4, bar);
}

template <int CPL>
__device__ __forceinline__ float staged_row_dot8(const uint8_t* part, int64_t scale_row, int rows, int j,
                                                 const uint4* xs, int lane, int C) {
  const uint4* w = reinterpret_cast<const uint4*>(part) + j * C;
  const float* s = reinterpret_cast<const float*>(part + rows * C * 16 + ((scale_row * ((C + 7) / 8) * 4) & 15));
  return lane_dot<CPL>([&](int i) {
    const int c = lane + 32 * i, cc = min(c, C - 1);
    return chunk_dot8(w[cc], xs[quad8(cc, 0)], xs[quad8(cc, 1)]) * (c < C ? s[cc / 8] : 0.f);
  });
}

// gate/up: a tile is CONSUMERS columns of one slot (CONSUMERS divides 128 and I): a part of their gate rows, one of
// their up rows; consumer warp w column w; SiLU(gate) * up, fp32 out
template <int CONSUMERS, int STAGES, int CPL>
__global__ void __launch_bounds__((CONSUMERS + 1) * 32, 1) fp8_gate_up_bulk_kernel(
    const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ blocks, const float* __restrict__ scales,
    const int64_t* __restrict__ experts, float* __restrict__ h, int I, int C, int slots) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ BulkRing<STAGES, CONSUMERS> ring;
  __shared__ float warp_max[CONSUMERS + 1];
  __shared__ int64_t experts_of[16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = part_bytes8(CONSUMERS, C);
  const int per_slot = I / CONSUMERS, iters = ring_iters(slots * per_slot), scale_rows = (2 * I + 127) / 128;
  uint4* xs = reinterpret_cast<uint4*>(smem + STAGES * 2 * part);
  if (threadIdx.x == 0) ring.init();
  wait_previous();
  if (threadIdx.x < slots) experts_of[threadIdx.x] = experts[threadIdx.x];
  __syncthreads();
  auto tile = [&](int i) { return int(blockIdx.x + i * gridDim.x); };
  auto gate_row = [&](int i) { return experts_of[tile(i) / per_slot] * 2 * I + tile(i) % per_slot * CONSUMERS; };
  auto scale_row = [&](int i, int half) {
    return experts_of[tile(i) / per_slot] * scale_rows + (half * I + tile(i) % per_slot * CONSUMERS) / 128;
  };
  auto fill = [&](int i, uint64_t* bar) {
    uint8_t* stage = smem + i % STAGES * 2 * part;
    return copy_part8(stage, blocks, scales, gate_row(i), CONSUMERS, C, scale_row(i, 0), bar) +
           copy_part8(stage + part, blocks, scales, gate_row(i) + I, CONSUMERS, C, scale_row(i, 1), bar);
  };
  ring.prime(iters, fill);
  const float unscale = stage8(x, C * 16, xs, threadIdx.x, (CONSUMERS + 1) * 32, warp_max, false);
  __syncthreads();
  let_next();
  if (warp == CONSUMERS) return ring.refill(iters, fill);
  for (int i = 0; i < iters; ++i) {
    ring.acquire(i);
    const uint8_t* stage = smem + i % STAGES * 2 * part;
    float dots[2] = {staged_row_dot8<CPL>(stage, scale_row(i, 0), CONSUMERS, warp, xs, lane, C),
                     staged_row_dot8<CPL>(stage + part, scale_row(i, 1), CONSUMERS, warp, xs, lane, C)};
    ring.release(i, lane);
    const float sum = lane_sums<2>(dots, lane), up_sum = __shfl_down_sync(0xffffffffu, sum, 16);
    const float gate = sum * unscale, up = up_sum * unscale;
    if (lane == 0) h[tile(i) / per_slot * I + tile(i) % per_slot * CONSUMERS + warp] =
        __fdividef(gate, 1.f + __expf(-gate)) * up;
  }
}

// down: a tile is CONSUMERS output rows (CONSUMERS divides 128 and H), every slot's expert's rows there; consumer
// warp w output row w over the TOPK slots (fp32 activations, each slot's staged to fp16 by its own largest)
template <int CONSUMERS, int STAGES, int TOPK, int CPL>
__global__ void __launch_bounds__((CONSUMERS + 1) * 32, 1) fp8_down_bulk_kernel(
    const float* __restrict__ h, const uint8_t* __restrict__ blocks, const float* __restrict__ scales,
    const int64_t* __restrict__ experts, RoutingWeights weights, __nv_bfloat16* __restrict__ out, int H, int C) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ BulkRing<STAGES, CONSUMERS> ring;
  __shared__ float slot_scale[TOPK];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = part_bytes8(CONSUMERS, C);
  const int stage_bytes = TOPK * part, iters = ring_iters(H / CONSUMERS), scale_rows = (H + 127) / 128;
  uint4* xs = reinterpret_cast<uint4*>(smem + STAGES * stage_bytes);  // TOPK x C x 2 quads
  if (threadIdx.x == 0) ring.init();
  __syncthreads();
  auto first_row = [&](int i) { return int(blockIdx.x + i * gridDim.x) * CONSUMERS; };
  auto fill = [&](int i, uint64_t* bar) {
    uint32_t bytes = 0;
#pragma unroll
    for (int k = 0; k < TOPK; ++k)
      bytes += copy_part8(smem + i % STAGES * stage_bytes + k * part, blocks, scales, experts[k] * H + first_row(i),
                          CONSUMERS, C, experts[k] * scale_rows + first_row(i) / 128, bar);
    return bytes;
  };
  ring.prime(iters, fill);
  wait_previous();  // gate/up's activations
  for (int k = warp; k < TOPK; k += CONSUMERS + 1) {
    const float unscale = stage8(h + int64_t(k) * C * 16, C * 16, xs + k * C * 2, lane, 32, nullptr, true);
    if (lane == 0) slot_scale[k] = weights[k] * unscale;
  }
  __syncthreads();
  let_next();
  if (warp == CONSUMERS) return ring.refill(iters, fill);
  for (int i = 0; i < iters; ++i) {
    ring.acquire(i);
    float dots[TOPK];
#pragma unroll
    for (int k = 0; k < TOPK; ++k)
      dots[k] = staged_row_dot8<CPL>(smem + i % STAGES * stage_bytes + k * part,
                                     experts[k] * scale_rows + first_row(i) / 128, CONSUMERS, warp, xs + k * C * 2,
                                     lane, C);
    ring.release(i, lane);
    const float sum = lane_sums<TOPK>(dots, lane);  // lane 32 k / TOPK: slot k's
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < TOPK; ++k) total += slot_scale[k] * __shfl_sync(0xffffffffu, sum, k * (32 / TOPK));
    if (lane == 0) out[first_row(i) + warp] = __float2bfloat16_rn(total);
  }
}

template <int C1, int S1, int C2, int S2>
void moe_bulk_config(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor b1, torch::Tensor w2,
                     torch::Tensor s2, torch::Tensor b2, torch::Tensor experts, torch::Tensor weights, torch::Tensor h,
                     torch::Tensor out, double alpha, double limit, int64_t paired_shift, int64_t ctas1,
                     int64_t ctas2, int64_t parts, bool pdl) {
  const int sms = multiprocessors(), TOPK = experts.numel();
  if (w1.dim() == 3) {  // FP8: [E, 2I, H] codes
    const int I = w1.size(1) / 2, chunks = w1.size(2) / 16, H = w2.size(1), chunks2 = w2.size(2) / 16;
    TORCH_CHECK(TOPK == 8 && chunks <= 128 && chunks2 <= 64 && I % C1 == 0 && 128 % C1 == 0 && H % C2 == 0 &&
                128 % C2 == 0, "the FP8 bulk probe takes top-8, K <= 2048, I <= 1024 and tiles inside the 128-row "
                "blocks");
    if (parts & 1)
      launch(fp8_gate_up_bulk_kernel<C1, S1, 4>, dim3(std::min(sms * ctas1, int64_t(TOPK * I / C1))),
             dim3((C1 + 1) * 32), S1 * 2 * part_bytes8(C1, chunks) + chunks * 2 * 16, pdl,
             (const __nv_bfloat16*)x.data_ptr(), (const uint8_t*)w1.data_ptr(), (const float*)s1.data_ptr(),
             (const int64_t*)experts.data_ptr(), (float*)h.data_ptr(), I, chunks, TOPK);
    if (parts & 2)
      launch(fp8_down_bulk_kernel<C2, S2, 8, 2>, dim3(std::min(sms * ctas2, int64_t(H / C2))), dim3((C2 + 1) * 32),
             S2 * 8 * part_bytes8(C2, chunks2) + 8 * chunks2 * 2 * 16, pdl, (const float*)h.data_ptr(),
             (const uint8_t*)w2.data_ptr(), (const float*)s2.data_ptr(), (const int64_t*)experts.data_ptr(),
             routing_weights(weights), (__nv_bfloat16*)out.data_ptr(), H, chunks2);
    return;
  }
  const int I = w1.size(1) / 2, G = w1.size(2), H = w2.size(1), G2 = w2.size(2);
  TORCH_CHECK(TOPK == 4 && G > 64 && G <= 96 && G2 > 64 && G2 <= 96 && I % C1 == 0 && H % C2 == 0,
              "the MXFP4 bulk probe takes top-4, 3 groups a lane (2048 < K <= 3072) and tiles dividing the rows");
  if (parts & 1)
    launch(gate_up_bulk_kernel<C1, S1, 3>, dim3(std::min(sms * ctas1, int64_t(4 * I / C1))), dim3((C1 + 1) * 32),
           S1 * part_bytes(2 * C1, G) + activation_bytes(G), pdl, (const __nv_bfloat16*)x.data_ptr(),
           (const uint8_t*)w1.data_ptr(), (const uint8_t*)s1.data_ptr(), (const __nv_bfloat16*)b1.data_ptr(),
           (const int64_t*)experts.data_ptr(), (__half*)h.data_ptr(), I, G, 4, float(alpha), float(limit),
           int(paired_shift));
  if (parts & 2)
    launch(down_bulk_kernel<C2, S2, 4, 3>, dim3(std::min(sms * ctas2, int64_t(H / C2))), dim3((C2 + 1) * 32),
           S2 * 4 * part_bytes(C2, G2) + 4 * activation_bytes(G2), pdl, (const __half*)h.data_ptr(),
           (const uint8_t*)w2.data_ptr(), (const uint8_t*)s2.data_ptr(), (const __nv_bfloat16*)b2.data_ptr(),
           (const int64_t*)experts.data_ptr(), routing_weights(weights), (__nv_bfloat16*)out.data_ptr(), H, G2,
           int(paired_shift));
}

// the bulk-copy variant's configs (MXFP4 gpt-oss or FP8 Qwen3 by the weights): consumer warps and stages of gate/up
// and of down
void moe_bulk(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor b1, torch::Tensor w2,
              torch::Tensor s2, torch::Tensor b2, torch::Tensor experts, torch::Tensor weights, torch::Tensor h,
              torch::Tensor out, double alpha, double limit, int64_t paired_shift, int64_t consumers1,
              int64_t stages1, int64_t consumers2, int64_t stages2, int64_t ctas1, int64_t ctas2, int64_t parts,
              bool pdl) {
#define BULK(A, B, C, D) \
  if (consumers1 == A && stages1 == B && consumers2 == C && stages2 == D) \
    return moe_bulk_config<A, B, C, D>(x, w1, s1, b1, w2, s2, b2, experts, weights, h, out, alpha, limit, \
                                       paired_shift, ctas1, ctas2, parts, pdl);
  BULK(8, 4, 8, 3) BULK(8, 3, 4, 3) BULK(16, 3, 8, 3) BULK(8, 6, 4, 6) BULK(16, 4, 8, 4) BULK(4, 4, 4, 4)
  TORCH_CHECK(false, "no such bulk config (consumers1, stages1, consumers2, stages2)");
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
                    int64_t ctas2, int64_t parts, bool pdl) {
  constexpr int TOPK = 8;
  const int I = w1.size(1) / 2, C1 = w1.size(2) / 16, H = w2.size(1), C2 = w2.size(2) / 16;
  const int sms = multiprocessors();
  const int64_t gate_up_ctas = std::min<int64_t>(sms * ctas1, (TOPK * I + WARPS - 1) / WARPS);
  if (parts & 1)
    launch(fp8_gate_up_kernel<WARPS, DEPTH1, 4>, dim3(gate_up_ctas), dim3(WARPS * 32), C1 * 2 * 16, pdl,
           (const __nv_bfloat16*)x.data_ptr(), (const uint4*)w1.data_ptr(), (const float*)s1.data_ptr(),
           (const int64_t*)experts.data_ptr(), (float*)h.data_ptr(), I, C1, TOPK * I);
  const int64_t down_ctas = std::min<int64_t>(sms * ctas2, (H + ROWS - 1) / ROWS);
  if (parts & 2)
    launch(fp8_down_kernel<DEPTH2, ROWS, TOPK, 2>, dim3(down_ctas), dim3(TOPK * 32), TOPK * C2 * 2 * 16, pdl,
           (const float*)h.data_ptr(), (const uint4*)w2.data_ptr(), (const float*)s2.data_ptr(),
           (const int64_t*)experts.data_ptr(), routing_weights(weights), (__nv_bfloat16*)out.data_ptr(), H,
           C2);
}

void moe_fp8(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor w2, torch::Tensor s2,
             torch::Tensor experts, torch::Tensor weights, torch::Tensor h, torch::Tensor out, int64_t depth1,
             int64_t depth2, int64_t ctas1, int64_t ctas2, int64_t rows, int64_t parts, bool pdl) {
  TORCH_CHECK(w1.size(2) <= 16 * 32 * 4 && w2.size(2) <= 16 * 32 * 2 && experts.numel() == 8,
              "the FP8 probe takes K <= 2048, I <= 1024 and top-8");
#define CASE8(A, B, R) \
  if (depth1 == A && depth2 == B && rows == R) \
    return moe_fp8_config<A, B, R>(x, w1, s1, w2, s2, experts, weights, h, out, ctas1, ctas2, parts, pdl);
  CASE8(1, 1, 2) CASE8(1, 1, 4) CASE8(2, 1, 2) CASE8(1, 2, 2) CASE8(2, 2, 2)
  TORCH_CHECK(false, "no such FP8 config (depth1, depth2, rows)");
}
"""

CPP = ("void moe(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor b1, torch::Tensor w2, "
       "torch::Tensor s2, torch::Tensor b2, torch::Tensor experts, torch::Tensor weights, torch::Tensor h, "
       "torch::Tensor out, double alpha, double limit, int64_t paired_shift, int64_t depth1, int64_t depth2, "
       "int64_t ctas1, int64_t ctas2, int64_t rows, int64_t cols, int64_t parts, bool pdl, int64_t mode);\n"
       "void moe_fp8(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor w2, torch::Tensor s2, "
       "torch::Tensor experts, torch::Tensor weights, torch::Tensor h, torch::Tensor out, int64_t depth1, "
       "int64_t depth2, int64_t ctas1, int64_t ctas2, int64_t rows, int64_t parts, bool pdl);\n"
       "void moe_silu(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor w2, torch::Tensor s2, "
       "torch::Tensor experts, torch::Tensor weights, torch::Tensor h, torch::Tensor out, int64_t depth2, "
       "int64_t ctas1, int64_t ctas2, int64_t rows, int64_t parts, bool pdl);\n"
       "void moe_bulk(torch::Tensor x, torch::Tensor w1, torch::Tensor s1, torch::Tensor b1, torch::Tensor w2, "
       "torch::Tensor s2, torch::Tensor b2, torch::Tensor experts, torch::Tensor weights, torch::Tensor h, "
       "torch::Tensor out, double alpha, double limit, int64_t paired_shift, int64_t consumers1, int64_t stages1, "
       "int64_t consumers2, int64_t stages2, int64_t ctas1, int64_t ctas2, int64_t parts, bool pdl);")

ALPHA, LIMIT, PAIRED_SHIFT = 1.702, 7.0, 9  # gpt-oss' clamped SwiGLU; its outputs times 2^9 stay in fp16
PROBED = ("gpt-oss-20b", "qwen3-30b-a3b-fp8", "qwen3-30b-a3b-mxfp4")


def parse_config(text: str) -> tuple[int, ...]:
    """DEPTH1,DEPTH2,CTAS1,CTAS2[,ROWS[,COLS]] -> the six ints `moe` takes before its parts (ROWS 2, COLS 1 when
    left out; `moe_fp8` takes the first five)."""
    values = tuple(map(int, text.split(",")))
    return values + (2, 1)[len(values) - 4:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=PROBED, default="gpt-oss-20b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ncu", action="store_true", help="a few plain calls of the first config, for a profiler")
    parser.add_argument("--configs", nargs="+", default=["1,1,2,3,4", "1,2,2,3,2"],
                        help="DEPTH1,DEPTH2,CTAS1,CTAS2[,ROWS[,COLS]]: units in flight per warp and CTAs per SM "
                             "(gate/up, down), the down kernel's rows per batch (2 or 4; default 2), gate/up's "
                             "columns per unit (1 or 2; default 1)")
    parser.add_argument("--bulk", nargs="*", default=[],
                        help="gpt-oss or FP8: the bulk-copy variant's CONSUMERS1,STAGES1,CONSUMERS2,STAGES2,CTAS1,"
                             "CTAS2 (consumer warps a CTA and tiles in flight, gate/up then down; CTAs per SM)")
    args = parser.parse_args()
    module = load_inline("probe_cuda_rows", CPP, cuda_sources=CUDA,
                         functions=["moe", "moe_fp8", "moe_silu", "moe_bulk"],
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
    none = torch.empty(0, device="cuda", dtype=torch.bfloat16)  # no biases (FP8)

    def probe(gate_up, down, config, parts=3, pdl=True, mode=0):
        if gpt_oss:
            module.moe(x, gate_up.data, gate_up.scales, gate_up.bias, down.data, down.scales, down.bias, flat_index,
                       flat_weights, h, out, ALPHA, LIMIT, PAIRED_SHIFT, *config, parts, pdl, mode)
        elif format == "mxfp4":  # DEPTH1 is 1 here
            module.moe_silu(x, gate_up.data, gate_up.scales, down.data, down.scales, flat_index, flat_weights, h, out,
                            *config[1:5], parts, pdl)
        else:
            module.moe_fp8(x, gate_up.data, gate_up.scales, down.data, down.scales, flat_index, flat_weights, h, out,
                           *config[:5], parts, pdl)
        return out

    def library(gate_up, down):
        gate = dict(alpha=ALPHA, limit=LIMIT) if gpt_oss else {}
        return fused_moe(x, index, weights, gate_up, down, interleaved=gpt_oss, activation=activation, **gate)

    if args.ncu:
        config = parse_config(args.configs[0])
        for mode in (0, 1, 2) if gpt_oss else (0,):
            for g, d in layers:
                probe(g, d, config, parts=3 if mode == 0 else 1, mode=mode)
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
    def bulk(gate_up, down, config, parts=3, pdl=True):
        biases = (none if weight.bias is None else weight.bias for weight in (gate_up, down))
        module.moe_bulk(x, gate_up.data, gate_up.scales, next(biases), down.data, down.scales, next(biases),
                        flat_index, flat_weights, h, out, ALPHA, LIMIT, PAIRED_SHIFT, *config, parts, pdl)
        return out

    for config in (tuple(map(int, text.split(","))) for text in args.bulk):
        err = error(bulk(*layers[0], config))
        both = graph_time_us([lambda g=g, d=d: bulk(g, d, config) for g, d in layers])
        no_pdl = graph_time_us([lambda g=g, d=d: bulk(g, d, config, pdl=False) for g, d in layers])
        first = graph_time_us([lambda g=g, d=d: bulk(g, d, config, parts=1) for g, d in layers])
        second = graph_time_us([lambda g=g, d=d: bulk(g, d, config, parts=2) for g, d in layers])
        print(f"bulk {config}: {both:6.1f} us ({moved / both / 1e3 / copy:.0%} of copy, {library_us / both:.2f}x "
              f"library), no PDL {no_pdl:6.1f}, gate/up alone {first:6.1f}, down alone {second:6.1f}; err {err:.1e}",
              flush=True)
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
            decode = graph_time_us([lambda g=g, d=d: probe(g, d, config, parts=1, mode=2) for g, d in layers])
            print(f"    gate/up loads only {loads:6.1f} us, decode only {decode:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
