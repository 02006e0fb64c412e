// Routed experts on packed weights for the CPU: the CPU kernels of `dflash::packed_moe` and
// `dflash::fp8_block_linear` (the ops are defined in dflash_compile/ops.py; this file registers their CPU dispatch
// key).
//
// The same contract as the Triton kernel (dflash_compile/kernels/moe.py) and the reference (expert_store.run_packed):
//   out[t] = sum over the token's top-k (expert e, weight w) of  w * (act(x[t] @ W1[e]^T + b1[e]) @ W2[e]^T + b2[e])
// with W1 = gate_up [E, 2I, H] and W2 = down [E, H, I] in one of the packed layouts of dflash_compile/packed.py:
//   format 0 dense      data [E, N, K] fp32 / bf16 / fp16
//   format 1 mxfp4      data uint8 [E, N, K/32, 16] (low nibble first), scales uint8 [E, N, K/32] (E8M0)
//   format 2 fp8_block  data uint8 [E, N, K] (float8_e4m3fn bits), scales fp32 [E, ceil(N/128), ceil(K/128)]
// Experts and rows may be strided (slot pools, views); each row's elements must be contiguous. All arithmetic is
// fp32.
//
// Work: experts one after another (so two experts never write the same output row at once); inside an expert the
// output rows are split over threads (at::parallel_for), each thread decoding one weight row at a time into a
// K-float buffer (AVX-512 decode where the build has it) and dotting it with every token routed to that expert
// (from kChunkPairs tokens, 4 rows at a time over chunks of K, so each token's activations are read once per group);
// dense weights stored input-major (gpt-oss's transposed views) go column by column instead
// (`project_input_major`). A decode-sized call touches each routed weight byte once. From kGemmPairs pairs on one
// expert (a prefill) the rows are decoded block by block into fp32 and each block goes through torch's GEMM
// (`project_by_blocks`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DFLASH_AVX512 1
#include <immintrin.h>
#endif

namespace {

enum Format { kDense, kMxfp4, kFp8Block };
constexpr int64_t kFp8BlockSize = 128;

std::array<float, 16> e2m1_table() {
  const float magnitudes[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  std::array<float, 16> table{};
  for (int i = 0; i < 8; ++i) {
    table[i] = magnitudes[i];
    table[i + 8] = -magnitudes[i];
  }
  return table;
}

std::array<float, 256> e4m3_table() {  // float8_e4m3fn: no infinities, 0x7F / 0xFF are NaN
  std::array<float, 256> table{};
  for (int byte = 0; byte < 256; ++byte) {
    const int exponent = (byte >> 3) & 15, mantissa = byte & 7;
    float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                    : std::ldexp(1.f + mantissa / 8.f, exponent - 7);
    if ((byte & 127) == 127) magnitude = NAN;
    table[byte] = (byte & 128) ? -magnitude : magnitude;
  }
  return table;
}

const std::array<float, 16> kE2m1 = e2m1_table();

// Both E2M1 values of every byte (low nibble first): one lookup per byte.
std::array<std::array<float, 2>, 256> e2m1_pair_table() {
  std::array<std::array<float, 2>, 256> table{};
  for (int byte = 0; byte < 256; ++byte) table[byte] = {kE2m1[byte & 15], kE2m1[byte >> 4]};
  return table;
}

const std::array<std::array<float, 2>, 256> kE2m1Pairs = e2m1_pair_table();
const std::array<float, 256> kE4m3 = e4m3_table();

// An E8M0 scale: 2^(e - 127) built from its bits (a libm ldexp per group cost as much as decoding the group), 0xFF
// is NaN.
float e8m0(uint8_t exponent) {
  if (exponent == 0xFF) return NAN;
  const uint32_t bits = exponent ? static_cast<uint32_t>(exponent) << 23 : 0x00400000u;  // 0: the subnormal 2^-127
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return scale;
}

// One MXFP4 group (16 bytes, low nibble first) times its scale -> 32 fp32 values in column order. AVX-512: the 16
// E2M1 values are one register, so each nibble is one lane permute (the builds use -march=native).
void decode_mxfp4_group(const uint8_t* bytes, float scale, float* out) {
#if defined(DFLASH_AVX512)
  const __m512 table = _mm512_loadu_ps(kE2m1.data()), factor = _mm512_set1_ps(scale);
  const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512i low_codes = _mm512_and_si512(codes, _mm512_set1_epi32(15));
  const __m512 low = _mm512_mul_ps(_mm512_permutexvar_ps(low_codes, table), factor);
  const __m512 high = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table), factor);
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(low, first, high));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(low, second, high));
#else
  for (int64_t i = 0; i < 16; ++i) {
    const auto& pair = kE2m1Pairs[bytes[i]];
    out[2 * i] = pair[0] * scale;
    out[2 * i + 1] = pair[1] * scale;
  }
