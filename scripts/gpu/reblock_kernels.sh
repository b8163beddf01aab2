#!/usr/bin/env bash
# Issue 33's quantize and re-block kernels on the GPU machine, in parts (default: all three):
#   bash scripts/gpu/reblock_kernels.sh [tests] [bench] [step]
#   tests: the compiled kernels against their references, byte for byte (the weights' re-block,
#          pallas_reblock; slices read in place, also as bf16 of fp32; the blocked-operand
#          quantize, whole-block, packed and in column parts; the refresh's gapped images on dirty
#          memory; the images kept as ZeRO-3's shards, bytes as copied; the refresh's one-pass
#          kernel (amax and both planes from one read); q, k, v from three GEMMs within 1e-3;
#          the GELU inside the quantize within a bf16 rounding of XLA's, the block within 1e-3;
#          the transposed outputs from the colwise scale bytes the rows' call wrote; the GELU in
#          the GEMM's epilogue within its bound, alone and in the GPT block)
#   bench: benchmarks/bench_blocked_operands.py: the blocked-operand quantize's transposed outputs,
#          banded, whole-block and packed, two outputs in one call (banded and whole-block), the
#          GELU inside the kernel against XLA's GELU pass, the transposed write without the
#          arithmetic (copy_t, xla_transpose) (BENCH_ONLY, a regex of variants), and the
#          weights' re-block, XLA against the kernel (WEIGHTS=0 leaves it out)
#   step:  the 1.3B step (batch 8 x 1024, fp8_blocked GEMMs), FSDP2 eager and mxfp8:u4 (RUNS;
#          e.g. RUNS=fsdp2,mxfp8:u4,mxfp8:u4:qkv1,mxfp8:u4:gelu-in compares the qkv
#          linear as one GEMM and the GELU inside the linear; mxfp8:u4:packed the transposed
#          outputs packed, mxfp8:u4:given their colwise scales made by the rows' call,
#          mxfp8:u4:gelu-apart the GELU as XLA's pass instead of in the MLP's first GEMM's
#          epilogue),
#          profiled; with DUMP=1 every XLA module's optimized HLO is dumped and the fusions
#          named in FUSIONS (a regex; default: every loop convert, slice and concatenate
#          fusion) are listed with the module that holds them (fusions.log); TOP kernels listed
#          per category (default 30); GAPS=1 adds where the GPU stands idle in the step
# Repo root, machine python3, no install; logs under $OUT. One part per device call: tests up to
# 7 minutes (compiling; the blocked-operand byte test alone took 97 s on an H100, session 18),
# bench about 2, step 2.5-3 per three runs.
set -u
. "$(dirname "$0")/small_gpt.sh"
gpu_setup reblock_kernels
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests bench step)
for part in "${parts[@]}"; do
  t0=$SECONDS
  case "$part" in
    tests)
      timeout 420 python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
        tests/jax_side/mxfp8/test_pallas_reblock.py tests/jax_side/mxfp8/test_slices_in_place.py \
        tests/jax_side/mxfp8/test_blocked_operands.py tests/jax_side/test_linear_parts.py \
        tests/jax_side/test_linear_pre.py tests/bridge/test_mxfp8_slices.py \
        tests/torch_side/fsdp/test_group_buffers.py tests/jax_side/mxfp8/test_quantize_slice_into.py \
        tests/jax_side/mxfp8/test_given_scales.py tests/jax_side/mxfp8/test_epilogue.py \
        tests/jax_side/test_linear_post.py \
        > "$OUT/tests.log" 2>&1
      echo "tests: rc=$? $(tail -1 "$OUT/tests.log")"
      grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10 ;;
    bench)
      timeout 300 python3 benchmarks/bench_blocked_operands.py --warps 2,4,8 \
        --only "${BENCH_ONLY:-rows\[32x128,w2|rows_t|tiles_t|rows\+|gelu}" --out "$OUT/operands.json" \
        > "$OUT/operands.log" 2>&1
      echo "operands bench: rc=$?"; grep '"shape"' "$OUT/operands.log"
      [ "${WEIGHTS:-1}" = 0 ] && { echo "$part: $((SECONDS - t0)) s"; continue; }
      timeout 200 python3 benchmarks/bench_blocked_operands.py --weights --warps 2,4,8 \
        --out "$OUT/weights.json" > "$OUT/weights.log" 2>&1
      echo "weights bench: rc=$?"; grep '"shape"' "$OUT/weights.log" ;;
    step)
      flags=""
      [ "${DUMP:-0}" = 1 ] && flags="--xla_dump_to=/tmp/hlo_all --xla_dump_hlo_as_text"
      XLA_FLAGS="$flags" timeout 400 python3 -m benchmarks.bench_train_step --device cuda \
        --nproc 1 --config "${CONFIG:-gpt-1.3b}" --batch-size 8 --seq-len 1024 --steps 6 \
        --warmup 2 --gemm fp8_blocked --runs "${RUNS:-fsdp2,mxfp8:u4}" --profile \
        --profile-top "${TOP:-30}" $([ "${GAPS:-0}" = 1 ] && echo --profile-gaps) --out "$OUT/step.json" \
        > "$OUT/step.log" 2>&1
      echo "step: rc=$?"
      grep -A12 "^device cuda" "$OUT/step.log" | grep "^| "
      if [ "${DUMP:-0}" = 1 ]; then
        (cd /tmp/hlo_all && grep -lE "^ *(ROOT )?%?(${FUSIONS:-(loop|input)_(convert|slice|concatenate)_fusion(\.[0-9]+)?}) = " \
           *after_optimizations.txt | while read -r f; do
             echo "== $f"; grep -E "^ *(ROOT )?%?(${FUSIONS:-(loop|input)_(convert|slice|concatenate)_fusion(\.[0-9]+)?}) = " "$f" | cut -c1-400
           done) > "$OUT/fusions.log" 2>&1
        echo "fusions.log: $(grep -c '^==' "$OUT/fusions.log") modules"
      fi ;;
    *) echo "unknown part $part (tests, bench, step)"; exit 2 ;;
  esac
  echo "$part: $((SECONDS - t0)) s"
done
