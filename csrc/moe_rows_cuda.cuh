// One token's MXFP4 MoE layer on the CUDA cores (sm_90): the kernels of dflash_compile/kernels/cuda_rows.py, also
// read by bench/probe_cuda_rows.py, which times their variants.
//
// Every lane of a warp owns 32-code groups lane, lane + 32, ... of a row (GPL of them, K <= 128 groups), as 16-byte
// loads, coalesced, with no shared-memory staging of weights and no CTA-wide barrier in the loop; the activations
// sit in shared memory as fp16 pairs in the decode's order (a group's quads padded to 80 bytes: conflict-free
// 16-byte reads); the codes go to fp16x2 pairs by an 11-instruction word decode (kernels/moe.py's
// `_e2m1_word_pairs`), products add in fp16x2 per group and in fp32 across groups, warp shuffles sum the lanes (all
// of a unit's rows in one transposing butterfly). Warps are persistent and keep DEPTH units' loads in flight.
// gate/up: a warp's unit is COLS output columns (their interleaved gate and up rows), clamped SwiGLU, fp16 output
// times 2^paired_shift in pair order. down: a CTA is a warp per routed expert, each staging its own expert's
// activations; ROWS output rows a batch, the experts' weighted partials added in slot order (no pair-sum launch),
// launched as a programmatic dependent launch that issues its first weight loads before it waits for gate/up.
#pragma once
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>


__device__ __forceinline__ void wait_previous() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void let_next() { asm volatile("griddepcontrol.launch_dependents;"); }

__device__ __forceinline__ float exp2i(int e) { return __int_as_float((e + 127) << 23); }

// The routing weights as the router left them, fp32 or bf16 (gpt-oss' softmax keeps bf16): read in the kernel
// rather than cast by a launch of its own
struct RoutingWeights {
  const void* data;
  bool bf16;
  __device__ float operator[](int k) const {
    return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(data)[k]) : static_cast<const float*>(data)[k];
  }
};

inline RoutingWeights routing_weights(const torch::Tensor& weights) {
  TORCH_CHECK(weights.scalar_type() == torch::kFloat || weights.scalar_type() == torch::kBFloat16,
              "routing weights must be float32 or bfloat16");
  return {weights.data_ptr(), weights.scalar_type() == torch::kBFloat16};
}

// quad q (a packed word's four fp16x2 pairs) of group g: a group's 4 quads and one of padding, so that 8 lanes'
// 16-byte reads of 8 consecutive groups fall on distinct banks (80-byte stride) and q is an immediate offset
constexpr int QUADS = 5;
__device__ __forceinline__ int quad(int g, int q) { return g * QUADS + q; }
inline int activation_bytes(int groups) { return groups * QUADS * 16; }

__device__ __forceinline__ void decode(uint32_t w, uint32_t& p0, uint32_t& p1, uint32_t& p2, uint32_t& p3) {
  asm("{\n.reg .b32 low, high, sign;\n"
      "shl.b32 low, %4, 1;\nshl.b32 sign, %4, 4;\nand.b32 low, low, 0x0E0E0E0E;\n"
      "and.b32 sign, sign, 0x80808080;\nor.b32 low, low, sign;\n"
      "shr.b32 high, %4, 3;\nand.b32 high, high, 0x0E0E0E0E;\nand.b32 sign, %4, 0x80808080;\n"
      "or.b32 high, high, sign;\n"
      "prmt.b32 %0, low, 0, 0x1404;\nprmt.b32 %1, low, 0, 0x3424;\n"
      "prmt.b32 %2, high, 0, 0x1404;\nprmt.b32 %3, high, 0, 0x3424;\n}"
      : "=r"(p0), "=r"(p1), "=r"(p2), "=r"(p3) : "r"(w));
}

__device__ __forceinline__ __half2 h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

__device__ __forceinline__ __half2 word_dot(uint32_t w, uint4 x, __half2 sum) {
  uint32_t p0, p1, p2, p3;
  decode(w, p0, p1, p2, p3);
  sum = __hfma2(h2(p0), h2(x.x), sum);
  sum = __hfma2(h2(p1), h2(x.y), sum);
  sum = __hfma2(h2(p2), h2(x.z), sum);
  return __hfma2(h2(p3), h2(x.w), sum);
}

// one group's 32 products, scaled by its E8M0 exponent
__device__ __forceinline__ float group_dot(uint4 w, const uint4* xs, int g, uint8_t e) {
  __half2 sum = __float2half2_rn(0.f);
  sum = word_dot(w.x, xs[quad(g, 0)], sum);
  sum = word_dot(w.y, xs[quad(g, 1)], sum);
  sum = word_dot(w.z, xs[quad(g, 2)], sum);
  sum = word_dot(w.w, xs[quad(g, 3)], sum);
  float2 f = __half22float2(sum);
  return (f.x + f.y) * __int_as_float(int(e) << 23);
}

