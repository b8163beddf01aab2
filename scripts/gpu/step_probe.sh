#!/usr/bin/env bash
# One 1.3B mxfp8:u4 step (GEMM=fp8_blocked by default) with the optimized HLO of its unit programs
# dumped (one tarball) and the profile's per-category kernel listing 40 deep: where the copies of
# a step come from. Logs under $OUT.  bash scripts/gpu/step_probe.sh
set -u
OUT=${OUT:-$PWD/out/probe}
mkdir -p "$OUT" /tmp/hlo
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$(dirname "$0")/../.."
XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*unit.*" \
timeout 400 python3 -m benchmarks.bench_train_step --device cuda --nproc 1 \
  --config "${CONFIG:-gpt-1.3b}" --batch-size 8 --seq-len 1024 --steps 4 --warmup 2 --profile \
  --profile-top 40 --runs "${RUNS:-mxfp8:u4}" --gemm "${GEMM:-fp8_blocked}" \
  --out "$OUT/probe.json" > "$OUT/probe.log" 2>&1
echo "bench rc=$?"
grep -A60 "GPU ms by category" "$OUT/probe.log" | tail -70
(cd /tmp/hlo && ls | grep -E "after_optimizations(\.txt|-buffer-assignment\.txt)$" \
  | tar czf "$OUT/hlo.tgz" -T -)
ls -la "$OUT"
