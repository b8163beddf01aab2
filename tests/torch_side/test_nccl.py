"""The overlap and unit-compute cases with NCCL on CUDA ranks (one GPU each): world size 1 on a
one-GPU machine, and 2 where two GPUs exist (``scripts/gpu/two_gpu.sh tests``). Skipped without a
GPU. The cases are those of the CPU tests (cases_overlap.py on spawned gloo ranks; the
``case_unit_*`` of test_units_fsdp.py, in in-process worlds there); at world size 1
``MXFP8_FSDP_COMM_STREAMS=1`` routes the copies through the communication streams, so one GPU
tests their ordering against the JAX programs. The CUDA ranks run with deterministic kernels
(``bridge.determinism``, set up by the worker): without them Torch's embedding backward (atomic
adds) made the world-1 exact comparisons fail now and then."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.torch_side.multiprocess import run_cases

pytestmark = pytest.mark.gpu

CASES = (
    "tests.torch_side.cases_overlap:case_overlap_unit_compute_bytes",
    "tests.torch_side.cases_overlap:case_peak_bucket_bytes_follow_the_layout",
    "tests.torch_side.cases_overlap:case_trace_shows_the_gather_of_the_next_unit_issued_during_this_one",
    "tests.torch_side.test_units_fsdp:case_unit_optim_grads_params",
    "tests.torch_side.test_units_fsdp:case_unit_zero3_recompute_accumulation",
    "tests.torch_side.test_units_fsdp:case_unit_zero3_blocks_in_one_unit_recompute_accumulation",
)
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@functools.cache
def _outcomes(world_size: int):
    # world size 1: the copies go through the communication streams too (collectives' note;
    # the worker reads the variable into WorkerContext.comm_streams, the cases pass it on)
    os.environ["MXFP8_FSDP_COMM_STREAMS"] = "1"
    try:
        return run_cases(world_size, list(CASES), backend="nccl")
    finally:
        del os.environ["MXFP8_FSDP_COMM_STREAMS"]


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.skipif(
    GPUS < 2, reason="needs two GPUs (NCCL refuses two ranks on one GPU)"))])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.split(":case_")[1])
def test_case_on_nccl(world_size, case):
    outcome = _outcomes(world_size)[case]
    assert outcome.ok, outcome.detail
