"""How a unit program's backward hands its gradients back: ``Grads``, one packed uint8 array
and one flat buffer per gradient group.

``unit_program.unit_backward`` returns dx (one segment per differentiable input), each
high-precision parameter's gradient and each MXFP8 weight's dW in one uint8 array, so they
cross to Torch once; ``grad_layout`` says where each sits (``GradLayout``), and the Torch side
cuts its views from it. Every segment starts at a multiple of ``ALIGN`` bytes (Torch views need
it).

Gradients named in a ``GradGroup`` come instead laid out as the caller's flat buffer (an FSDP
group's grad bucket: cast to its dtype, zeros in the padding), each group its own output array,
so the caller takes it whole -- FSDP's grad reducer adopts it as the bucket it reduces
(``torch_side.fsdp.grad_reducer``), no copy between the backward and the reduce-scatter. The
buffer is built by in-place ``dynamic_update_slice`` of each gradient into a zero buffer
(``flat_group``), byte for byte the concatenation ``flat_group_reference`` writes; on one H200
the update costs 0.50 ms per 4-block 1.3B unit against 0.65 ms for the concatenation and 1.59 ms
when the buffer was also packed into the uint8 array (``benchmarks/bench_grad_layout.py``).

A gradient may come with a **writer** instead (``Writer``: its GEMM writing it into the buffer
itself -- the ``fp8_blocked`` wgrad, ``blocked_operands.WgradOperands``): the same bytes as
its update, without the (N, K) temporary or the copy (``unit_program._deferrable`` says which).
Where one does, the buffer is not filled with zeros first: only the gaps between the slots are
zeroed (``cublaslt.zeroed_gaps``) and the program writes every other element.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from common.formats import round_up

__all__ = ["ALIGN", "GradGroup", "GradLayout", "Grads", "Segment", "Writer", "flat_group",
           "flat_group_reference", "gaps", "grad_layout", "pack_grads", "written_buffer"]

ALIGN = 16  # byte alignment of every segment of the packed gradients

Segment = tuple[int, tuple[int, ...], str]  # (byte offset, shape, dtype name)


class Writer(Protocol):
    """Writes one gradient into a group's flat buffer itself (module docstring;
    ``blocked_operands.WgradOperands``)."""

    def into(self, buf: jax.Array, start: int) -> jax.Array:
        """``buf`` with the gradient written at element ``start`` (the bytes of its update)."""
        ...

    def direct(self, dtype: jnp.dtype, start: int) -> bool:
        """Whether ``into`` is a kernel writing in place, rather than the gradient's product and
        an update; then ``flat_group`` zeroes only the gaps between the slots (a writer must
        write its whole slot)."""
        ...


class GradGroup(NamedTuple):
    """Gradients laid out in one flat buffer of the caller's (an FSDP group's grad bucket):
    ``numel`` elements of ``dtype``, gradient ``i`` (an index into the parameters, then the
    MXFP8 weights) cast to ``dtype`` at element ``start`` for each ``(i, start)`` of ``slots``,
    zeros elsewhere."""

    numel: int
    dtype: str
    slots: tuple[tuple[int, int], ...]


class GradLayout(NamedTuple):
    """Where each gradient sits in ``unit_backward``'s packed uint8 array (``Grads.packed``): a
    ``Segment`` for the gradient of each differentiable input, each parameter, each MXFP8 weight
    (None for one placed in a group: it is in that group's buffer, ``Grads.groups``)."""

    dxs: tuple[Segment, ...]
    params: tuple[Segment | None, ...]
    mxfp8: tuple[Segment | None, ...]
    nbytes: int


class Grads(NamedTuple):
    """A unit backward's result: the packed uint8 array (``GradLayout``) and each
    ``GradGroup``'s flat buffer (``numel`` elements of its dtype), in ``grad_groups`` order."""

    packed: jax.Array
    groups: tuple[jax.Array, ...]


def _grouped(groups: tuple[GradGroup, ...]) -> frozenset[int]:
    return frozenset(i for g in groups for i, _ in g.slots)


def grad_layout(inputs: Sequence[tuple[tuple[int, ...], DTypeLike]],
                param_shapes: Sequence[tuple[int, ...]], param_dtypes: Sequence[DTypeLike],
                w_shapes: Sequence[tuple[int, ...]], w_dtypes: Sequence[DTypeLike],
                groups: tuple[GradGroup, ...] = ()) -> GradLayout:
    """The packed layout for these shapes and dtypes; ``inputs``: (shape, dtype) of each
    differentiable input, in the order the unit function takes them."""
    cursor = 0

    def seg(shape: tuple[int, ...], dtype: DTypeLike) -> Segment:
        nonlocal cursor
        start = cursor
        size = jnp.dtype(dtype).itemsize
        for d in shape:
            size *= d
        cursor += round_up(size, ALIGN)
        return start, tuple(shape), jnp.dtype(dtype).name

    grouped = _grouped(groups)
    n = len(param_shapes)
    dxs = tuple(seg(s, d) for s, d in inputs)
    params = tuple(None if i in grouped else seg(s, d)
                   for i, (s, d) in enumerate(zip(param_shapes, param_dtypes, strict=True)))
    mx = tuple(None if n + j in grouped else seg(s, d)
               for j, (s, d) in enumerate(zip(w_shapes, w_dtypes, strict=True)))
    return GradLayout(dxs, params, mx, cursor)


def _placed(group: GradGroup, grads: Sequence[jax.Array]) -> list[tuple[int, int, jax.Array]]:
    """(index, start, flat gradient cast to the group's dtype), by start; an overlap or overflow
    raises, naming the gradient and the group."""
    dt = jnp.dtype(group.dtype)
    out, cursor = [], 0
    for i, start in sorted(group.slots, key=lambda s: s[1]):
        g = grads[i].reshape(-1).astype(dt)
        if start < cursor or start + g.shape[0] > group.numel:
            raise ValueError(f"GradGroup: gradient {i} at {start} overlaps or overflows {group}")
        out.append((i, start, g))
        cursor = start + g.shape[0]
    return out


def flat_group(group: GradGroup, grads: Sequence[jax.Array],
               writers: Mapping[int, Writer] | None = None) -> jax.Array:
    """The group's flat buffer: each gradient cast and written at its start into a zero buffer
    (one in-place ``dynamic_update_slice`` each), or, for a gradient with a writer in
    ``writers`` (by gradient index, applied in their order), written by it (module
    docstring)."""
    placed = _placed(group, grads)
    starts = {i: start for i, start, _ in placed}
    mine = {i: w for i, w in (writers or {}).items() if i in starts}
    dt = jnp.dtype(group.dtype)
    buf = _first_buffer(group, [(start, g.shape[0]) for _, start, g in placed],
                        any(w.direct(dt, starts[i]) for i, w in mine.items()))
    written = set()
    for i, w in mine.items():
        buf = w.into(buf, starts[i])
        written.add(i)
    for i, start, g in placed:
        if i not in written:
            buf = lax.dynamic_update_slice(buf, g, (start,))
    return buf


def gaps(numel: int, spans: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The (start, length) ranges of ``range(numel)`` that no (start, length) span covers."""
    out, cursor = [], 0
    for start, length in sorted(spans):
        if start > cursor:
            out.append((cursor, start - cursor))
        cursor = max(cursor, start + length)
    if cursor < numel:
        out.append((cursor, numel - cursor))
    return tuple(out)


def written_buffer(numel: int, dtype: DTypeLike, spans: Iterable[tuple[int, int]]) -> jax.Array:
    """A 1-D buffer for a program that writes every (start, length) span itself. On a GPU with
    the cuBLASLt handlers: only the gaps between the spans zeroed (``cublaslt.zeroed_gaps``), so
    the buffer is not filled first (an XLA fill kernel streams all of it: about 0.14 ms per
    805 MB fp32 grad bucket on the H200); every span's element is undefined until the program
    writes it. Otherwise zeros behind an optimization barrier: left alone, XLA turns zeros + the
    first update into one pad of the whole buffer (the cast widening all of it), several times
    slower than a fill and in-place updates (CPU, a 256 MB group: 496 against 58 ms;
    tests/jax_side/test_unit_program.py reads the HLO)."""
    def zeros() -> jax.Array:
        return lax.optimization_barrier(jnp.zeros((numel,), dtype))

    from jax_side.mxfp8 import cublaslt

    if not cublaslt.status().ok:
        return zeros()
    holes = gaps(numel, spans)
    return lax.platform_dependent(cuda=lambda: cublaslt.zeroed_gaps(numel, dtype, holes),
                                  default=zeros)


def _first_buffer(group: GradGroup, spans: list[tuple[int, int]], direct: bool) -> jax.Array:
    """What the gradients are written into: with a writer writing in place (``direct``), a
    ``written_buffer`` (its gaps zeroed, the slots written by the program); otherwise zeros
    behind an optimization barrier (``written_buffer``'s note)."""
    if not direct:
        return lax.optimization_barrier(jnp.zeros((group.numel,), group.dtype))
    return written_buffer(group.numel, group.dtype, spans)


def flat_group_reference(group: GradGroup, grads: Sequence[jax.Array]) -> jax.Array:
    """``flat_group`` as one concatenation of the gradients and the zero gaps (the plain
    reference the tests compare it with, byte for byte)."""
    dt = jnp.dtype(group.dtype)
    parts, cursor = [], 0
    for _, start, g in _placed(group, grads):
        if start > cursor:
            parts.append(jnp.zeros((start - cursor,), dt))
        parts.append(g)
        cursor = start + g.shape[0]
    if cursor < group.numel:
        parts.append(jnp.zeros((group.numel - cursor,), dt))
    return jnp.concatenate(parts)


def _pack(arrays: Iterable[jax.Array]) -> jax.Array:
    parts = []
    for a in arrays:
        raw = lax.bitcast_convert_type(a, jnp.uint8).reshape(-1)
        pad = -raw.shape[0] % ALIGN
        parts.append(raw)
        if pad:
            parts.append(jnp.zeros((pad,), jnp.uint8))
    return jnp.concatenate(parts)


def pack_grads(dx: jax.Array | tuple[jax.Array, ...], grads: Sequence[jax.Array],
               groups: tuple[GradGroup, ...],
               writers: Mapping[int, Writer] | None = None) -> Grads:
    """``Grads``: the packed array of ``grad_layout`` (dx -- an array, or a tuple of one per
    input -- then the gradients not in a group) and each group's flat buffer (``writers``:
    ``flat_group``'s, by gradient index)."""
    grouped = _grouped(groups)
    alone = [g for i, g in enumerate(grads) if i not in grouped]
    dxs = dx if isinstance(dx, tuple) else (dx,)
    return Grads(_pack([*dxs, *alone]), tuple(flat_group(g, grads, writers) for g in groups))
