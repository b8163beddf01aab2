#!/usr/bin/env bash
# TE-JAX on the GPU machine (no network there): install the carried wheels, build the TE-JAX
# extension, run the GPU parity tests and the te-vs-xla benchmark. docs/te_backend.md says how
# the carried folders are made here (TE 2.20.2, cu13, Python 3.12):
#   .te0/   small wheels, transformer_engine_jax-2.20.2.tar.gz, cu13.sha256
#   .te1/ .. .te5/   one part each of transformer_engine_cu13-2.20.2 (split -b 58M -d -a 1)
# The working tree may carry at most 64 MiB per call, so the parts travel one call each:
#   call k (k = 1..4):  carry [".te<k>"],         command: scripts/gpu/te.sh stage
#   call 5:             carry [".te5", ".te0"],   command: scripts/gpu/te.sh all   (or verify)
# in quick succession (the machine stays warm ~30 s between calls). Results go to $OUT.
set -u
OUT=${OUT:-$PWD/out/te}
mkdir -p "$OUT" /tmp/te_parts
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
SITE=/tmp/site
# TE loads cuDNN from CUDNN_HOME, else the system's; JAX loads the pip nvidia-cudnn wheel. Two
# cuDNN builds in one process fail ("libcudnn_heuristic.so.9: undefined symbol ..."), so point
# TE at the very cuDNN that JAX uses.
PURELIB=$(python3 -c "import sysconfig; print(sysconfig.get_path('purelib'))")
CUDNN_SO=$(find "$PURELIB/nvidia" -name 'libcudnn.so.9*' 2>/dev/null | head -1)
if [ -n "$CUDNN_SO" ]; then
  export CUDNN_HOME=$(dirname "$CUDNN_SO")
  # libtransformer_engine.so has no RUNPATH and NEEDs every libcudnn_*.so.9: without this the
  # ones JAX has not loaded yet come from the system's cuDNN (/lib/x86_64-linux-gnu) and clash.
  export LD_LIBRARY_PATH=$CUDNN_HOME${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
echo "CUDNN_HOME=${CUDNN_HOME:-unset}"
WHEEL=transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl

stage() {  # move this call's part(s) out of the working tree, where they persist while warm
  for p in .te[1-9]/part.*; do [ -e "$p" ] && cp "$p" /tmp/te_parts/; done
  ls -la /tmp/te_parts
}

install() {
  (cd /tmp/te_parts && cat part.* > "/tmp/$WHEEL") && (cd /tmp && sha256sum -c "$OLDPWD/.te0/cu13.sha256") || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
    .te0/*.whl "/tmp/$WHEEL" || return 1
  export PYTHONPATH=$SITE
  rm -rf /tmp/tebuild && mkdir -p /tmp/tebuild && tar xzf .te0/transformer_engine_jax-2.20.2.tar.gz -C /tmp/tebuild
  # The extension's C++ files are independent: compile them in parallel (pybind11's
  # ParallelCompile), in place, then put the .so where transformer_engine looks for it.
  (cd /tmp/tebuild/transformer_engine_jax-2.20.2 && NVTE_FRAMEWORK=jax NPY_NUM_BUILD_JOBS=16 python3 -c "
from pybind11.setup_helpers import ParallelCompile
ParallelCompile('NPY_NUM_BUILD_JOBS').install()
import runpy, sys
sys.argv = ['setup.py', 'build_ext', '--inplace']
runpy.run_path('setup.py', run_name='__main__')" > "$OUT/build.log" 2>&1)
  so=$(ls /tmp/tebuild/transformer_engine_jax-2.20.2/transformer_engine_jax*.so 2>/dev/null | head -1)
  if [ -n "$so" ]; then
    cp "$so" "$SITE/transformer_engine/wheel_lib/"
  else  # the documented route (slower: one file at a time)
    tail -20 "$OUT/build.log"
    NVTE_FRAMEWORK=jax python3 -m pip install -q --no-build-isolation --no-index --no-deps \
      --target "$SITE" .te0/transformer_engine_jax-2.20.2.tar.gz >> "$OUT/build.log" 2>&1 || return 1
  fi
  python3 -c "import importlib.metadata as m; print('TE', m.version('transformer_engine'))"
  # TE must import after JAX has initialised the GPU (as in pytest and in real use); if it
  # cannot, fall back to importing TE first (PRE=...) so the run still measures something.
  if python3 -c "import jax; jax.devices(); import transformer_engine.jax" > "$OUT/import.log" 2>&1; then
    echo "TE imports after JAX's GPU init"
  else
    echo "TE does NOT import after JAX's GPU init; importing it first"; tail -3 "$OUT/import.log"
    PRE="import transformer_engine.jax;"
  fi
}
PRE=""

run_tests() {
  export PYTHONPATH=$SITE
  python3 -c "${PRE}import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))" -q -rs \
    --durations=5 tests/jax_side/mxfp8/test_te_backend.py \
    tests/jax_side/mxfp8/test_backend_dispatch.py 2>&1 | tee "$OUT/pytest.log"
  if [ "${PIPESTATUS[0]}" != 0 ]; then  # tell TE's own warnings apart from real failures
    python3 -c "${PRE}import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))" -q \
      -W ignore::DeprecationWarning -W ignore::FutureWarning -W ignore::UserWarning \
      tests/jax_side/mxfp8/test_te_backend.py 2>&1 | tail -40 \
      | tee "$OUT/pytest_warnings_ignored.log"
  fi
}

run_bench() {
  export PYTHONPATH=$SITE
  python3 -c "${PRE}import runpy; runpy.run_module('benchmarks.bench_te_vs_xla', run_name='__main__')" \
    --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
}

case "${1:-all}" in
  stage) stage ;;
  install) install ;;
  test) run_tests ;;
  bench) run_bench ;;
  all|verify)  # verify: install and tests, no benchmark
    date -u; nvidia-smi -L
    stage
    t0=$SECONDS; install || { echo "INSTALL FAILED"; tail -40 "$OUT/build.log"; exit 1; }
    echo "install took $((SECONDS - t0)) s"
    run_tests
    [ "${1:-all}" = all ] && run_bench ;;
  *) echo "usage: $0 stage|install|test|bench|verify|all" >&2; exit 2 ;;
esac
