#!/usr/bin/env bash
# The fp8_blocked GEMMs on the GPU machine (issue 33): the cuBLASLt handler built (g++ against
# jaxlib's FFI headers and the CUDA toolkit) and self-checked, the tests with JAX on
# the GPU (re-block bytes against the oracle where XLA keeps subnormals, both kernels against
# their exact reference and the exact MXFP8 GEMM, the in-place wgrad GEMM), then
# benchmarks/bench_fp8_gemm.py.
# (the compiled blocked-operand kernel's tests: scripts/gpu/blocked_operands.sh).
# Repo root, machine python3 (jax 0.11.2), no install; results under $OUT; < ~9 minutes.
# TILES=... (bm,bn,warps,stages;...) widens the Pallas tile sweep; ITERS=... the timed calls;
# BENCH_ARGS=... more bench_fp8_gemm.py flags (e.g. "--role-gemms --tiles ''": the GEMMs by role);
# a table of the kernel times (cuBLASLt's GEMM alone and with its scale kernels, Torch's,
# bf16) ends the log. TESTS=0 skips the tests.
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
rc=0
if [ "${TESTS:-1}" != 0 ]; then
  timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/jax_side/mxfp8/test_fp8_blocked.py \
    tests/jax_side/mxfp8/test_wgrad_into.py \
    "tests/jax_side/mxfp8/test_blocked_operands.py::test_the_shift_keeps_signs_nan_and_rounds_to_nearest_even" \
    > "$OUT/pytest.log" 2>&1
  rc=$?
  grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest.log"
  echo "fp8_blocked gpu tests: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/pytest.log"
fi
args=(--out "$OUT/fp8_gemm.json" --iters "${ITERS:-20}")
[ -n "${TILES:-}" ] && args+=(--tiles "$TILES")
eval "extra=(${BENCH_ARGS:-})"
timeout 300 python3 benchmarks/bench_fp8_gemm.py "${args[@]}" "${extra[@]}" > "$OUT/bench.log" 2>&1
tail -3 "$OUT/bench.log"
python3 - "$OUT/fp8_gemm.json" <<'EOF' 2>&1 | tee -a "$OUT/bench.log"
import json, sys
r = json.load(open(sys.argv[1]))
print(r.get("cublaslt"))
print("| M,K,N | bf16 kernel ms | cuBLASLt GEMM kernel ms | ratio | with its scale kernels | ratio "
      "| F.scaled_mm kernel ms | ratio |")
for g in r["gemm"]:
    b = g.get("bf16_kernel_ms")
    if b is None:  # no Torch column: its error, if any
        print(g["shape"], g.get("torch_scaled_mm_error", "no kernel times"))
        continue
    k, t, f = g["cublaslt_gemm_kernel_ms"], g["cublaslt_kernel_ms"], g["torch_scaled_mm_kernel_ms"]
    print(f"| {','.join(map(str, g['shape']))} | {b:.4f} | {k:.4f} | {b / k:.2f}x | {t:.4f} "
          f"| {b / t:.2f}x | {f:.4f} | {b / f:.2f}x |")
EOF
exit "$rc"
