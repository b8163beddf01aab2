#!/usr/bin/env bash
# jax_side numerics on the GPU machine: the whole CPU suite of tests/jax_side/mxfp8 runs again with
# JAX on the GPU (bit-exactness of the xla backend against the numpy oracle on CUDA, where XLA keeps
# subnormals), plus the gpu-marked GEMM tests (jax.nn.scaled_matmul vs dequantize + dot).
# Repo root, machine python3 (jax 0.11.2), no install; logs under $OUT; < ~7 minutes (the
# test_fp8_blocked.py alone took 137 s on the H200, 2026-12-04).
set -u
OUT=${OUT:-$PWD/out/jax_side}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false HYPOTHESIS_PROFILE=quick
cd "$(dirname "$0")/../.."
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.log"
t0=$SECONDS
timeout 420 python3 -m pytest -q -rs --durations=5 -p no:cacheprovider tests/jax_side/mxfp8 \
  --deselect tests/jax_side/mxfp8/test_te_backend.py 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
echo "jax_side gpu pass: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/pytest.log"
exit "$rc"
