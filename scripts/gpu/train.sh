#!/usr/bin/env bash
# The hybrid training demo on GPUs: 2 NCCL ranks (one GPU each), MXFP8 vs the fp32 control.
# Repo root, machine python3 (torch 2.11 + jax 0.11.2), no install; logs under $OUT; < ~2 min.
set -u
OUT=${OUT:-$PWD/out/train}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")/../.."
t0=$SECONDS
timeout 150 python3 -m apps.training --device cuda --world-size 2 --compare --steps 60 \
  --print-every 10 2>&1 | tee "$OUT/train_cuda.log"
rc=${PIPESTATUS[0]}
echo "training demo (cuda, 2 ranks): rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/train_cuda.log"
exit "$rc"
