#!/usr/bin/env bash
# Issue 20 on one H200: the overlap / pool / trace code on CUDA (NCCL world 1, the bridge's unit
# tests), then the 124M step with and without overlap beside FSDP2 bf16 in one launch, and a
# Chrome trace of two 124M steps. Two-GPU runs: scripts/gpu/two_gpu.sh.
#   bash scripts/gpu/overlap.sh [tests] [step124] [trace]
set -u
OUT=${OUT:-$PWD/out/overlap}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")/../.."
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests step124 trace)
for part in "${parts[@]}"; do
  t0=$SECONDS
  case "$part" in
    tests)
      timeout 420 python3 -m pytest -q -p no:cacheprovider tests/torch_side/test_nccl.py \
        tests/torch_side/fsdp/test_plane_bucket.py tests/torch_side/fsdp/test_grad_reducer.py \
        tests/bridge/test_units.py 2>&1 | tail -15 | tee "$OUT/tests.log" ;;
    step124)
      timeout 420 python3 -m benchmarks.bench_train_step --device cuda --nproc 1 \
        --config gpt2-124m --batch-size 8 --seq-len 1024 --steps 10 --warmup 3 \
        --runs ${RUNS:-mxfp8,mxfp8-sync,fsdp2,mxfp8,mxfp8-sync,fsdp2} --out "$OUT/step124.json" \
        > "$OUT/step124.log" 2>&1; tail -10 "$OUT/step124.log" ;;
    trace)
      timeout 200 python3 -m apps.training --device cuda --config gpt2-124m --batch-size 8 \
        --seq-len 1024 --micro-batches 1 --steps 3 --no-progress --trace "$OUT/trace.json" \
        > "$OUT/trace.log" 2>&1; tail -3 "$OUT/trace.log"; ls -la "$OUT" ;;
  esac
  echo "=== $part: $((SECONDS - t0)) s"
done
