"""The 32-row band a flat slice of a row-major (M, K) tensor touches (shared by the backends).

A slice holds flat elements ``[start, start + n)``. Its blocks (1x32 along K and 32x1 along M) all
lie in the rows ``[row0, row1)``: the slice's first and last rows rounded out to multiples of 32.
Backends materialise only that band, zero-padded around the slice (zeros never raise a block amax,
and the cast result is sliced back), never the whole tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from common.formats import BLOCK_SIZE

__all__ = ["Band", "band", "band_values"]


class Band(NamedTuple):
    """Rows [row0, row1) of the band, and the band elements before / after the slice."""

    row0: int  # multiple of 32
    row1: int  # multiple of 32, <= M
    pad_left: int
    pad_right: int

    @property
    def rows(self) -> int:
        return self.row1 - self.row0


def band(m: int, k: int, start: int, n: int) -> Band:
    """The band of a non-empty slice ``[start, start + n)`` of a (M, K) tensor."""
    first_row = start // k
    last_row = (start + n - 1) // k
    row0 = (first_row // BLOCK_SIZE) * BLOCK_SIZE
    row1 = min(m, (last_row // BLOCK_SIZE + 1) * BLOCK_SIZE)
    return Band(row0, row1, start - row0 * k, row1 * k - (start + n))


def band_values(flat: jax.Array, k: int, b: Band) -> jax.Array:
    """(rows, K) of the band: the slice's values, zeros around them (any dtype)."""
    return jnp.pad(flat, (b.pad_left, b.pad_right)).reshape(b.rows, k)