#endif
}

// n float8_e4m3fn bytes times one scale -> fp32. AVX-512: 16 at a time through fp16 (the same sign, exponent and
// mantissa bits shifted into place, subnormals included, then 2^8 for the exponent biases; the NaN code set apart).
void decode_fp8(const uint8_t* bytes, int64_t n, float scale, float* out) {
  int64_t k = 0;
#if defined(DFLASH_AVX512)
  const __m512 factor = _mm512_set1_ps(scale * 256.f);
  for (; k + 16 <= n; k += 16) {
    const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + k)));
    const __m256i magnitude = _mm256_and_si256(words, _mm256_set1_epi16(0x7F));
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(words, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(magnitude, 7));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7F));
    _mm512_storeu_ps(out + k, _mm512_mask_mov_ps(_mm512_mul_ps(_mm512_cvtph_ps(half), factor), nan,
                                                 _mm512_set1_ps(NAN)));
  }
#endif
  for (; k < n; ++k) out[k] = kE4m3[bytes[k]] * scale;
}

// One expert's packed [N, K] weight: decodes a row into fp32.
struct PackedMatrix {
  Format format;
  int64_t rows, columns;
  const uint8_t* data;  // at this expert
  const void* scales;   // at this expert, or null
  int64_t row_bytes, scale_row_bytes;  // byte strides between rows of data / scales (FP8: between 128-row blocks)
  int64_t column_stride;  // dense data: elements between consecutive columns (1, or N for a transposed view)
  at::ScalarType dtype;  // element type of dense data

  // Columns [begin, end) of a row into out[0, end - begin); begin a multiple of 128 (whole MXFP4 groups and FP8
  // blocks), end too or the row's end.
  void decode_columns(int64_t row, int64_t begin, int64_t end, float* out) const {
    if (format == kMxfp4) {
      const uint8_t* bytes = data + row * row_bytes;
      const uint8_t* exponents = static_cast<const uint8_t*>(scales) + row * scale_row_bytes;
      for (int64_t g = begin / 32; g < end / 32; ++g) {
        decode_mxfp4_group(bytes + g * 16, e8m0(exponents[g]), out + g * 32 - begin);
      }
    } else if (format == kFp8Block) {
      const auto* scale_row = reinterpret_cast<const float*>(static_cast<const uint8_t*>(scales) +
                                                             (row / kFp8BlockSize) * scale_row_bytes);
      const uint8_t* bytes = data + row * row_bytes;
      for (int64_t k = begin; k < end; k += kFp8BlockSize) {
        decode_fp8(bytes + k, std::min(kFp8BlockSize, end - k), scale_row[k / kFp8BlockSize], out + k - begin);
      }
    } else {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "decode_columns", [&] {
        const auto* values = reinterpret_cast<const scalar_t*>(data + row * row_bytes);
        for (int64_t k = begin; k < end; ++k) out[k - begin] = static_cast<float>(values[k * column_stride]);
      });
    }
  }

  void decode_row(int64_t row, float* out) const { decode_columns(row, 0, columns, out); }
};

// Numbers in check messages are formatted here, not by the stream TORCH_CHECK writes its arguments to: on the H200
// machine's build (torch 2.11, gcc 13.3) every check whose message streamed an integer crashed the process when it
// threw, while the one with only strings raised (tests/kernels/test_cpu.py::test_bad_input_is_named).
std::string text(int64_t value) { return std::to_string(value); }

std::string text(at::IntArrayRef values) {
  std::string joined = "[";
  for (size_t i = 0; i < values.size(); ++i) joined += (i ? ", " : "") + std::to_string(values[i]);
  return joined + "]";
}

