#!/usr/bin/env bash
# Cross-framework parity on the GPU machine: the gpu-marked parity test (TorchGPT on CUDA through
# the bridge op vs FlaxGPT on the same CUDA buffers), the models/parity suite on GPU-visible JAX,
# and the parity report on CUDA (MXFP8 and the high-precision control), plus the CPU main job.
# Runs from the repo root with the machine's python3 (torch 2.11 + jax 0.11.2 + flax 0.12.10, no
# install); writes logs under $OUT. Budget: < ~7 minutes (each step capped).
set -u
OUT=${OUT:-$PWD/out/parity}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$(dirname "$0")/../.."

{
  date -u
  nvidia-smi -L
  python3 -c "import torch, jax, flax; print('torch', torch.__version__, 'jax', jax.__version__, \
'flax', flax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.log"

t0=$SECONDS
timeout 150 python3 -m pytest -q -rs --durations=10 -p no:cacheprovider \
  tests/apps/parity/test_parity.py tests/models \
  -k "cuda or not sharded" 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}
echo "parity tests (gpu-visible, sharded gloo case excluded): rc=$tests_rc in $((SECONDS - t0)) s" \
  | tee -a "$OUT/pytest.log"

t0=$SECONDS
{
  timeout 150 python3 -m apps.parity --world-size 1 --device cuda --compute op
  echo "rc=$?"
  timeout 120 python3 -m apps.parity --world-size 1 --device cuda --compute op --mode high_precision
  echo "rc=$?"
} 2>&1 | tee "$OUT/report_cuda.log"
echo "cuda reports in $((SECONDS - t0)) s" | tee -a "$OUT/report_cuda.log"

if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then  # FSDP on 2 NCCL ranks vs Flax on each rank's GPU
  t0=$SECONDS
  timeout 150 python3 -m apps.parity --world-size 2 --device cuda --compute op 2>&1 | tee "$OUT/report_nccl.log"
  echo "rc=${PIPESTATUS[0]}; sharded cuda report in $((SECONDS - t0)) s" | tee -a "$OUT/report_nccl.log"
fi

[ "$tests_rc" = 0 ]
