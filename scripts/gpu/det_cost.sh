#!/usr/bin/env bash
# Cost of bridge.determinism in the step benchmark (issue 17): GPT-2 124M, batch 8 x 1024, one
# GPU, runs mxfp8 and fsdp2, launched in turn in one device call: default kernels, deterministic,
# deterministic with XLA autotuning back on, default again (the launch-to-launch noise).
# Repo root, machine python3; logs under $OUT; < ~7 min.
set -u
OUT=${OUT:-$PWD/out/det_cost}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$(dirname "$0")/../.."
B=(--device cuda --nproc 1 --config gpt2-124m --batch-size 8 --seq-len 1024 --steps 10 --warmup 3
   --runs mxfp8,fsdp2)
run() {  # name, XLA_FLAGS, extra args
  local name=$1 flags=$2; shift 2
  local t0=$SECONDS
  XLA_FLAGS="$flags" timeout 150 python3 -m benchmarks.bench_train_step "${B[@]}" "$@" \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
  grep -E "^\| (mxfp8|fsdp2)" "$OUT/$name.log" | tee -a "$OUT/summary.log"
}
run default ""
run deterministic "" --deterministic
run det_autotune "--xla_gpu_autotune_level=4" --deterministic
run default_again ""