// mxfp4 data [E, N, G, 16] and scales [E, N, G]; fp8 data [E, N, K] and scales [E, N/128, K/128]; dense [E, N, K]
// at any strides (a transposed view of [E, in, out] parameters reads its columns strided)
void check_rows(Format format, const at::Tensor& data, const std::optional<at::Tensor>& scales) {
  TORCH_CHECK(format == kDense || (data.stride(-1) == 1 && (data.dim() < 4 || data.stride(2) == 16) &&
                                   (!scales.has_value() || scales->stride(-1) == 1)),
              "packed expert rows must be contiguous (strides " + text(data.strides()) + ")");
}

// One expert's matrix of weights that `check_rows` accepted.
PackedMatrix expert_matrix(Format format, const at::Tensor& data, const std::optional<at::Tensor>& scales,
                           int64_t expert, int64_t rows, int64_t columns) {
  const auto* base = static_cast<const uint8_t*>(data.data_ptr()) + expert * data.stride(0) * data.element_size();
  const void* scale_base = nullptr;
  int64_t scale_row_bytes = 0;
  if (scales.has_value()) {
    scale_base = static_cast<const uint8_t*>(scales->data_ptr()) + expert * scales->stride(0) * scales->element_size();
    scale_row_bytes = scales->stride(1) * scales->element_size();
  }
  return {format, rows, columns, base, scale_base, data.stride(1) * data.element_size(), scale_row_bytes,
          data.stride(2), data.scalar_type()};
}

float dot(const float* a, const float* b, int64_t n) {
  constexpr int64_t kLanes = 16;  // independent partial sums: the compiler vectorizes them without reassociating
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) partial[j] += a[i + j] * b[i + j];
  }
  float sum = 0.f;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (float value : partial) sum += value;
  return sum;
}

// project() for dense weights stored input-major (a transposed view of [E, in, out] parameters, gpt-oss): input
// column k is a contiguous run over the output rows, so each thread takes a range of rows and adds in[p, k] times
// that run for every k, reading the weights in order, instead of gathering each row's elements N apart (8x slower).
void project_input_major(const PackedMatrix& weight, const float* in, int64_t pairs, const float* bias, float* out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.dtype, "project_input_major", [&] {
    const auto* values = reinterpret_cast<const scalar_t*>(weight.data);
    at::parallel_for(0, weight.rows, 256, [&](int64_t begin, int64_t end) {
      const int64_t width = end - begin;
      std::vector<float> sums(pairs * width, 0.f), run(width);
      for (int64_t k = 0; k < weight.columns; ++k) {
        const scalar_t* column = values + k * weight.column_stride + begin;
        for (int64_t n = 0; n < width; ++n) run[n] = static_cast<float>(column[n]);
        for (int64_t p = 0; p < pairs; ++p) {
          const float factor = in[p * weight.columns + k];
          float* target = sums.data() + p * width;
          for (int64_t n = 0; n < width; ++n) target[n] += factor * run[n];
        }
      }
      for (int64_t p = 0; p < pairs; ++p) {
        for (int64_t n = 0; n < width; ++n) {
          out[p * weight.rows + begin + n] = sums[p * width + n] + (bias ? bias[begin + n] : 0.f);
        }
      }
    });
  });
}

// Pairs from which project() decodes blocks of weight rows into fp32 and multiplies each block by torch's GEMM
// (at::mm): below, a row decoded once is dotted with every pair while it sits in L1; from here on those dots re-read
// every pair's activations from cache for each weight row, where a GEMM blocks them. `bench/moe_cpu.py --dense` on
// the 2-core machine (session 25): 1.17-2.09x at 32 rows, 1.47-2.36x at 64, 2.43-3.89x at 256 over the dots; at 8
// and 16 rows between 0.66x and 1.42x by shape (the decoded fp32 block's round trip through memory against 1 byte
// per weight), so those keep the dots.
constexpr int64_t kGemmPairs = 32;
constexpr int64_t kBlockElements = int64_t{1} << 22;  // fp32 values per decoded block: 16 MB

