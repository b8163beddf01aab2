#!/usr/bin/env bash
# Issue 33's blocked operands on the GPU machine: the compiled Pallas kernel against quantize-then-
# re-block (byte for byte) and the fp8_blocked GPU tests, one linear layer's work per GEMM path
# (benchmarks/bench_linear_layer.py), the GEMM table, then the 1.3B step with --gemm fp8_blocked against FSDP2
# eager (scripts/gpu/scale.sh custom). Repo root, machine python3, no install; results under
# $OUT; ~8 minutes. STEP=0 leaves out the training step, GEMMS=0 the GEMM table
# (benchmarks/bench_fp8_gemm.py without the Pallas tile sweep).
set -u
OUT=${OUT:-$PWD/out/blocked_operands}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$(dirname "$0")/../.."
t0=$SECONDS
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
  tests/jax_side/mxfp8/test_blocked_operands.py tests/jax_side/mxfp8/test_fp8_blocked.py 2>&1 \
  | tail -25 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
echo "blocked operands gpu tests: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/pytest.log"
timeout 150 python3 benchmarks/bench_linear_layer.py --iters "${ITERS:-20}" \
  --out "$OUT/linear.json" > "$OUT/linear.log" 2>&1
echo "linear layer bench: rc=$?" | tee -a "$OUT/linear.log"
if [ "${GEMMS:-1}" != 0 ]; then  # the GEMM table with Torch's blockwise GEMM and kernel times
  timeout 200 python3 benchmarks/bench_fp8_gemm.py --iters "${ITERS:-20}" --tiles "" \
    --out "$OUT/fp8_gemm.json" > "$OUT/fp8_gemm.log" 2>&1
  echo "fp8 gemm bench: rc=$?" | tee -a "$OUT/fp8_gemm.log"
fi
if [ "${STEP:-1}" != 0 ]; then
  GEMM=fp8_blocked RUNS=fsdp2,mxfp8:u4 OUT="$OUT" bash scripts/gpu/scale.sh custom
fi
exit "$rc"
