#!/usr/bin/env bash
# GPU tests in a device call whose time is short: pytest's arguments as given, each result printed as it lands
# (-v through xdist), and at LIMIT seconds (default 420) pytest is interrupted, not killed, so it still prints the
# failures so far with their tracebacks (a killed -q run leaves only dots, session 75). The whole log goes to
# $OUT/gpu_tests.log when $OUT is set. Run from the repository root with transformers importable (the device call's
# PYTHONPATH prefix, docs/benchmarks.md), e.g.
#
#     LIMIT=300 WORKERS=6 bash bench/gpu_tests.sh tests/test_offload.py -k "on_the_gpu_is_token_identical and deepseek_v4"
set -u
log=${OUT:-/tmp}/gpu_tests.log
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout -s INT -k 30 "${LIMIT:-420}" python3 -m pytest -v -rfE --tb=short -p no:cacheprovider -n "${WORKERS:-4}" "$@" \
    > "$log" 2>&1
echo "pytest rc=$?"
grep -E "(PASSED|FAILED|ERROR)( |$)|^E  |passed|failed|KeyboardInterrupt" "$log" | tail -60