// project() for kGemmPairs and more pairs: weight rows decoded block by block (rows split over threads), each block
// multiplied by at::mm into its columns of out.
void project_by_blocks(const PackedMatrix& weight, const float* in, int64_t pairs, const float* bias, float* out) {
  const at::Tensor x = at::from_blob(const_cast<float*>(in), {pairs, weight.columns}, at::kFloat);
  const at::Tensor result = at::from_blob(out, {pairs, weight.rows}, at::kFloat);
  const int64_t block_rows = std::min(weight.rows, std::max<int64_t>(1, kBlockElements / weight.columns));
  const at::Tensor block = at::empty({block_rows, weight.columns}, at::kFloat);
  float* decoded = block.data_ptr<float>();
  for (int64_t start = 0; start < weight.rows; start += block_rows) {
    const int64_t rows = std::min(block_rows, weight.rows - start);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) weight.decode_row(start + n, decoded + n * weight.columns);
    });
    at::Tensor product = at::mm(x, block.narrow(0, 0, rows).t());
    if (bias) product.add_(at::from_blob(const_cast<float*>(bias) + start, {rows}, at::kFloat));
    result.narrow(1, start, rows).copy_(product);
  }
}

// project()'s passes over rows and column chunks (below kGemmPairs pairs), from `bench/moe_cpu.py` on the 2-core
// machine (session 25): FP8 dense layers at 4-16 rows 0.99-1.89x as fast as row by row; MoE calls, whose experts
// mostly get 1-3 pairs, 0.83-1.24x with chunks from 2 pairs (MXFP4 rows of a few pairs lost), hence from 4.
constexpr int64_t kChunkPairs = 4;
constexpr int64_t kRowsPerPass = 4;
constexpr int64_t kChunkColumns = 1024;  // a multiple of 128: whole MXFP4 groups and FP8 blocks

// out[p, n] = W[rows n] . in[p] (+ bias) for every pair p of one expert, rows split over threads.
void project(const PackedMatrix& weight, const float* in, int64_t pairs, const float* bias, float* out) {
  if (weight.format == kDense && weight.column_stride != 1 && weight.row_bytes == c10::elementSize(weight.dtype)) {
    project_input_major(weight, in, pairs, bias, out);
    return;
  }
  if (pairs >= kGemmPairs) {
    project_by_blocks(weight, in, pairs, bias, out);
    return;
  }
  // kChunkPairs or more pairs: rows in groups of kRowsPerPass, K in chunks of kChunkColumns, so a group's decoded
  // chunks (16 KB) stay in L1 while every pair's chunk of activations is read once for all of the group's rows (one
  // row at a time re-reads every pair's whole activations from L2 per weight row). Fewer: one whole row at a time
  // (one stream of weight bytes per thread, which the prefetcher follows best).
  const bool chunked = pairs >= kChunkPairs;
  const int64_t group_rows = chunked ? kRowsPerPass : 1, width_most = chunked ? kChunkColumns : weight.columns;
  const int64_t groups = (weight.rows + group_rows - 1) / group_rows;
  at::parallel_for(0, groups, 16 / group_rows, [&](int64_t begin, int64_t end) {
    std::vector<float> chunk(group_rows * width_most), sums(group_rows * pairs);
    for (int64_t group = begin; group < end; ++group) {
      const int64_t first = group * group_rows, rows = std::min(group_rows, weight.rows - first);
      std::fill(sums.begin(), sums.end(), 0.f);
      for (int64_t k = 0; k < weight.columns; k += width_most) {
        const int64_t width = std::min(width_most, weight.columns - k);
        for (int64_t r = 0; r < rows; ++r) {
          weight.decode_columns(first + r, k, k + width, chunk.data() + r * width_most);
        }
        for (int64_t p = 0; p < pairs; ++p) {
          const float* x = in + p * weight.columns + k;
          for (int64_t r = 0; r < rows; ++r) sums[r * pairs + p] += dot(chunk.data() + r * width_most, x, width);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t p = 0; p < pairs; ++p) {
          out[p * weight.rows + first + r] = sums[r * pairs + p] + (bias ? bias[first + r] : 0.f);
        }
      }
    }
  });
}

std::vector<float> expert_bias(const std::optional<at::Tensor>& bias, int64_t expert) {
  if (!bias.has_value()) return {};
  at::Tensor row = (*bias)[expert].to(at::kFloat).contiguous();
  return std::vector<float>(row.data_ptr<float>(), row.data_ptr<float>() + row.numel());
}

