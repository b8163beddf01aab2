#!/usr/bin/env bash
# The batched GPU pass (a 2-GPU machine): numerics, bridge, FSDP (NCCL, 1 and 2 GPUs), parity,
# training demo. All parts together take more than one device call's 10 minutes: pass a subset
# per call. The summary line of each part goes to $OUT/summary.log. Usage on the device: `bash scripts/gpu/all.sh [parts...]`.
# The device returns at most 8 files, so each part's own files (written to a scratch OUT) are
# appended, with a header each, to one $OUT/<part>.log.
set -u
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BASE=${OUT:-$PWD/out}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(jax_side bridge fsdp parity train repro)
for part in "${parts[@]}"; do
  [ -f "scripts/gpu/$part.sh" ] || { echo "$part: no script" | tee -a "$BASE/summary.log"; continue; }
  t0=$SECONDS
  scratch=/tmp/gpu_out/$part
  rm -rf "$scratch" && mkdir -p "$scratch"
  OUT="$scratch" bash "scripts/gpu/$part.sh" > "$BASE/$part.log" 2>&1
  rc=$?
  for f in "$scratch"/*; do
    [ -f "$f" ] && { echo "===== $part/$(basename "$f")"; cat "$f"; } >> "$BASE/$part.log"
  done
  echo "$part: rc=$rc in $((SECONDS - t0)) s" | tee -a "$BASE/summary.log"
done