// The warp's sums of v[0] .. v[N - 1] (N a power of two <= 32) in five rounds of shuffles: each round first halves
// the values a lane keeps (the upper lanes of the round's pairs keep the upper half), so lane l ends with the sum of
// v[l / (32 / N)] after N - 1 + 5 - log2(N) shuffles instead of 5 N.
template <int N>
__device__ __forceinline__ float lane_sums(float (&v)[N], int lane) {
#pragma unroll
  for (int n = N, o = 16; n > 1; n /= 2, o /= 2) {
    const bool upper = lane & o;
#pragma unroll
    for (int i = 0; i < n / 2; ++i) {
      const float send = upper ? v[i] : v[i + n / 2];
      v[i] = (upper ? v[i + n / 2] : v[i]) + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
  float sum = v[0];
#pragma unroll
  for (int o = 16 / N; o; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  return sum;
}

// This warp's place in a persistent grid of CTAs of `warps` warps: it takes units first, first + stride, ... (stride:
// the grid's warps), `iters` of them below `units`
struct PersistentWarp {
  int lane, warp, first, stride, iters;
  __device__ PersistentWarp(int warps, int units)
      : lane(threadIdx.x & 31), warp(threadIdx.x >> 5), first(blockIdx.x * warps + warp), stride(gridDim.x * warps),
        iters(first < units ? (units - first + stride - 1) / stride : 0) {}
};

// A warp's unit slot * per_slot + column in the persistent grid, stepped without divisions (subtractions: the
// stride, the grid's warps, is at most a few slots' units)
struct Unit {
  int slot, column;
  __device__ void advance(int by, int per_slot) {
    column += by;
    while (column >= per_slot) { column -= per_slot; ++slot; }
  }
};

// The end of a by-expert down kernel's batch: warp k's weighted partial of row j (held by lane j * 32 / ROWS,
// `lane_sums`' order) into the batch's half of `partial`, then ROWS threads add the TOPK slots' in slot order and
// store the rows (one barrier a batch, the halves alternating so the next batch's writes cannot overtake this
// one's reads)
template <int ROWS, int TOPK>
__device__ __forceinline__ void sum_slots(float (&partial)[2][TOPK][ROWS], float weighted, int index, bool live,
                                          int batch, int k, int lane, int H, __nv_bfloat16* __restrict__ out) {
  if (lane % (32 / ROWS) == 0) partial[index & 1][k][lane / (32 / ROWS)] = weighted;
  __syncthreads();
  const int n = batch * ROWS + threadIdx.x;
  if (threadIdx.x < ROWS && live && n < H) {
    float total = 0.f;
#pragma unroll
    for (int kk = 0; kk < TOPK; ++kk) total += partial[index & 1][kk][threadIdx.x];
    out[n] = __float2bfloat16_rn(total);
  }
}

// A by-expert down kernel's loop: batches blockIdx.x, + gridDim.x, ... (`iters` of them), DEPTH in flight in `ring`
// (`issue(ring[d], batch)` loads a batch's rows); each lane's row dots `dot(loads, j)`, summed over the warp
// (`lane_sums`), times `scale` (the routing weight and the activations' unscaling) on the lane holding row j, then
// the slots' sum
template <int DEPTH, int ROWS, int TOPK, typename Ring, typename Issue, typename Dot>
__device__ __forceinline__ void down_batches(Ring (&ring)[DEPTH], Issue issue, Dot dot, float scale,
                                             float (&partial)[2][TOPK][ROWS], int iters, int k, int lane, int H,
                                             __nv_bfloat16* __restrict__ out) {
  for (int it = 0; it < iters; it += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int batch = blockIdx.x + (it + d) * gridDim.x;
      float acc[ROWS];
#pragma unroll
      for (int j = 0; j < ROWS; ++j) acc[j] = dot(ring[d], j);
      issue(ring[d], batch + DEPTH * gridDim.x);
      const float sum = lane_sums<ROWS>(acc, lane);
      sum_slots<ROWS, TOPK>(partial, scale * sum, it + d, it + d < iters, batch, k, lane, H, out);
    }
  }
}

__device__ __forceinline__ int paired_column(int c) {  // the library's _paired_columns, c >= 0
  const int r = c & 7;
  return c - r + (r & 1) * 4 + (r >> 2) * 2 + ((r >> 1) & 1);
}

template <int ROWS, int GPL>  // GPL: groups a lane owns, lane + 32 i for i < GPL
struct Loads {
  uint4 w[ROWS][GPL];
  uint8_t e[ROWS][GPL];
  float bias;  // on lane j < ROWS, row j's bias (0 without biases): read with the codes, its latency hidden with theirs
};

// Groups lane + 32 i of rows rows[0 .. ROWS - 1] of the [rows, G] views of blocks and scales (32-bit indices: the
// host checks E N G < 2^31), loads at immediate offsets from the lane's first group. Past a row's G groups a lane
// keeps the words it holds (any codes are finite) with exponent 0: their products count 0, and no product is
// branched around. `bias` ([rows] bf16, or null) is read here rather than in the epilogue, where its latency stalled
// every unit (the down kernel's barrier waits for the slowest warp's).
template <int ROWS, int MODE, int GPL>
__device__ __forceinline__ void load_rows(Loads<ROWS, GPL>& l, const uint4* blocks, const uint8_t* scales,
                                          const __nv_bfloat16* bias, const int (&rows)[ROWS], int lane, int G) {
  if (MODE != 2 && bias) {
    int row = rows[0];
#pragma unroll
    for (int r = 1; r < ROWS; ++r) row = lane == r ? rows[r] : row;  // selects: no local-memory array index
    l.bias = lane < ROWS ? __bfloat162float(bias[row]) : 0.f;
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int first = rows[r] * G + lane;
#pragma unroll
    for (int i = 0; i < GPL; ++i) {
      const bool in_row = lane + 32 * i < G;
      if (MODE == 2) {  // decode only: words made from the index, no loads
        const uint32_t a = uint32_t(first + 32 * i);
        l.w[r][i] = make_uint4(a, a ^ 0x5A5A5A5A, a * 3u, a ^ 0x33333333);
        l.e[r][i] = in_row ? 120 : 0;
      } else {
        if (in_row) l.w[r][i] = __ldcs(blocks + first + 32 * i);
        l.e[r][i] = in_row ? __ldcs(scales + first + 32 * i) : uint8_t(0);
      }
    }
  }
}

// a lane's part of a row: the sum of piece(0) .. piece(N - 1), its groups' or chunks' dot products
template <int N, typename Piece>
__device__ __forceinline__ float lane_dot(Piece piece) {
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) acc += piece(i);
  return acc;
}

// a lane's part of row j's dot; lane j adds the row's bias in the activations' scale (times `bias_scale`, the
// inverse of their 2^(shift - 14)), so the warp's sum holds it
template <int MODE, int ROWS, int GPL>
__device__ __forceinline__ float row_dot(const Loads<ROWS, GPL>& l, int j, const uint4* xs, int lane, int G,
                                         float bias_scale) {
  const float bias = lane == j ? l.bias * bias_scale : 0.f;
  return bias + lane_dot<GPL>([&](int i) {
    const uint4 w = l.w[j][i];
    if (MODE == 1)  // loads only: the words folded, no decode
      return __int_as_float((w.x ^ w.y ^ w.z ^ w.w) & 0x3FFFFF) + float(l.e[j][i]);
    return group_dot(w, xs, min(lane + 32 * i, G - 1), l.e[j][i]);  // past G: group G - 1, exponent 0
  });
}

// The token's activations (G groups of 32 bf16) into `xs` as fp16 pairs in the decode's order, times 2^shift (the
// largest magnitude in [2^14, 2^15)), by a CTA of WARPS warps (`warp_max` a float each); returns shift. The caller
// syncs the CTA before reading xs.
template <int WARPS>
__device__ __forceinline__ int stage_token(const __nv_bfloat16* __restrict__ x, int G, uint4* xs, float* warp_max) {
  const int K = G * 32;
  const uint4* x8 = reinterpret_cast<const uint4*>(x);
  float m = 0.f;
  for (int wd = threadIdx.x; wd < K / 8; wd += WARPS * 32) {
    uint4 raw = x8[wd];
    const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float2 f = __bfloat1622float2(v[j]);
      m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  m = 0.f;
  for (int i = 0; i < WARPS; ++i) m = fmaxf(m, warp_max[i]);
  const int shift = min(14 - (((__float_as_int(m) >> 23) & 255) - 127), 100);
  const float scale = exp2i(shift);
  for (int wd = threadIdx.x; wd < K / 8; wd += WARPS * 32) {
    uint4 raw = x8[wd];
    const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
    float f[8];
    for (int j = 0; j < 8; ++j) f[j] = __bfloat162float(v[j]) * scale;
    __half2 a = __floats2half2_rn(f[0], f[2]), b = __floats2half2_rn(f[4], f[6]);
    __half2 c = __floats2half2_rn(f[1], f[3]), d = __floats2half2_rn(f[5], f[7]);
    uint4 q;
    q.x = *reinterpret_cast<uint32_t*>(&a); q.y = *reinterpret_cast<uint32_t*>(&b);
    q.z = *reinterpret_cast<uint32_t*>(&c); q.w = *reinterpret_cast<uint32_t*>(&d);
    xs[quad(wd / 4, wd % 4)] = q;
  }
  return shift;
}

// Persistent warps: warp w of the grid takes units w, w + W, w + 2W, ... (W the grid's warps), DEPTH units' loads in
// flight (a ring of registers indexed at compile time: the unit loop is unrolled DEPTH times, with no break, so the
// shuffles stay convergent; units past the end load the last one again and store nothing).

// gate/up: a unit is COLS output columns c .. c + COLS - 1 of expert slot s (unit s * I / COLS + c / COLS), their
// gate and up rows (I a multiple of COLS); more columns a unit share the activations' shared-memory reads, the
// shuffles and the epilogue (lanes 32 j / COLS finish column c + j). Two layouts: GPT_OSS, gate and up rows
// interleaved (2c, 2c + 1), biases, clamped SwiGLU, fp16 out times 2^paired_shift (bounded: no scale to find);
// otherwise gate rows then up rows (c, I + c), no biases, SiLU(gate) * up, fp32 out. Both in pair order.
template <int WARPS, int DEPTH, int MODE, int MIN_CTAS = 1, int COLS = 1, bool GPT_OSS = true, int GPL = 3>
__global__ void __launch_bounds__(WARPS * 32, MIN_CTAS) gate_up_kernel(
    const __nv_bfloat16* __restrict__ x, const uint4* __restrict__ blocks, const uint8_t* __restrict__ scales,
    const __nv_bfloat16* __restrict__ bias, const int64_t* __restrict__ experts,
    std::conditional_t<GPT_OSS, __half, float>* __restrict__ h, int I, int G, int units, float alpha, float limit,
    int paired_shift) {
  extern __shared__ uint4 xs[];
  __shared__ float warp_max[WARPS];
  __shared__ int expert_rows[8];
  const PersistentWarp me(WARPS, units);
  const int lane = me.lane, stride = me.stride, first = me.first, iters = me.iters;
  wait_previous();
  constexpr int ROWS = 2 * COLS;
  const int per_slot = I / COLS, slots = units / per_slot;
  if (threadIdx.x < slots) expert_rows[threadIdx.x] = int(experts[threadIdx.x]) * 2 * I;
  __syncthreads();
  auto issue = [&](Loads<ROWS, GPL>& l, Unit unit) {
    int rows[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j)  // dots in lane_sums' order: gate and up of the unit's first column, then ...
      rows[j] = expert_rows[min(unit.slot, slots - 1)]
                + (GPT_OSS ? ROWS * unit.column + j : (j & 1) * I + COLS * unit.column + j / 2);
    load_rows<ROWS, MODE, GPL>(l, blocks, scales, bias, rows, lane, G);
  };
  Loads<ROWS, GPL> ring[DEPTH] = {};  // zeros: the words a lane keeps past a row's end
  Unit in_ring[DEPTH], next{first / per_slot, first % per_slot};  // the ring's units, the next to load
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    in_ring[d] = next;
    issue(ring[d], next);
    next.advance(stride, per_slot);
  }
  const int shift = stage_token<WARPS>(x, G, xs, warp_max);
  __syncthreads();
  let_next();
  const float unscale = exp2i(14 - shift), bias_scale = exp2i(shift - 14);
  const float out_scale = exp2i(paired_shift);
  for (int it = 0; it < iters; it += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      float dots[ROWS];
#pragma unroll
      for (int j = 0; j < ROWS; ++j) dots[j] = row_dot<MODE>(ring[d], j, xs, lane, G, bias_scale);
      const float sum = lane_sums<ROWS>(dots, lane);  // lane 32 j / ROWS: row j's
      const float up_sum = __shfl_down_sync(0xffffffffu, sum, 16 / COLS);
      const int slot = in_ring[d].slot, c = in_ring[d].column * COLS + lane / (32 / COLS);
      in_ring[d] = next;
      issue(ring[d], next);
      next.advance(stride, per_slot);
      if (lane % (32 / COLS) == 0 && it + d < iters) {
        float gate = sum * unscale, up = up_sum * unscale;  // biases included
        if constexpr (GPT_OSS) {
          gate = fminf(gate, limit);
          up = fminf(fmaxf(up, -limit), limit);
          const float act = (up + 1.f) * __fdividef(gate, 1.f + __expf(-gate * alpha));  // no slow-path call
          h[slot * I + paired_column(c)] = __float2half_rn(act * out_scale);
        } else {
          h[slot * I + paired_column(c)] = __fdividef(gate, 1.f + __expf(-gate)) * up;
        }
      }
    }
  }
}