Format parse_format(c10::string_view name) {
  if (name == "dense") return kDense;
  if (name == "mxfp4") return kMxfp4;
  TORCH_CHECK(name == "fp8_block", "unknown packed format '", name, "': expected dense, mxfp4 or fp8_block");
  return kFp8Block;
}

// The shape and layout checks of packed_moe_cpu (the expert ids are checked as the pairs are grouped).
void check_moe_inputs(Format format, c10::string_view activation, const at::Tensor& hidden,
                      const at::Tensor& top_k_index, const at::Tensor& top_k_weights, const at::Tensor& gate_up_data,
                      const std::optional<at::Tensor>& gate_up_scales, const at::Tensor& down_data,
                      const std::optional<at::Tensor>& down_scales) {
  TORCH_CHECK(activation == "silu" || activation == "clamped_swiglu" || activation == "gelu_tanh" ||
                  activation == "clamped_silu" || activation == "clamped_gate_silu" || activation == "relu2" ||
                  activation == "softcapped_swiglu",
              "activation '", activation,
              "' has no CPU kernel: expected silu, gelu_tanh, clamped_swiglu, clamped_silu, clamped_gate_silu, relu2 or ",
              "softcapped_swiglu");
  TORCH_CHECK(hidden.dim() == 2 && top_k_index.dim() == 2 && top_k_index.sizes() == top_k_weights.sizes(),
              "hidden must be [T, H] and top_k_index / top_k_weights [T, k]");
  const int64_t experts = gate_up_data.size(0);
  TORCH_CHECK(down_data.size(0) == experts && down_data.size(1) == hidden.size(1),
              "down weight must be [E, H, I] with the gate_up weight's E and the hidden size H");
  check_rows(format, gate_up_data, gate_up_scales);
  check_rows(format, down_data, down_scales);
}

