#!/usr/bin/env bash
# Issue 19 on one H200: the unit programs' GPU tests, then the training step side by side (unit
# and op compute, bf16 linears, FSDP2 bf16 eager, torchao float8 rowwise + FSDP2 compiled) at
# GPT-2 124M and 350M. Logs under $OUT. torchao travels as a wheel in .whl/ (carry ".whl").
#   bash scripts/gpu/units.sh tests step124 step350 warm
# RUNS124 / RUNS350 / WARM_RUN pick the runs (bench_train_step --runs; e.g. mxfp8:u4 = 4 blocks
# per FSDP unit, mxfp8:u4:r the same with the unit programs' activation recompute).
set -u
OUT=${OUT:-$PWD/out/units}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")/../.."
. scripts/gpu/torchao_wheel.sh
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests step124 step350 warm)
for part in "${parts[@]}"; do
  t0=$SECONDS
  case "$part" in
    tests)
      timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/bridge/test_units.py \
        tests/torch_side/test_nccl.py \
        2>&1 | tail -8 ;;
    step124)
      timeout 420 python3 -m benchmarks.bench_train_step --device cuda --nproc 1 \
        --config gpt2-124m --batch-size 8 --seq-len 1024 --steps 10 --warmup 3 --profile \
        --runs ${RUNS124:-mxfp8,mxfp8-op,bf16,fsdp2,torchao} --out "$OUT/step124.json" \
        > "$OUT/step124.log" 2>&1; tail -12 "$OUT/step124.log" ;;
    step350)
      timeout 420 python3 -m benchmarks.bench_train_step --device cuda --nproc 1 \
        --config gpt2-350m --batch-size 8 --seq-len 1024 --steps 8 --warmup 3 --pyprofile 2 \
        --runs ${RUNS350:-mxfp8,fsdp2,torchao} --out "$OUT/step350.json" > "$OUT/step350.log" 2>&1
      tail -8 "$OUT/step350.log" ;;
    warm)  # first step cold (empty compilation cache), then a second launch on the warm cache
      rm -rf /tmp/jax_cache_units
      for launch in cold warm; do
        timeout 200 python3 -m benchmarks.bench_train_step --device cuda --nproc 1 \
          --config gpt2-124m --batch-size 8 --seq-len 1024 --steps 2 --warmup 0 \
          --runs ${WARM_RUN:-mxfp8} \
          --compile-cache /tmp/jax_cache_units --out "$OUT/first_$launch.json" 2>&1 | tail -1
      done ;;
  esac
  echo "=== $part: $((SECONDS - t0)) s"
done
