#!/usr/bin/env bash
# Issue 21 on one H200: GPT-2 124M on the stdlib corpus, 60 steps, with today's defaults (constant
# lr, no clipping: the loss jumps at step 2) and with warmup + cosine decay + clipping; the
# telemetry's cost (the same run with --telemetry); metrics JSONL under $OUT for mxfp8-plot.
#   bash scripts/gpu/schedule.sh [constant] [cosine] [cosine_telemetry]
set -u
OUT=${OUT:-$PWD/out/schedule}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")/../.."
common=(--device cuda --nproc 1 --config gpt2-124m --data stdlib --seq-len 1024 --batch-size 8
        --micro-batches 1 --steps 60 --lr 6e-4 --no-progress)
sched=(--warmup-steps 10 --lr-schedule cosine --min-lr 6e-5 --grad-clip 1.0)
run() {  # name, extra args...
  local name=$1; shift
  t0=$SECONDS
  timeout 170 python3 -m apps.training "${common[@]}" "$@" --metrics "$OUT/$name.jsonl" \
    > "$OUT/$name.log" 2>&1
  echo "=== $name: rc=$? in $((SECONDS - t0)) s"; tail -3 "$OUT/$name.log"
}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(constant cosine cosine_telemetry)
for part in "${parts[@]}"; do
  case "$part" in
    constant) run constant ;;
    cosine) run cosine "${sched[@]}" ;;
    cosine_telemetry) run cosine_telemetry "${sched[@]}" --telemetry ;;
  esac
done
