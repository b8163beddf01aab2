"""The ``fp8_blocked`` GEMM's kernel: FP8 tensor cores with an fp32 promotion every 128 of K.

``blocked_matmul(a, b)`` computes fp32 (M, N) = a (M, K) @ b (N, K)^T for re-blocked operands
(``reblock``: a in 1x128 blocks, b in 128x128 tiles). One Pallas program (Triton lowering on the
GPU) owns a (BM, BN) tile of the output; for each 128-wide step of K it runs one e4m3 x e4m3 dot
with fp32 accumulation on the tensor cores and adds it, times ``scale_a[row] * scale_b[col]``
(powers of two), to an fp32 accumulator in registers -- DeepGEMM's promotion scheme. Where the
scales of a step are not subnormal the promotion is exact, so the result differs from
``reblock.blocked_dot_reference`` only in the order of fp32 additions (and in the tensor cores'
internal accumulation of each 128-wide dot).

``interpret=True`` runs the same program through Pallas's interpreter (any platform; how the CPU
tests check it). Shapes are padded to whole tiles here, with zero codes, and the output sliced.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from common.formats import round_up
from jax_side.mxfp8.reblock import GROUP, Reblocked, scale_fp32

__all__ = ["TILE_DEFAULT", "Tile", "blocked_matmul"]


class Tile:
    """Output tile and launch shape of one program: (bm, bn), Triton warps and pipeline stages."""

    __slots__ = ("bm", "bn", "stages", "warps")

    def __init__(self, bm: int = 128, bn: int = 128, warps: int = 8, stages: int = 3) -> None:
        for name, v in (("bm", bm), ("bn", bn)):
            if v < 16 or v & (v - 1):
                raise ValueError(f"Tile: {name} must be a power of two >= 16, got {v}")
        self.bm, self.bn, self.warps, self.stages = bm, bn, warps, stages

    def key(self) -> tuple[int, int, int, int]:
        return (self.bm, self.bn, self.warps, self.stages)

    def __repr__(self) -> str:
        return f"Tile(bm={self.bm}, bn={self.bn}, warps={self.warps}, stages={self.stages})"


TILE_DEFAULT = Tile()


def _fp8_blocked_gemm_kernel(a_ref: Any, b_ref: Any, sa_ref: Any, sb_ref: Any, o_ref: Any, *,
                             steps: int) -> None:
    # named so that profiles file it under GEMM (bench_train_step matches "gemm")
    bm, bn = o_ref.shape

    def step(k: jax.Array, acc: jax.Array) -> jax.Array:
        cols = pl.ds(pl.multiple_of(k * GROUP, GROUP), GROUP)
        part = lax.dot_general(a_ref[:, cols], b_ref[:, cols], (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
        scale = sa_ref[:, pl.ds(k, 1)] * sb_ref[pl.ds(k, 1), :]  # (bm, 1) * (1, bn)
        return acc + part * scale

    acc = lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tile_key", "interpret", "out_dtype"))
def _run(a_data: jax.Array, a_scale: jax.Array, b_data: jax.Array, b_scale: jax.Array, *,
         tile_key: tuple[int, int, int, int], interpret: bool, out_dtype: Any) -> jax.Array:
    bm, bn, warps, stages = tile_key
    m, k = a_data.shape
    n = b_data.shape[0]
    mp, np_ = round_up(m, bm), round_up(n, max(bn, GROUP))
    a = jnp.pad(a_data, ((0, mp - m), (0, 0)))
    b = jnp.pad(b_data, ((0, np_ - n), (0, 0)))
    sa = jnp.pad(scale_fp32(a_scale), ((0, mp - m), (0, 0)))  # (Mp, K/128)
    sb_tiles = jnp.pad(scale_fp32(b_scale), ((0, np_ // GROUP - b_scale.shape[0]), (0, 0)))
    sb = jnp.repeat(sb_tiles, GROUP, axis=0).T  # (K/128, Np): one scale per column of out
    steps = k // GROUP
    params: dict[str, Any] = {}
    if not interpret:
        from jax.experimental.pallas import triton as plt

        params["compiler_params"] = plt.CompilerParams(num_warps=warps, num_stages=stages)
    out = pl.pallas_call(
        functools.partial(_fp8_blocked_gemm_kernel, steps=steps),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // bm, np_ // bn),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((bn, k), lambda i, j: (j, 0)),
            pl.BlockSpec((bm, steps), lambda i, j: (i, 0)),
            pl.BlockSpec((steps, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        **params,
    )(a, b, sa, sb)
    return out[:m, :n]


def blocked_matmul(a: Reblocked, b: Reblocked, *, out_dtype: Any = jnp.float32,
                   tile: Tile | None = None, interpret: bool = False) -> jax.Array:
    """(M, N) ``out_dtype`` = a (M, K; 1x128 blocks) @ b (N, K; 128x128 tiles)^T on FP8 tensor
    cores (module docstring). ``b``'s rows must be a multiple of 128 (whole tiles)."""
    m, k = a.data.shape
    n, kb = b.data.shape
    if k != kb or k % GROUP:
        raise ValueError(f"blocked_matmul: a is {(m, k)} and b is {(n, kb)}; the contracted "
                         f"dims must agree and be multiples of {GROUP} (pad with reblock.pad_to)")
    if tuple(a.scale.shape) != (m, k // GROUP) or tuple(b.scale.shape) != (n // GROUP, k // GROUP):
        raise ValueError(f"blocked_matmul: scales {tuple(a.scale.shape)} and "
                         f"{tuple(b.scale.shape)} do not match 1x128 blocks of a {(m, k)} and "
                         f"128x128 tiles of b {(n, k)} (use reblock_rows / reblock_tiles)")
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"blocked_matmul: out_dtype must be float32 or bfloat16, got {out_dtype}")
    tile = TILE_DEFAULT if tile is None else tile
    return _run(a.data, a.scale, b.data, b.scale, tile_key=tile.key(), interpret=interpret,
                out_dtype=jnp.dtype(out_dtype))