// A warp's staging of one expert's fp32 activations (in pair order, `values` of them) as fp16 times 2^shift, the
// largest in [2^14, 2^15), into `mine`'s padded quads; returns shift
__device__ __forceinline__ int stage_scaled(const float* __restrict__ v, int values, uint4* mine, int lane) {
  float m = 0.f;
  for (int i = lane; i < values; i += 32) m = fmaxf(m, fabsf(v[i]));
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const int shift = min(14 - (((__float_as_int(m) >> 23) & 255) - 127), 100);
  const float scale = exp2i(shift);
  const float4* v4 = reinterpret_cast<const float4*>(v);
  for (int q = lane; q < values / 8; q += 32) {
    const float4 a = v4[2 * q], b = v4[2 * q + 1];
    __half2 p[4] = {__floats2half2_rn(a.x * scale, a.y * scale), __floats2half2_rn(a.z * scale, a.w * scale),
                    __floats2half2_rn(b.x * scale, b.y * scale), __floats2half2_rn(b.z * scale, b.w * scale)};
    mine[quad(q / 4, q % 4)] = *reinterpret_cast<uint4*>(p);
  }
  return shift;
}

// down, by expert: a CTA is TOPK warps, warp k the routed expert of slot k, each staging only its own expert's
// activations (no CTA barrier before the loop; fp16 ones already scaled by 2^paired_shift, fp32 ones scaled here);
// a batch is ROWS output rows: warp k's weighted partial sums of its expert's rows go to shared memory and ROWS
// threads add the TOPK partials in slot order (one barrier per batch, partials double-buffered). Few registers per
// CTA, so its CTAs fit beside gate/up's and start early (PDL). `bias` may be null.
template <int DEPTH, int ROWS, int TOPK, typename In = __half, int GPL = 3>
__global__ void __launch_bounds__(TOPK * 32) down_by_expert_kernel(
    const In* __restrict__ h, const uint4* __restrict__ blocks, const uint8_t* __restrict__ scales,
    const __nv_bfloat16* __restrict__ bias, const int64_t* __restrict__ experts, RoutingWeights weights,
    __nv_bfloat16* __restrict__ out, int H, int G, int paired_shift) {
  extern __shared__ uint4 xs[];  // TOPK x activation_bytes(G)
  __shared__ float partial[2][TOPK][ROWS];
  const int lane = threadIdx.x & 31, k = threadIdx.x >> 5;
  const int batches = (H + ROWS - 1) / ROWS;
  const int iters = int(blockIdx.x) < batches ? (batches - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int e = int(experts[k]);  // the routing is the previous launch's input: already there
  auto issue = [&](Loads<ROWS, GPL>& l, int batch) {
    int rows[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j) rows[j] = e * H + min(batch * ROWS + j, H - 1);
    load_rows<ROWS, 0, GPL>(l, blocks, scales, bias, rows, lane, G);
  };
  Loads<ROWS, GPL> ring[DEPTH] = {};  // zeros: the words a lane keeps past a row's end
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) issue(ring[d], blockIdx.x + d * gridDim.x);
  wait_previous();  // gate/up's activations
  uint4* mine = xs + k * G * QUADS;
  int shift = paired_shift;
  if constexpr (std::is_same_v<In, __half>) {
    const uint4* hq = reinterpret_cast<const uint4*>(h) + k * G * 4;
    for (int i = lane; i < G * 4; i += 32) mine[quad(i / 4, i % 4)] = hq[i];
  } else {
    shift = stage_scaled(h + k * G * 32, G * 32, mine, lane);
  }
  __syncwarp();
  let_next();
  const float scale = weights[k] * exp2i(14 - shift), bias_scale = exp2i(shift - 14);
  down_batches<DEPTH, ROWS, TOPK>(
      ring, issue, [&](const Loads<ROWS, GPL>& l, int j) { return row_dot<0>(l, j, mine, lane, G, bias_scale); },
      scale, partial, iters, k, lane, H, out);
}

