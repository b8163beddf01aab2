#!/usr/bin/env bash
# Issue 30 on one H200: the whole GPU test pass (`pytest -m gpu tests`), then the recommended
# GPU setting (--blocks-per-unit 4) saving and resuming bit for bit on CUDA, then one side-by-side
# step measurement at GPT-2 124M (the span programs now pass block outputs behind an optimization
# barrier). Repo root, the machine's python3 (torch 2.11 + jax 0.11.2), no install; logs under
# $OUT.   bash scripts/gpu/reliability.sh [tests] [resume] [step124]
set -u
. "$(dirname "$0")/small_gpt.sh"
gpu_setup reliability
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests resume step124)
for part in "${parts[@]}"; do
  t0=$SECONDS
  case "$part" in
    tests)
      timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$OUT/tests.log" 2>&1
      echo "tests: rc=$? $(tail -1 "$OUT/tests.log")" ;;
    resume)  # 6 steps straight, against 4 steps saved every 2 and resumed to 6 into the same dir
      rm -rf /tmp/ck_full /tmp/ck_resumed
      { small_train --steps 6 --metrics "$OUT/full.jsonl" &&
        small_train --steps 4 --save-dir /tmp/ck_resumed --save-every 2 &&
        small_train --steps 6 --resume /tmp/ck_resumed --save-dir /tmp/ck_resumed \
          --metrics "$OUT/resumed.jsonl"; } > "$OUT/resume.log" 2>&1
      rc=$?
      python3 - "$OUT" <<'EOF' >> "$OUT/resume.log" 2>&1
import json, sys
def losses(p):
    return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if r.get("kind") == "step"}
full, resumed = losses(f"{sys.argv[1]}/full.jsonl"), losses(f"{sys.argv[1]}/resumed.jsonl")
same = bool(resumed) and all(full[k] == v for k, v in resumed.items())  # none: it failed
verdict = "bit-identical" if same else "DIFFERENT" if resumed else "NOT RESUMED (no step)"
print(f"resumed steps {sorted(resumed)}: {verdict} to the "
      f"uninterrupted run ({resumed} vs {full})")
EOF
      echo "resume: rc=$rc $(tail -1 "$OUT/resume.log")"; ls -a /tmp/ck_resumed >> "$OUT/resume.log" ;;
    step124)
      timeout 300 python3 -m benchmarks.bench_train_step --device cuda --nproc 1 \
        --config gpt2-124m --batch-size 8 --seq-len 1024 --steps 10 --warmup 3 \
        --runs mxfp8:u4,fsdp2 --out "$OUT/step124.json" > "$OUT/step124.log" 2>&1
      echo "step124: rc=$? $(tail -4 "$OUT/step124.log" | tr '\n' ' ')" ;;
  esac
  echo "$part: $((SECONDS - t0)) s"
done 2>&1 | tee "$OUT/summary.log"
