#!/usr/bin/env bash
# Issue 20 on a two-GPU machine (kind nvidia-h200-x2): everything that needs two CUDA ranks.
#   bash scripts/gpu/two_gpu.sh [tests] [step124] [step350] [train] [parity] [trace]
# - tests:   the overlap cases (bytes independent of the schedule, peak bucket memory, trace)
#            and the unit-compute cases with NCCL on 2 GPUs;
# - step124 / step350: the step benchmark at world size 2, MXFP8 (overlap on and off) beside
#            FSDP2 bf16 in one launch, with GPU, NCCL and exposed-communication time;
# - train:   torchrun --nproc_per_node 2 training, 20 steps straight vs 10 + save + resume to 20
#            (--deterministic): the losses after the resume must be bit-identical;
# - parity:  the sharded Torch-vs-Flax parity report on two CUDA ranks;
# - trace:   a Chrome trace of two steps at 124M on two ranks ($OUT/trace.rank*.json).
# Repo root, machine python3 (torch 2.11 + jax 0.11.2), no install; logs under $OUT.
set -u
OUT=${OUT:-$PWD/out/two_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")/../.."
n=$(nvidia-smi -L | wc -l)
if [ "$n" -lt 2 ]; then echo "two_gpu.sh: this machine has $n GPU(s); it needs 2"; exit 2; fi
nvidia-smi -L > "$OUT/env.log"
python3 -c "import torch, jax; print('torch', torch.__version__, 'jax', jax.__version__)" >> "$OUT/env.log"
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests step124 step350 train parity trace)
for part in "${parts[@]}"; do
  t0=$SECONDS
  case "$part" in
    tests)
      MXFP8_TEST_BACKEND=nccl timeout 400 python3 -m pytest -q -x -p no:cacheprovider \
        tests/torch_side/test_nccl.py 2>&1 | tail -8 | tee "$OUT/tests.log" ;;
    step124|step350)
      cfg=gpt2-124m; [ "$part" = step350 ] && cfg=gpt2-350m
      timeout 500 python3 -m benchmarks.bench_train_step --device cuda --nproc 2 \
        --config $cfg --batch-size 8 --seq-len 1024 --steps 8 --warmup 3 \
        --runs mxfp8,mxfp8-sync,fsdp2 --out "$OUT/$part.json" > "$OUT/$part.log" 2>&1
      tail -8 "$OUT/$part.log" ;;
    train)
      common=(--device cuda --config small --steps 20 --deterministic --no-progress)
      timeout 250 torchrun --standalone --nproc_per_node 2 -m apps.training "${common[@]}" \
        --metrics "$OUT/straight.jsonl" > "$OUT/train_straight.log" 2>&1
      timeout 250 torchrun --standalone --nproc_per_node 2 -m apps.training "${common[@]}" \
        --steps 20 --save-dir "$OUT/ck" --save-every 10 --metrics "$OUT/first.jsonl" \
        > "$OUT/train_first.log" 2>&1
      rm -rf "$OUT/ck/step_000020"; ln -sfn step_000010 "$OUT/ck/latest" 2>/dev/null
      timeout 250 torchrun --standalone --nproc_per_node 2 -m apps.training "${common[@]}" \
        --resume "$OUT/ck/step_000010" --metrics "$OUT/resumed.jsonl" \
        > "$OUT/train_resumed.log" 2>&1
      python3 - "$OUT" <<'PY' | tee "$OUT/train.log"
import json, sys
out = sys.argv[1]
def losses(name):
    rows = [json.loads(l) for l in open(f"{out}/{name}.jsonl")]
    return {r["step"]: r["loss"] for r in rows if r.get("kind", r.get("type")) != "run" and "loss" in r}
a, b = losses("straight"), losses("resumed")
same = [s for s in b if a.get(s) == b[s]]
print(f"resumed steps {sorted(b)}: {len(same)}/{len(b)} losses bit-identical to the straight run")
sys.exit(0 if b and len(same) == len(b) else 1)
PY
      ;;
    parity)
      timeout 300 python3 -m apps.parity --world-size 2 --device cuda --compute op 2>&1 | tail -25 \
        | tee "$OUT/parity.log" ;;
    trace)
      timeout 250 torchrun --standalone --nproc_per_node 2 -m apps.training --device cuda \
        --config gpt2-124m --batch-size 8 --seq-len 1024 --micro-batches 1 --steps 3 \
        --no-progress --trace "$OUT/trace.json" > "$OUT/trace.log" 2>&1; tail -3 "$OUT/trace.log" ;;
  esac
  echo "=== $part: $((SECONDS - t0)) s"
done