// ---- FP8 (float8_e4m3fn, 128 x 128 block scales; Qwen3-FP8 style: gate and up rows concatenated, SiLU) ----
// A 16-byte chunk holds 16 codes; each pair goes to fp16x2 by the hardware conversion, times the activations' fp16
// pairs (natural order: chunk c's are quads 2c and 2c + 1, swizzled in shared memory), the chunk's sum times its
// block scale. Activations are fp16 times 2^shift putting the largest in [2^2, 2^3) (products <= 3584, eight per
// half: no overflow).

__device__ __forceinline__ int quad8(int c, int q) { return 2 * c + (q ^ ((c >> 2) & 1)); }

__device__ __forceinline__ __half2 e4m3x2(uint32_t pair) {
  uint32_t r;
  asm("{\n.reg .b16 lo;\ncvt.u16.u32 lo, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(r) : "r"(pair));
  return h2(r);
}

__device__ __forceinline__ float chunk_dot8(uint4 w, uint4 xa, uint4 xb) {
  __half2 sum = __hmul2(e4m3x2(w.x), h2(xa.x));
  sum = __hfma2(e4m3x2(w.x >> 16), h2(xa.y), sum);
  sum = __hfma2(e4m3x2(w.y), h2(xa.z), sum);
  sum = __hfma2(e4m3x2(w.y >> 16), h2(xa.w), sum);
  sum = __hfma2(e4m3x2(w.z), h2(xb.x), sum);
  sum = __hfma2(e4m3x2(w.z >> 16), h2(xb.y), sum);
  sum = __hfma2(e4m3x2(w.w), h2(xb.z), sum);
  sum = __hfma2(e4m3x2(w.w >> 16), h2(xb.w), sum);
  float2 f = __half22float2(sum);
  return f.x + f.y;
}

template <int ROWS, int CPL>
struct Loads8 {
  uint4 w[ROWS][CPL];
  float s[ROWS][CPL];
};

// row r's chunks lane + 32 i (past C: chunk C - 1 again with scale 0); scales[r] is the row's block-row of scales
template <int ROWS, int CPL>
__device__ __forceinline__ void load_rows8(Loads8<ROWS, CPL>& l, const uint4* const* rows, const float* const* scales,
                                           int lane, int C) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = lane + 32 * i, cc = min(c, C - 1);
      l.w[r][i] = __ldcs(rows[r] + cc);
      l.s[r][i] = c < C ? __ldg(scales[r] + cc / 8) : 0.f;
    }
}

