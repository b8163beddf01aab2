#!/usr/bin/env bash
# The fp8_blocked GEMMs on the GPU machine (issue 33): the cuBLASLt handler built (g++ against
# jaxlib's FFI headers and the CUDA toolkit) and self-checked, the tests with JAX on
# the GPU (re-block bytes against the oracle where XLA keeps subnormals, both kernels against
# their exact reference and the exact MXFP8 GEMM, the in-place wgrad GEMM), then
# benchmarks/bench_fp8_gemm.py.
# (the compiled blocked-operand kernel's tests: scripts/gpu/blocked_operands.sh).
# Repo root, machine python3 (jax 0.11.2), no install; results under $OUT; < ~9 minutes.
# TILES=... (bm,bn,warps,stages;...) widens the Pallas tile sweep; ITERS=... the timed calls.
set -u
OUT=${OUT:-$PWD/out/fp8_gemm}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$(dirname "$0")/../.."
{ nvidia-smi --query-gpu=name,driver_version --format=csv; g++ --version | head -1
  python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)"
} 2>&1 | tee "$OUT/env.log"
timeout 120 python3 -c "from jax_side.mxfp8 import cublaslt; print(cublaslt.status())" 2>&1 \
  | tail -20 | tee "$OUT/status.log"
t0=$SECONDS
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/jax_side/mxfp8/test_fp8_blocked.py \
  tests/jax_side/mxfp8/test_wgrad_into.py \
  "tests/jax_side/mxfp8/test_blocked_operands.py::test_the_shift_keeps_signs_nan_and_rounds_to_nearest_even" \
  > "$OUT/pytest.log" 2>&1
rc=$?
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest.log"
echo "fp8_blocked gpu tests: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/pytest.log"
args=(--out "$OUT/fp8_gemm.json" --iters "${ITERS:-20}")
[ -n "${TILES:-}" ] && args+=(--tiles "$TILES")
timeout 300 python3 benchmarks/bench_fp8_gemm.py "${args[@]}" > "$OUT/bench.log" 2>&1
tail -3 "$OUT/bench.log"
exit "$rc"
