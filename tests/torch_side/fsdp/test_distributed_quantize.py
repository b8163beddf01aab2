"""``distributed_mxfp8_quantize`` is byte-identical to whole-tensor quantization (DESIGN.md 5).

The cases ``case_*(ctx)`` run on every rank of an in-process world (``threaded_world.py``) by the
tests, and on NCCL ranks by ``benchmarks/bench_fsdp.py`` (``CASES``): world sizes 1 to 4, even
splits that cut 32-blocks and rows, random splits with ranks that own nothing, one rank owning
everything.

Every rank builds the same full fp32 tensors from a fixed seed (its own generator), takes its
slice under a given split, quantizes its slice through the collective, and compares with
whole-tensor quantization of ``bf16(full)`` by the numpy oracle (and, in world size 1, by
``jax_side.mxfp8.quantize``, which its own tests pin to the oracle): data bytes at its slice and
the full scales must be identical, including on ranks that own nothing. (Every distinct slice
compiles JAX code, so the splits are few and chosen to cut blocks and rows.)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.distributed as dist

from jax_side.mxfp8 import quantize
from tests.oracle import mxfp8_ref
from tests.torch_side.threaded_world import run_world
from torch_side import distributed_mxfp8_quantize

# (M, K) shapes of one batch; mixed sizes so slices cut rows and 32-blocks at odd places.
SHAPES = [(32, 160), (96, 64), (64, 32), (32, 32)]


def _full_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for m, k in SHAPES:
        x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-20, 20, (m, 1), generator=g))
        x[: m // 2, :32] = 0.0  # an all-zero block column band (scale byte 0)
        x.view(-1)[7] = 1e-40  # a subnormal in fp32 (flushes in bf16)
        out.append(x)
    return out


def _bounds_even(numel: int, world: int) -> list[int]:
    """Even split (last rank may be short): cuts rarely fall on block or row boundaries."""
    per = -(-numel // world)
    return [min(numel, r * per) for r in range(world + 1)]


def _bounds_random(numel: int, world: int, g: np.random.Generator) -> list[int]:
    """Random sorted cuts; repeated cuts give ranks that own nothing."""
    cuts = sorted(int(c) for c in g.integers(0, numel + 1, world - 1))
    if world > 2:
        cuts[1] = cuts[0]  # rank 1 owns nothing
    return [0, *cuts, numel]


def _bounds_last_owns_all(numel: int, world: int) -> list[int]:
    return [0] * world + [numel]


def _check_split(ctx, fulls, bounds_per_param) -> None:
    shards, starts = [], []
    for x, b in zip(fulls, bounds_per_param, strict=True):
        lo, hi = b[ctx.rank], b[ctx.rank + 1]
        shards.append(x.reshape(-1)[lo:hi].clone().to(ctx.device) if hi > lo else None)
        starts.append(lo)
    got = distributed_mxfp8_quantize(shards, SHAPES, starts, dist.group.WORLD)
    for i, (x, b, res) in enumerate(zip(fulls, bounds_per_param, got, strict=True)):
        lo, hi = b[ctx.rank], b[ctx.rank + 1]
        oracle = mxfp8_ref.quantize(x.to(torch.bfloat16).float().numpy())
        want = {
            "rowwise": oracle["rowwise_data"].reshape(-1)[lo:hi],
            "colwise": oracle["colwise_data"].reshape(-1)[lo:hi],
            "rowwise_scale": oracle["rowwise_scale"],
            "colwise_scale": oracle["colwise_scale"],
        }
        if ctx.world_size == 1:
            ref = quantize(jnp.asarray(x.numpy()).astype(jnp.bfloat16))
            np.testing.assert_array_equal(
                np.asarray(ref.rowwise_data).view(np.uint8), oracle["rowwise_data"]
            )
            np.testing.assert_array_equal(
                np.asarray(ref.colwise_scale).view(np.uint8), oracle["colwise_scale"]
            )
        for field, expected in want.items():
            actual = getattr(res, field)
            assert actual.dtype == torch.uint8, (i, field, actual.dtype)
            np.testing.assert_array_equal(
                actual.cpu().numpy(),
                expected,
                err_msg=f"param {i} {SHAPES[i]} {field} slice [{lo},{hi})",
            )


def case_even_split(ctx) -> None:
    fulls = _full_tensors(0)
    _check_split(ctx, fulls, [_bounds_even(x.numel(), ctx.world_size) for x in fulls])


def case_random_split_with_empty_ranks(ctx) -> None:
    fulls = _full_tensors(1)
    g = np.random.default_rng(1234)
    _check_split(ctx, fulls, [_bounds_random(x.numel(), ctx.world_size, g) for x in fulls])


def case_one_rank_owns_everything(ctx) -> None:
    fulls = _full_tensors(2)
    _check_split(ctx, fulls, [_bounds_last_owns_all(x.numel(), ctx.world_size) for x in fulls])


def case_bad_shape_raises(ctx) -> None:
    try:
        distributed_mxfp8_quantize([torch.zeros(8)], [(8, 32)], [0], dist.group.WORLD)
    except ValueError as e:
        assert "M % 32 == 0" in str(e) and "(8, 32)" in str(e), str(e)
    else:
        raise AssertionError("shape (8, 32) was accepted for MXFP8")


_M = "tests.torch_side.fsdp.test_distributed_quantize"
CASES = {  # the world sizes bench_fsdp.py's parity pass runs each case at
    f"{_M}:case_even_split": (1, 2, 3, 4),
    f"{_M}:case_random_split_with_empty_ranks": (2, 4),
    f"{_M}:case_one_rank_owns_everything": (2,),
    f"{_M}:case_bad_shape_raises": (1,),
}

SLOW = pytest.mark.slow  # worlds of 3 and 4 ranks: run by `make test-all` (CI), not `make test`


@pytest.mark.parametrize(
    "world_size", [1, 2, pytest.param(3, marks=SLOW), pytest.param(4, marks=SLOW)]
)
def test_even_split_matches_whole_tensor_quantize(world_size):
    run_world(world_size, case_even_split)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=SLOW)])
def test_random_split_with_empty_ranks(world_size):
    run_world(world_size, case_random_split_with_empty_ranks)


def test_one_rank_owns_everything():
    run_world(2, case_one_rank_owns_everything)


def test_shape_not_multiple_of_32_is_a_clear_error():
    run_world(1, case_bad_shape_raises)