template <int CPL>
__device__ __forceinline__ float row_dot8(const uint4 (&w)[CPL], const float (&s)[CPL], const uint4* xs, int lane,
                                          int C) {
  return lane_dot<CPL>([&](int i) {
    const int c = min(lane + 32 * i, C - 1);
    return chunk_dot8(w[i], xs[quad8(c, 0)], xs[quad8(c, 1)]) * s[i];
  });
}

// fp16 pairs of n fp32 / bf16 values times 2^shift (largest in [2^2, 2^3)) into swizzled quads, by one warp or by
// the whole CTA (`threads` of them from `first`); returns 2^-shift
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }

template <typename T>
__device__ __forceinline__ float stage8(const T* v, int n, uint4* xs, int first, int threads, float* reduce,
                                        bool warp_only) {
  float m = 0.f;
  for (int i = first; i < n; i += threads) m = fmaxf(m, fabsf(to_float(v[i])));
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (!warp_only) {
    if ((first & 31) == 0) reduce[first >> 5] = m;
    __syncthreads();
    m = 0.f;
    for (int i = 0; i < threads / 32; ++i) m = fmaxf(m, reduce[i]);
  }
  const int shift = min(2 - (((__float_as_int(m) >> 23) & 255) - 127), 100);
  const float scale = exp2i(shift);
  for (int q = first; q < n / 8; q += threads) {  // quad q: values 8q .. 8q + 7
    uint32_t p[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      __half2 pair = __floats2half2_rn(to_float(v[8 * q + 2 * j]) * scale, to_float(v[8 * q + 2 * j + 1]) * scale);
      p[j] = *reinterpret_cast<uint32_t*>(&pair);
    }
    xs[quad8(q / 2, q % 2)] = make_uint4(p[0], p[1], p[2], p[3]);
  }
  return exp2i(-shift);
}

