# Sourced (not run) by GPU scripts: gpu_setup by reliability.sh, shared_pool.sh and
# reblock_kernels.sh, small_train by the first two (they train the small GPT on one GPU):
#   gpu_setup NAME   logs under $OUT (default ./out/NAME), the environment of a run sharing the
#                    GPU between Torch and JAX, a JAX compilation cache of its own, the repo root
#                    as the working directory
#   small_train ARGS the small GPT, 4 blocks in one FSDP unit, deterministic, on one GPU
gpu_setup() {
  OUT=${OUT:-$PWD/out/$1}
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
  export MXFP8_JAX_CACHE=/tmp/jax_cache_$1
  cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
}
small_train() {
  python3 -m apps.training --device cuda --config small --seq-len 128 --batch-size 8 \
    --micro-batches 1 --blocks-per-unit 4 --deterministic --no-progress "$@"
}
