#!/usr/bin/env bash
# Device calls for the CUDA row kernels (csrc/moe_rows_cuda.cuh): their GPU tests, the probe's configs for the three
# layouts (against the Triton kernels), and the library's one-token layers with DFLASH_CUDA_ROWS=1 against the
# Triton kernels on the same calls. Run from the repository root with transformers 5.24 importable (the device
# call's PYTHONPATH prefix, docs/benchmarks.md). The parts' time limits add up past one call's 600 s: run them in two
# calls, e.g.
#
#     bash bench/cuda_rows_checks.sh tests probe       # ~1 min to build the library module, ~1.5 for the probe's
#     bash bench/cuda_rows_checks.sh fp8 silu library
#     bash bench/cuda_rows_checks.sh steps              # a decode step with and without them (gpt-oss-20b, 4 layers)
#     bash bench/cuda_rows_checks.sh verify             # the M = 1 and 16 table (MXFP4 and FP8 shapes)
#     bash bench/cuda_rows_checks.sh staged             # weights through shared-memory rings (cp.async), both formats
set -u
quiet() { grep -v "^ptxas\|^    [0-9]* bytes\|^\[\|Compiling\|registers\|^SKIPPED\|^PASSED"; }
nvidia-smi --query-gpu=name --format=csv,noheader
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests probe fp8 library)
for part in "${parts[@]}"; do
  case $part in
    tests)
      echo "## GPU tests (the row kernels; sampling's CUDA compile)"
      DFLASH_CUDA_ROWS=1 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cuda_rows.py \
          tests/test_sampling.py -k "cuda or rows or ordered" 2>&1 | quiet | tail -25 ;;
    probe)
      echo "## probe, gpt-oss-20b (DEPTH1,DEPTH2,CTAS1,CTAS2,ROWS,COLS)"
      DFLASH_CUDA_ROWS=0 timeout 240 python3 bench/probe_cuda_rows.py --layers 4 \
          --configs 1,1,2,3,4 1,1,3,3,4 1,1,2,4,4 1,2,2,3,2 2>&1 | quiet | tail -22 ;;
    fp8)
      echo "## probe, qwen3-30b-a3b-fp8"
      DFLASH_CUDA_ROWS=0 timeout 200 python3 bench/probe_cuda_rows.py --shape qwen3-30b-a3b-fp8 \
          --configs 1,2,2,2,2 1,2,2,1,2 1,2,2,3,2 1,1,2,1,4 2>&1 | quiet | tail -12 ;;
    silu)
      echo "## probe, qwen3-30b-a3b-mxfp4 (SiLU MXFP4; DEPTH1 is 1)"
      DFLASH_CUDA_ROWS=0 timeout 200 python3 bench/probe_cuda_rows.py --shape qwen3-30b-a3b-mxfp4 \
          --configs 1,1,2,3,4 1,1,2,1,4 1,2,2,1,2 1,1,3,2,4 1,1,2,2,4 2>&1 | quiet | tail -12 ;;
    staged)
      echo "## probe, gpt-oss-20b: the register rings against shared-memory rings (STAGES1 gate/up, STAGES2 down)"
      DFLASH_CUDA_ROWS=0 timeout 330 python3 bench/probe_cuda_rows.py --layers 4 \
          --configs 1,1,2,3,4 1,1,2,3,4,1,2 1,1,2,3,4,1,3 1,1,2,3,4,1,4 1,1,3,3,4,1,2 1,1,2,3,2,1,3,3 \
          1,1,2,2,4,1,3,2 1,1,2,3,2,1,0,3 2>&1 | quiet | tail -18
      echo "## probe, qwen3-30b-a3b-fp8: the same"
      DFLASH_CUDA_ROWS=0 timeout 200 python3 bench/probe_cuda_rows.py --shape qwen3-30b-a3b-fp8 \
          --configs 1,2,2,2,2 1,2,2,2,2,1,2 1,2,2,2,2,1,3 1,2,2,2,2,1,0,2 1,2,2,2,2,1,3,3 1,2,2,2,2,1,2,2 2>&1 \
          | quiet | tail -8 ;;
    library)
      echo "## library, one token: CUDA row kernels (fused) vs Triton (baseline)"
      DFLASH_CUDA_ROWS=1 timeout 300 python3 bench/moe_kernels.py --no-tune --tokens 1 --against-triton \
          --shapes gpt-oss-20b gpt-oss-120b qwen3-30b-a3b-mxfp4 qwen3-30b-a3b-fp8 2>&1 | quiet | tail -16 ;;
    steps)
      echo "## gpt-oss-20b decode step (4 layers, MXFP4 experts): Triton (DFLASH_CUDA_ROWS=0), then the row kernels"
      for rows in 0 1; do
        DFLASH_CUDA_ROWS=$rows timeout 280 python3 bench/spec_decode.py --model gpt-oss-20b --layers 4 \
            --experts mxfp4 --steps-only --step-blocks 1 --temperatures 2>&1 | quiet | grep "^| decode\|copy"
      done ;;
    verify)
      echo "## verify-block sizes (M = 16) next to one token: the issue's table"
      timeout 200 python3 bench/moe_kernels.py --no-tune --tokens 1 16 --shapes gpt-oss-20b gpt-oss-120b \
          qwen3-30b-a3b-fp8 2>&1 | quiet | tail -10 ;;
    *) echo "unknown part $part (tests, probe, fp8, silu, library, steps, verify, staged)"; exit 2 ;;
  esac
done