// gate/up: a unit is output column c of expert slot s: rows c (gate) and I + c (up); fp32 SiLU(gate) * up out
template <int WARPS, int DEPTH, int CPL>
__global__ void __launch_bounds__(WARPS * 32) fp8_gate_up_kernel(
    const __nv_bfloat16* __restrict__ x, const uint4* __restrict__ blocks, const float* __restrict__ scales,
    const int64_t* __restrict__ experts, float* __restrict__ h, int I, int C, int units) {
  extern __shared__ uint4 xs[];  // C x 2 quads
  __shared__ float warp_max[WARPS];
  __shared__ int64_t experts_of[16];
  const PersistentWarp me(WARPS, units);
  const int lane = me.lane, stride = me.stride, first = me.first, iters = me.iters;
  const int slots = units / I, scale_columns = (C + 7) / 8, scale_rows = (2 * I + 127) / 128;
  wait_previous();
  if (threadIdx.x < slots) experts_of[threadIdx.x] = experts[threadIdx.x];
  __syncthreads();
  auto issue = [&](Loads8<2, CPL>& l, Unit unit) {
    const int64_t e = experts_of[min(unit.slot, slots - 1)];
    const int64_t gate = e * 2 * I + unit.column, up = gate + I;
    const uint4* r[2] = {blocks + gate * C, blocks + up * C};
    const float* base = scales + e * scale_rows * scale_columns;
    const float* s[2] = {base + (unit.column / 128) * scale_columns,
                         base + ((I + unit.column) / 128) * scale_columns};
    load_rows8<2, CPL>(l, r, s, lane, C);
  };
  Loads8<2, CPL> ring[DEPTH];
  Unit in_ring[DEPTH], next{first / I, first % I};
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    in_ring[d] = next;
    issue(ring[d], next);
    next.advance(stride, I);
  }
  const float unscale = stage8(x, C * 16, xs, threadIdx.x, WARPS * 32, warp_max, false);
  __syncthreads();
  let_next();
  for (int it = 0; it < iters; it += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      float dots[2] = {row_dot8<CPL>(ring[d].w[0], ring[d].s[0], xs, lane, C),
                       row_dot8<CPL>(ring[d].w[1], ring[d].s[1], xs, lane, C)};
      const float sum = lane_sums<2>(dots, lane), up_sum = __shfl_down_sync(0xffffffffu, sum, 16);
      const Unit unit = in_ring[d];
      in_ring[d] = next;
      issue(ring[d], next);
      next.advance(stride, I);
      const float gate = sum * unscale, up = up_sum * unscale;
      if (lane == 0 && it + d < iters)
        h[(int64_t)unit.slot * I + unit.column] = __fdividef(gate, 1.f + __expf(-gate)) * up;
    }
  }
}

// down by expert: a CTA is TOPK warps, warp k the routed expert of slot k staging its own activations (fp32 in,
// scaled to fp16 by its own largest); ROWS output rows a batch, partials added in slot order through shared memory
template <int DEPTH, int ROWS, int TOPK, int CPL>
__global__ void __launch_bounds__(TOPK * 32) fp8_down_kernel(
    const float* __restrict__ h, const uint4* __restrict__ blocks, const float* __restrict__ scales,
    const int64_t* __restrict__ experts, RoutingWeights weights, __nv_bfloat16* __restrict__ out, int H,
    int C) {
  extern __shared__ uint4 xs[];  // TOPK x C x 2 quads
  __shared__ float partial[2][TOPK][ROWS];
  const int lane = threadIdx.x & 31, k = threadIdx.x >> 5;
  const int batches = (H + ROWS - 1) / ROWS;
  const int iters = int(blockIdx.x) < batches ? (batches - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int scale_columns = (C + 7) / 8, scale_rows = (H + 127) / 128;
  const int64_t e = experts[k];
  auto issue = [&](Loads8<ROWS, CPL>& l, int batch) {
    const uint4* r[ROWS]; const float* s[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      const int n = min(batch * ROWS + j, H - 1);
      r[j] = blocks + (e * H + n) * C;
      s[j] = scales + (e * scale_rows + n / 128) * scale_columns;
    }
    load_rows8<ROWS, CPL>(l, r, s, lane, C);
  };
  Loads8<ROWS, CPL> ring[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) issue(ring[d], blockIdx.x + d * gridDim.x);
  wait_previous();  // gate/up's activations
  uint4* mine = xs + k * C * 2;
  const float unscale = stage8(h + (int64_t)k * C * 16, C * 16, mine, lane, 32, nullptr, true);
  __syncwarp();
  let_next();
  down_batches<DEPTH, ROWS, TOPK>(
      ring, issue, [&](const Loads8<ROWS, CPL>& l, int j) { return row_dot8<CPL>(l.w[j], l.s[j], mine, lane, C); },
      weights[k] * unscale, partial, iters, k, lane, H, out);
}

inline int multiprocessors() {
  int device, count;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return count;
}

// Past the default 48 KB of dynamic shared memory (a down kernel's 8 experts x 128 groups of activations: 80 KB), a
// kernel must ask; once per kernel and size, so a call inside a CUDA-graph capture (after its warm-up) makes none
inline void allow_shared_memory(const void* kernel, size_t smem) {
  static std::mutex mutex;
  static std::unordered_map<const void*, size_t> allowed;
  std::lock_guard<std::mutex> lock(mutex);
  if (allowed[kernel] >= smem) return;
  TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) == cudaSuccess,
              "the row kernels' shared memory (", smem, " bytes) does not fit this GPU");
  allowed[kernel] = smem;
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, bool pdl, Args... args) {
  if (smem > 48 * 1024) allow_shared_memory(reinterpret_cast<const void*>(kernel), smem);
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  TORCH_CHECK(cudaLaunchKernelEx(&config, kernel, args...) == cudaSuccess, "launch failed");
}

