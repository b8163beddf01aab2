#!/usr/bin/env bash
# Reproducible GPU runs (issue 17): the same 12-step GPT-2 124M mxfp8-train command launched twice,
# each launch compiling afresh (MXFP8_JAX_CACHE=off), losses compared bit for bit
# (benchmarks/compare_losses.py), with --deterministic (must be identical) and without (reported);
# then a --deterministic save at step 6 + resume to 12 against the whole run (must be identical).
# Extra variants by name (the sources one at a time, for BENCHMARKS.md):
#   bash scripts/gpu/repro.sh det nodet detops detops_noautotune det_autotune
# Repo root, machine python3 (torch 2.11 + jax 0.11.2), no install; logs under $OUT; ~4 min.
set -u
OUT=${OUT:-$PWD/out/repro}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false MXFP8_JAX_CACHE=off
cd "$(dirname "$0")/../.."
M=/tmp/repro
rm -rf $M && mkdir -p $M
ARGS=(--device cuda --config gpt2-124m --data stdlib --seq-len 1024 --batch-size 8
      --micro-batches 1 --steps 12 --lr 6e-4 --no-progress)
launch() {  # name, XLA_FLAGS, extra args...
  local name=$1 flags=$2; shift 2
  local t0=$SECONDS
  XLA_FLAGS="$flags" timeout 120 torchrun --standalone --nproc_per_node 1 -m apps.training \
    "${ARGS[@]}" --metrics $M/$name.jsonl "$@" > $M/$name.log 2>&1
  echo "$name: rc=$? in $((SECONDS - t0)) s" | tee -a "$OUT/repro.log"
}
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(det nodet)
rc=0
for v in "${variants[@]}"; do
  for i in 1 2; do
    case $v in
      det) launch ${v}_$i "" --deterministic ;;
      nodet) launch ${v}_$i "" ;;
      detops) launch ${v}_$i "--xla_gpu_deterministic_ops=true" ;;
      detops_noautotune) launch ${v}_$i "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0" ;;
      det_autotune) launch ${v}_$i "--xla_gpu_autotune_level=4" --deterministic ;;
      *) echo "unknown variant $v" | tee -a "$OUT/repro.log"; rc=1; continue 2 ;;
    esac
  done
  python3 -m benchmarks.compare_losses $M/${v}_1.jsonl $M/${v}_2.jsonl 2>&1 | tee -a "$OUT/repro.log"
  s=${PIPESTATUS[0]}
  echo "$v: two launches $([ $s = 0 ] && echo identical || echo DIFFER)" | tee -a "$OUT/repro.log"
  [ "$v" = det ] && [ $s != 0 ] && rc=1
done
if [ -f $M/det_1.jsonl ]; then  # resume: save at 6, resume to 12, against det_1
  launch resume_a "" --deterministic --steps 6 --save-dir $M/ck --save-every 6
  cp $M/resume_a.jsonl $M/resume.jsonl
  launch resume_b "" --deterministic --resume $M/ck --save-dir $M/ck --metrics $M/resume.jsonl
  python3 -m benchmarks.compare_losses $M/det_1.jsonl $M/resume.jsonl 2>&1 | tee -a "$OUT/repro.log"
  s=${PIPESTATUS[0]}
  echo "resume: $([ $s = 0 ] && echo identical || echo DIFFERS) to the whole run" | tee -a "$OUT/repro.log"
  [ $s != 0 ] && rc=1
fi
for f in $M/*.log; do grep -q "Traceback" "$f" && { echo "== $f"; tail -20 "$f"; }; done >> "$OUT/errors.log" 2>&1
tar czf "$OUT/runs.tgz" -C $M --exclude ck .
exit $rc
