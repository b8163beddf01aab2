#!/usr/bin/env bash
# Bridge on the GPU machine: the gpu-marked bridge tests (zero-copy pointers on CUDA for every
# dtype and transport, stream ordering, lifetime, device index, no JAX preallocation, the MXFP8
# linear op against the pure-JAX reference) and the bridge benchmark on CUDA.
# Runs from the repo root with the machine's python3 (torch 2.11 + jax 0.11.2, no install);
# writes logs under $OUT. Budget: < ~3 minutes (tests capped at 120 s, benchmark at 75 s).
set -u
OUT=${OUT:-$PWD/out/bridge}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
cd "$(dirname "$0")/../.."

{
  date -u
  nvidia-smi -L
  python3 -c "import torch, jax; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'gpus', torch.cuda.device_count()); print('jax', jax.__version__, jax.devices())"
  python3 -c "import bridge; print(bridge.dlpack_support())"
} 2>&1 | tee "$OUT/env.log"

t0=$SECONDS
timeout 120 python3 -m pytest -q -rs -m gpu --durations=10 -p no:cacheprovider tests/bridge \
  2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}
echo "bridge gpu tests: rc=$tests_rc in $((SECONDS - t0)) s" | tee -a "$OUT/pytest.log"

t0=$SECONDS
timeout 75 python3 -m benchmarks.bench_bridge --device cuda --repeat 50 --repeat-linear 10 \
  --json 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "bridge benchmark: rc=$bench_rc in $((SECONDS - t0)) s" | tee -a "$OUT/bench.log"

[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