// `f(std::integral_constant<int, GPL>)` for the fewest groups per lane that cover a row of `groups` (<= 128): no
// lane decodes groups past a short row's end (Qwen3-30B-A3B's down rows: 24 groups, one a lane)
template <typename F>
void with_groups_per_lane(int groups, F f) {
  TORCH_CHECK(groups <= 128, "the row kernels take rows of at most 128 groups of 32");
  if (groups <= 32) return f(std::integral_constant<int, 1>{});
  if (groups <= 64) return f(std::integral_constant<int, 2>{});
  if (groups <= 96) return f(std::integral_constant<int, 3>{});
  f(std::integral_constant<int, 4>{});
}

// One token's MXFP4 MoE layer: x [1, H] bf16; gate_up blocks [E, 2I, G, 16] / scales [E, 2I, G] uint8; down
// [E, H, G', 16] / [E, H, G']; experts [TOPK] int64, weights [TOPK] fp32 or bf16 -> out [1, H] bf16. GPT_OSS: gate
// and up rows interleaved, biases [E, 2I] / [E, H] bf16, clamped SwiGLU; otherwise gate rows then up rows, no
// biases, SiLU. Gate/up then down (by expert, rows summed in slot order), the down launch programmatically dependent.
// The shapes were checked by dflash_compile/kernels/cuda_rows.py.
template <int TOPK, bool GPT_OSS>
torch::Tensor mxfp4_layer(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& s1,
                          const __nv_bfloat16* b1, const torch::Tensor& w2, const torch::Tensor& s2,
                          const __nv_bfloat16* b2, const torch::Tensor& experts, const torch::Tensor& weights,
                          double alpha, double limit, int64_t paired_shift) {
  using Activations = std::conditional_t<GPT_OSS, __half, float>;
  // the H100's best of the probe's configs (docs/benchmarks.md, session 60): gate/up 2 CTAs per SM, one unit in
  // flight; down for gpt-oss 3 CTAs per SM, batches of 4 rows, one in flight (26.5 us for gpt-oss-20b; 2 rows, 2 in
  // flight 28.0), for SiLU (top-8, fp32 activations each warp stages) 1 CTA per SM, 2 rows, 2 in flight (14.1 us for
  // Qwen3-30B-A3B's shape; as gpt-oss 16.4)
  constexpr int WARPS = 8, GATE_UP_CTAS = 2;
  constexpr int DOWN_DEPTH = GPT_OSS ? 1 : 2, DOWN_ROWS = GPT_OSS ? 4 : 2, DOWN_CTAS = GPT_OSS ? 3 : 1;
  const int I = w1.size(1) / 2, G = w1.size(2), H = w2.size(1), G2 = w2.size(2);
  TORCH_CHECK(w1.numel() / 16 < INT32_MAX && w2.numel() / 16 < INT32_MAX, "the kernels index groups in 32 bits");
  auto h = torch::empty({TOPK, I}, x.options().dtype(GPT_OSS ? torch::kHalf : torch::kFloat));
  auto out = torch::empty({1, H}, x.options());
  const int sms = multiprocessors();
  with_groups_per_lane(G, [&](auto gpl) {
    launch(gate_up_kernel<WARPS, 1, 0, 1, 1, GPT_OSS, decltype(gpl)::value>,
           dim3(std::min(sms * GATE_UP_CTAS, (TOPK * I + WARPS - 1) / WARPS)), dim3(WARPS * 32), activation_bytes(G),
           true, (const __nv_bfloat16*)x.data_ptr(), (const uint4*)w1.data_ptr(), (const uint8_t*)s1.data_ptr(), b1,
           (const int64_t*)experts.data_ptr(), (Activations*)h.data_ptr(), I, G, TOPK * I, float(alpha),
           float(limit), int(paired_shift));
  });
  with_groups_per_lane(G2, [&](auto gpl) {
    launch(down_by_expert_kernel<DOWN_DEPTH, DOWN_ROWS, TOPK, Activations, decltype(gpl)::value>,
           dim3(std::min(sms * DOWN_CTAS, (H + DOWN_ROWS - 1) / DOWN_ROWS)), dim3(TOPK * 32),
           TOPK * activation_bytes(G2), true, (const Activations*)h.data_ptr(), (const uint4*)w2.data_ptr(),
           (const uint8_t*)s2.data_ptr(), b2, (const int64_t*)experts.data_ptr(), routing_weights(weights),
           (__nv_bfloat16*)out.data_ptr(), H, G2, int(paired_shift));
  });
  return out;
}

