#!/usr/bin/env bash
# Issue 32 on one H200: Torch and JAX in one CUDA memory pool (bridge.memory_pool, --shared-pool)
# with the main grads released at zero_grad. Repo root, the machine's python3 (torch 2.11 + jax
# 0.11.2), no install; logs under $OUT.
#   bash scripts/gpu/shared_pool.sh [tests] [train] [step1300] [step350] [step124]
#   tests:    the GPU tests of the bridge (the pool's: fresh processes pick the allocator) and
#             of torch_side
#   train:    mxfp8-train --deterministic, 6 steps with and without --shared-pool: the same losses
#   step1300: the 1.3B step (batch 8 x 1024, fp8_blocked GEMMs): FSDP2 and mxfp8:u4 with each
#             framework's allocator, then this project's runs in the shared pool (peak: the pool's)
#             (OWN_RUNS, default fsdp2,mxfp8:u4,bf16:u4; SHARED_RUNS, default mxfp8:u4,bf16:u4)
#   step350:  the same at GPT-2 350M (FSDP2 and mxfp8:u4, then mxfp8:u4 in the shared pool)
#   step124:  the same at GPT-2 124M
set -u
. "$(dirname "$0")/small_gpt.sh"
gpu_setup shared_pool
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests train step1300)
bench() {  # bench NAME CONFIG ARGS...
  local name=$1 config=$2; shift 2
  timeout 280 python3 -m benchmarks.bench_train_step --device cuda --nproc 1 --config $config \
    --batch-size 8 --seq-len 1024 --steps ${STEPS:-8} --warmup 2 --gemm fp8_blocked \
    --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$?"; grep -A12 "^device cuda" "$OUT/$name.log" | grep "^| \(run\|fsdp2\|mxfp8\|bf16\|gemm\|copies\|other\|quantize\|total\)"
}
for part in "${parts[@]}"; do
  t0=$SECONDS
  case "$part" in
    tests)
      timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/bridge tests/torch_side \
        > "$OUT/tests.log" 2>&1
      echo "tests: rc=$? $(tail -1 "$OUT/tests.log")" ;;
    train)
      { small_train --steps 6 --metrics "$OUT/own.jsonl" &&
        small_train --steps 6 --shared-pool --metrics "$OUT/shared.jsonl"; } > "$OUT/train.log" 2>&1
      rc=$?
      python3 - "$OUT" <<'EOF' >> "$OUT/train.log" 2>&1
import json, sys
def losses(p):
    return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if r.get("kind") == "step"}
own, shared = losses(f"{sys.argv[1]}/own.jsonl"), losses(f"{sys.argv[1]}/shared.jsonl")
same = bool(own) and own == shared
print(f"--shared-pool: {'bit-identical' if same else 'DIFFERENT'} losses ({shared} vs {own})")
EOF
      echo "train: rc=$rc $(tail -1 "$OUT/train.log")" ;;
    step1300)
      bench own gpt-1.3b --runs ${OWN_RUNS:-fsdp2,mxfp8:u4,bf16:u4}
      bench shared gpt-1.3b --shared-pool --runs ${SHARED_RUNS:-mxfp8:u4,bf16:u4} ;;
    step350|step124)
      size=${part#step}
      bench own$size gpt2-${size}m --runs fsdp2,mxfp8:u4
      bench shared$size gpt2-${size}m --shared-pool --runs mxfp8:u4 ;;
  esac
  echo "$part: $((SECONDS - t0)) s"
done 2>&1 | tee "$OUT/summary.log"
