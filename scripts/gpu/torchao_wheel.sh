# Sourced by the GPU scripts that run torchao (units.sh, scale.sh), from the repository root:
# torchao travels as a wheel in .whl/ (the device tool's carry ".whl"); installed into /tmp/site
# and put on PYTHONPATH. Without the wheel, bench_train_step skips its torchao run and says so.
if ls .whl/torchao-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/torchao-*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