// gpt-oss's layout, top-4
inline torch::Tensor mxfp4_one_token(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& s1,
                                     const torch::Tensor& b1, const torch::Tensor& w2, const torch::Tensor& s2,
                                     const torch::Tensor& b2, const torch::Tensor& experts,
                                     const torch::Tensor& weights, double alpha, double limit,
                                     int64_t paired_shift) {
  return mxfp4_layer<4, true>(x, w1, s1, (const __nv_bfloat16*)b1.data_ptr(), w2, s2,
                              (const __nv_bfloat16*)b2.data_ptr(), experts, weights, alpha, limit, paired_shift);
}

// concatenated gate/up, SiLU, no biases (`dflash_compile.quantize`'s MXFP4 of Qwen3-MoE, OLMoE, ...), top-2, 4 or 8
inline torch::Tensor mxfp4_silu_one_token(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& s1,
                                          const torch::Tensor& w2, const torch::Tensor& s2,
                                          const torch::Tensor& experts, const torch::Tensor& weights) {
  const int64_t top_k = experts.numel();
  auto layer = top_k == 8 ? mxfp4_layer<8, false> : top_k == 4 ? mxfp4_layer<4, false> : mxfp4_layer<2, false>;
  TORCH_CHECK(top_k == 2 || top_k == 4 || top_k == 8, "the SiLU row kernels take top-2, 4 or 8");
  return layer(x, w1, s1, nullptr, w2, s2, nullptr, experts, weights, 1.0, 0.0, 0);
}

// One token's FP8 layer (float8_e4m3fn, 128 x 128 block scales), Qwen3-FP8's layout: x [1, H] bf16; gate_up
// [E, 2I, H] bytes with gate rows 0 .. I - 1 then up rows, scales [E, ceil(2I / 128), ceil(H / 128)] fp32; down
// [E, H, I] / [E, ceil(H / 128), ceil(I / 128)]; SiLU, no biases; experts [8] int64, weights [8] fp32 -> out [1, H]
// bf16. Gate/up (fp32 activations out) then down by expert, programmatically dependent; a lane owns up to CPL1 / CPL2
// 16-byte chunks of a row (H <= 4096, I <= 2048). The shapes were checked by dflash_compile/kernels/cuda_rows.py.
template <int CPL1, int CPL2>
torch::Tensor fp8_one_token_cpl(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& s1,
                                const torch::Tensor& w2, const torch::Tensor& s2, const torch::Tensor& experts,
                                const torch::Tensor& weights) {
  // the H100's best of the probe's configs (docs/benchmarks.md, session 59): down depth 2, 2 + 2 CTAs per SM
  constexpr int WARPS = 8, TOPK = 8, DOWN_ROWS = 2, GATE_UP_CTAS = 2, DOWN_CTAS = 2;
  const int I = w1.size(1) / 2, C1 = w1.size(2) / 16, H = w2.size(1), C2 = w2.size(2) / 16;
  auto h = torch::empty({TOPK, I}, x.options().dtype(torch::kFloat));
  auto out = torch::empty({1, H}, x.options());
  const int sms = multiprocessors();
  launch(fp8_gate_up_kernel<WARPS, 1, CPL1>, dim3(std::min(sms * GATE_UP_CTAS, (TOPK * I + WARPS - 1) / WARPS)),
         dim3(WARPS * 32), C1 * 2 * 16, true, (const __nv_bfloat16*)x.data_ptr(), (const uint4*)w1.data_ptr(),
         (const float*)s1.data_ptr(), (const int64_t*)experts.data_ptr(), (float*)h.data_ptr(), I, C1, TOPK * I);
  launch(fp8_down_kernel<2, DOWN_ROWS, TOPK, CPL2>, dim3(std::min(sms * DOWN_CTAS, (H + DOWN_ROWS - 1) / DOWN_ROWS)),
         dim3(TOPK * 32), TOPK * C2 * 2 * 16, true, (const float*)h.data_ptr(), (const uint4*)w2.data_ptr(),
         (const float*)s2.data_ptr(), (const int64_t*)experts.data_ptr(), routing_weights(weights),
         (__nv_bfloat16*)out.data_ptr(), H, C2);
  return out;
}

inline torch::Tensor fp8_one_token(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& s1,
                                   const torch::Tensor& w2, const torch::Tensor& s2, const torch::Tensor& experts,
                                   const torch::Tensor& weights) {
  const bool wide = w1.size(2) > 16 * 32 * 4, long_down = w2.size(2) > 16 * 32 * 2;  // H > 2048, I > 1024
  if (wide) return long_down ? fp8_one_token_cpl<8, 4>(x, w1, s1, w2, s2, experts, weights)
                             : fp8_one_token_cpl<8, 2>(x, w1, s1, w2, s2, experts, weights);
  return long_down ? fp8_one_token_cpl<4, 4>(x, w1, s1, w2, s2, experts, weights)
                   : fp8_one_token_cpl<4, 2>(x, w1, s1, w2, s2, experts, weights);
}
