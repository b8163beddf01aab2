#!/usr/bin/env bash
# FSDP on the GPU machine (2 GPUs): the torch_side parity + wire cases with NCCL on 1 and 2 GPUs
# (each rank owns one GPU, sees it as cuda:0, and runs the JAX MXFP8 kernels there through the
# bridge), then training step times per strategy for BENCHMARKS.md.
# Runs from the repo root with the machine's python3 (torch 2.11 + jax 0.11.2, no install);
# writes logs and JSON under $OUT. Budget: < ~4 minutes (parity capped at 150 s, timing at 90 s).
set -u
OUT=${OUT:-$PWD/out/fsdp}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")/../.."

{
  date -u
  nvidia-smi -L
  python3 -c "import torch, jax; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version()); print('jax', jax.__version__)"
} 2>&1 | tee "$OUT/env.log"

WORLDS="1 2"  # world size 2 needs a second GPU; on a one-GPU machine only world 1 runs
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] || WORLDS="1"
t0=$SECONDS
timeout 150 python3 -m benchmarks.bench_fsdp --backend nccl --world-sizes $WORLDS --no-timing \
  --out "$OUT" 2>&1 | tee "$OUT/parity.log"
parity_rc=${PIPESTATUS[0]}
echo "fsdp parity (nccl): rc=$parity_rc in $((SECONDS - t0)) s" | tee -a "$OUT/parity.log"

t0=$SECONDS
timeout 90 python3 -m benchmarks.bench_fsdp --backend nccl --world-sizes $WORLDS --no-parity \
  --strategies no_shard optim_grads_params --d-model 1024 --d-ff 4096 --blocks 4 --tokens 2048 \
  --warmup 2 --steps 8 --out "$OUT" 2>&1 | tee "$OUT/timing.log"
timing_rc=${PIPESTATUS[0]}
echo "fsdp timing (nccl): rc=$timing_rc in $((SECONDS - t0)) s" | tee -a "$OUT/timing.log"

[ "$parity_rc" = 0 ] && [ "$timing_rc" = 0 ]