at::Tensor packed_moe_cpu(const at::Tensor& hidden, const at::Tensor& top_k_index, const at::Tensor& top_k_weights,
                          c10::string_view format_name, const at::Tensor& gate_up_data,
                          const std::optional<at::Tensor>& gate_up_scales,
                          const std::optional<at::Tensor>& gate_up_bias, const at::Tensor& down_data,
                          const std::optional<at::Tensor>& down_scales, const std::optional<at::Tensor>& down_bias,
                          bool interleaved, c10::string_view activation, double alpha, double limit) {
  const Format format = parse_format(format_name);
  check_moe_inputs(format, activation, hidden, top_k_index, top_k_weights, gate_up_data, gate_up_scales, down_data,
                   down_scales);
  const bool clamped_swiglu = activation == "clamped_swiglu", gelu_tanh = activation == "gelu_tanh",
             clamped_silu = activation == "clamped_silu", clamped_gate_silu = activation == "clamped_gate_silu",
             relu2 = activation == "relu2", softcapped_swiglu = activation == "softcapped_swiglu";
  const float bound = static_cast<float>(limit);
  const int64_t tokens = hidden.size(0), hidden_size = hidden.size(1), top_k = top_k_index.size(1);
  // relu2: experts without a gate, the first projection up alone (Nemotron-H)
  const int64_t experts = gate_up_data.size(0), two_i = gate_up_data.size(1), inter = relu2 ? two_i : two_i / 2;
  const at::Tensor index = top_k_index.to(at::kLong).contiguous();
  const int64_t* index_data = index.data_ptr<int64_t>();
  const at::Tensor x = hidden.to(at::kFloat).contiguous();
  const at::Tensor weights = top_k_weights.to(at::kFloat).contiguous();
  at::Tensor out = at::zeros({tokens, hidden_size}, x.options());
  const float* weight_data = weights.data_ptr<float>();
  const float* x_data = x.data_ptr<float>();
  float* out_data = out.data_ptr<float>();

  std::vector<std::vector<int64_t>> pairs_of(experts);  // (token, slot) pairs routed to each expert
  for (int64_t p = 0; p < tokens * top_k; ++p) {
    const int64_t e = index_data[p];
    TORCH_CHECK(e >= 0 && e < experts, "expert index " + text(e) + " out of range [0, " + text(experts) + ")");
    pairs_of[e].push_back(p);
  }
  for (int64_t e = 0; e < experts; ++e) {
    const auto& pairs = pairs_of[e];
    const int64_t count = static_cast<int64_t>(pairs.size());
    if (count == 0) continue;
    std::vector<float> in(count * hidden_size);
    for (int64_t i = 0; i < count; ++i) {
      std::copy_n(x_data + (pairs[i] / top_k) * hidden_size, hidden_size, in.data() + i * hidden_size);
    }
    const std::vector<float> b1 = expert_bias(gate_up_bias, e), b2 = expert_bias(down_bias, e);
    std::vector<float> gate_up(count * two_i), act(count * inter), y(count * hidden_size);
    project(expert_matrix(format, gate_up_data, gate_up_scales, e, two_i, hidden_size), in.data(), count,
            b1.empty() ? nullptr : b1.data(), gate_up.data());
    for (int64_t i = 0; i < count; ++i) {
      for (int64_t j = 0; j < inter; ++j) {
        const float* h = gate_up.data() + i * two_i;
        float gate = interleaved ? h[2 * j] : h[j];
        float up = interleaved ? h[2 * j + 1] : h[j + inter];
        float value;
        if (relu2) {  // relu(up)^2
          const float up_only = std::max(h[j], 0.f);
          value = up_only * up_only;
        } else if (clamped_swiglu) {
          gate = std::min(gate, bound);
          up = std::max(std::min(up, bound), -bound);
          value = (up + 1.f) * gate / (1.f + std::exp(-gate * static_cast<float>(alpha)));
        } else if (gelu_tanh) {  // GELU(gate) * up, tanh approximation
          value = 0.5f * gate * (1.f + std::tanh(0.7978845608f * (gate + 0.044715f * gate * gate * gate))) * up;
        } else if (clamped_silu) {  // Step 3.7: SiLU(gate) <= limit, times up clamped to [-limit, limit]
          value = std::min(gate / (1.f + std::exp(-gate)), bound) * std::max(std::min(up, bound), -bound);
        } else if (clamped_gate_silu) {  // HY V4: SiLU(gate <= limit), times up clamped to [-limit, limit]
          gate = std::min(gate, bound);
          value = gate / (1.f + std::exp(-gate)) * std::max(std::min(up, bound), -bound);
        } else if (softcapped_swiglu) {  // Inkling 2: softcap(gate, alpha) sigmoid(gate) softcap(up, limit)
          const float gate_cap = static_cast<float>(alpha);
          value = std::tanh(gate / gate_cap) * gate_cap / (1.f + std::exp(-gate)) * std::tanh(up / bound) * bound;
        } else {  // SiLU(gate) * up
          value = gate / (1.f + std::exp(-gate)) * up;
        }
        act[i * inter + j] = value;
      }
    }
    project(expert_matrix(format, down_data, down_scales, e, hidden_size, inter), act.data(), count,
            b2.empty() ? nullptr : b2.data(), y.data());
    for (int64_t i = 0; i < count; ++i) {
      const float w = weight_data[pairs[i]];
      float* target = out_data + (pairs[i] / top_k) * hidden_size;
      for (int64_t n = 0; n < hidden_size; ++n) target[n] += w * y[i * hidden_size + n];
    }
  }
  return out.to(hidden.scalar_type());
}

// linear(x, weight * scale_inv per 128 x 128 block, bias) for float8_e4m3fn weight [N, K]: a dense layer is one
// "expert" that every token is routed to.
at::Tensor fp8_block_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale_inv,
                                const std::optional<at::Tensor>& bias) {
  const int64_t rows = weight.size(0), columns = weight.size(1);
  TORCH_CHECK(x.size(-1) == columns,
              "x has " + text(x.size(-1)) + " features, the weight takes " + text(columns));
  const at::Tensor flat = x.reshape({-1, columns}).to(at::kFloat).contiguous();
  const at::Tensor data = weight.contiguous().view(at::kByte).unsqueeze(0);
  const at::Tensor scales = scale_inv.to(at::kFloat).contiguous().unsqueeze(0);
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor out = at::empty({flat.size(0), rows}, flat.options());
  project(expert_matrix(kFp8Block, data, scales, 0, rows, columns), flat.data_ptr<float>(), flat.size(0),
          b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = rows;
  return out.reshape(shape).to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("packed_moe", &packed_moe_cpu);
  m.impl("fp8_block_linear", &fp8_block_linear_cpu);
}
