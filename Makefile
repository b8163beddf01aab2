# Entry points for a fresh machine (README.md):
#   make demo     -- create .venv, install, run the main job (the hybrid training demo)
#   make test     -- create .venv, install with [dev,notebooks], run the fast test suite (8.5 min on 2 cores
#                    before the shared compilation cache)
#   make test-all -- the same plus the tests marked slow (multi-process matrix, notebooks): CI
#   make parity   -- the cross-framework parity report (Torch FSDP vs Flax on the same MXFP8 bytes)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch 2.13.0 is pinned first so that pip never resolves to a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv demo parity test test-all lint

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,notebooks]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/mxfp8-train --compare

parity: venv
	$(PY) -m apps.parity

# One test process per core, at most 4 (pytest-xdist), each test file in one of them
# (--dist loadfile: a file's tests share the JAX programs they compile). XDIST= runs serially.
XDIST ?= -n auto --maxprocesses 4 --dist loadfile

test: venv
	$(PY) -m pytest -q $(XDIST) -m "not slow"

test-all: venv
	$(PY) -m pytest -q $(XDIST)

lint: venv
	$(VENV)/bin/ruff check .
