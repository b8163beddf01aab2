#!/usr/bin/env bash
# Issue 32 on one H200: the training step at GPT-scale side by side with what a user would
# otherwise run (bench_train_step: this project's MXFP8 and bf16 units against PyTorch FSDP2's
# usual recipe, eager and compiled, and torchao float8 rowwise), GPU time by kernel category.
# Logs and JSON under $OUT. torchao travels as a wheel in .whl/ (carry ".whl").
#   bash scripts/gpu/scale.sh ours1300 peers1300
# RUNS picks the runs of the "custom" part (with CONFIG, default gpt-1.3b; bench_train_step --runs:
# e.g. mxfp8:u4 = 4 blocks per FSDP unit, mxfp8:u4:r the same with activation recompute,
# mxfp8:u4:qkv1 the same with the qkv linear as one GEMM and a split, mxfp8:u4:gelu-in with
# the MLP's GELU inside its second linear, mxfp8:u4:pairs with the quantize's two operands of x and
# of dy made in one kernel call each);
# GEMM=fp8_blocked (any common.kernels.GemmImpl) sets the GEMM of this project's runs; BATCH
# (default 8) the sequences of 1024 tokens per step.
set -u
OUT=${OUT:-$PWD/out/scale}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")/../.."
. scripts/gpu/torchao_wheel.sh
step() {  # step NAME CONFIG RUNS
  timeout 540 python3 -m benchmarks.bench_train_step --device cuda --nproc 1 --config "$2" \
    --batch-size "${BATCH:-8}" --seq-len 1024 --steps 6 --warmup 2 --profile --runs "$3" \
    ${GEMM:+--gemm "$GEMM"} --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  grep -A40 "^device cuda" "$OUT/$1.log"
}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(ours1300 peers1300)
for part in "${parts[@]}"; do
  t0=$SECONDS
  case "$part" in
    ours1300) step ours1300 gpt-1.3b mxfp8:u4,bf16:u4,fsdp2 ;;
    peers1300) step peers1300 gpt-1.3b fsdp2,fsdp2-compile,torchao,mxfp8:u4 ;;
    ours350) step ours350 gpt2-350m mxfp8:u4,bf16:u4,fsdp2,fsdp2-compile ;;
    custom) step custom "${CONFIG:-gpt-1.3b}" "${RUNS:-mxfp8:u4,fsdp2}" ;;
  esac
  echo "=== $part: $((SECONDS - t0)) s"
done
