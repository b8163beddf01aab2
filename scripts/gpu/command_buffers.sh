#!/usr/bin/env bash
# The 1.3B step under XLA's command buffers (CUDA graphs) on and off, one process per
# XLA_FLAGS setting (XLA reads the flags once, at its backend's start), on the GPU machine:
#   bash scripts/gpu/command_buffers.sh
# base: FSDP2 eager and mxfp8:u4 with XLA's defaults; nocb: mxfp8:u4 with
# --xla_gpu_enable_command_buffer= (every kernel launched by itself); graphs: mxfp8:u4:graphs
# (the cuBLASLt handlers' twins recorded into the command buffers); nocb2: FSDP2 and mxfp8:u4
# without command buffers again. Logs under $OUT; BENCHMARKS.md "session 22".
set -u
cd "$(dirname "$0")/../.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
go() { # name flags runs
  XLA_FLAGS="$2" timeout 170 python3 -m benchmarks.bench_train_step --device cuda --nproc 1 \
    --config gpt-1.3b --batch-size 8 --seq-len 1024 --steps 6 --warmup 2 --gemm fp8_blocked \
    --runs "$3" --profile --profile-top 3 > "$OUT/$1.log" 2>&1
  echo "== $1 ($2) rc=$?"; grep -E "^\| (fsdp2|mxfp8)" "$OUT/$1.log" | cut -c1-200
  grep -A10 "GPU ms, one warm step" "$OUT/$1.log" | grep -E "total|copies|other|gemm"
}
go base "" "fsdp2,mxfp8:u4"
go nocb "--xla_gpu_enable_command_buffer=" "mxfp8:u4"
go graphs "" "mxfp8:u4:graphs"
go nocb2 "--xla_gpu_enable_command_buffer=" "fsdp2,mxfp8:u4"
