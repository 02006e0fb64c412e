// The Python module of csrc/moe_rows_cuda.cuh's one-token MoE layers (built by dflash_compile/kernels/cuda_rows.py).
#include "moe_rows_cuda.cuh"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mxfp4_one_token", &mxfp4_one_token, "one token's MXFP4 MoE layer, gpt-oss's layout");
  m.def("mxfp4_silu_one_token", &mxfp4_silu_one_token,
        "one token's MXFP4 MoE layer, gate rows then up rows, SiLU, no biases (top-2, 4 or 8)");
  m.def("fp8_one_token", &fp8_one_token, "one token's FP8 block-scaled MoE layer, Qwen3-FP8's layout (top-8, SiLU)");
}
