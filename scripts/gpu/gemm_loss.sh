#!/usr/bin/env bash
# Issue 33's loss comparison on the GPU machine: GPT-2 124M, 200 steps, the same seed, data
# (the standard library's sources as bytes) and schedule, three GEMMs: the exact MXFP8 GEMM (the
# GPU default, dequant_bf16_dot), fp8_blocked (Hopper's FP8 tensor cores), and dequant_dot (the
# same exact values as the default, fp32 dot: a control that changes only the order of fp32
# sums). Then benchmarks/gemm_loss.py against the stated bound. Repo root, machine python3, no
# install; metrics and the comparison under $OUT; ~4-6 minutes.
# STEPS=..., BATCH=..., BPU=... (blocks per unit) override the defaults.
set -u
OUT=${OUT:-$PWD/out/gemm_loss}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$(dirname "$0")/../.."
common=(--device cuda --config gpt2-124m --data stdlib --seq-len 1024
        --batch-size "${BATCH:-8}" --steps "${STEPS:-200}" --blocks-per-unit "${BPU:-4}"
        --lr 6e-4 --lr-schedule cosine --warmup-steps 20 --grad-clip 1.0 --seed 0
        --no-progress)
rc=0
for gemm in dequant_bf16_dot fp8_blocked dequant_dot; do
  t0=$SECONDS
  timeout 200 python3 -m apps.training "${common[@]}" --gemm "$gemm" \
    --metrics "$OUT/$gemm.jsonl" > "$OUT/$gemm.log" 2>&1
  r=$?
  tail -3 "$OUT/$gemm.log"
  echo "$gemm: rc=$r in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
  [ "$r" -eq 0 ] || rc=$r
done
python3 -m benchmarks.gemm_loss "$OUT/dequant_bf16_dot.jsonl" "$OUT/fp8_blocked.jsonl" \
  --control "$OUT/dequant_dot.jsonl" --out "$OUT/compare.json" 2>&1 | tee "$OUT/compare.log"
r=${PIPESTATUS[0]}
[ "$r" -eq 0 ] || rc=$r
exit "$rc"
