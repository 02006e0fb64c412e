// The Python module of csrc/moe_rows_cuda.cuh's one-token MXFP4 MoE (built by dflash_compile/kernels/cuda_rows.py).
#include "moe_rows_cuda.cuh"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mxfp4_one_token", &mxfp4_one_token, "one token's MXFP4 MoE layer, gpt-oss's layout");
}
