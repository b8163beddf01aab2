"""Unit programs: a whole block's forward as one jitted JAX program and its backward as one.

A **unit function** ``fn(params, linear, x, *aux) -> out`` (e.g. ``gpt_math.GPTBlockFn``) is the
block's math with its linears left open: ``linear(name, h)`` is filled in here with

- the MXFP8 linear (``jax_side.linear``: the same jitted forward / backward pieces, hence the same
  bytes, as the per-linear op and the Flax twin) for each name in ``UnitSpec.mxfp8``, reading
  the weight's rowwise plane in forward and its colwise plane in backward, or
- the high-precision control (``high_precision_linear``, as the Flax twin) for each name in
  ``UnitSpec.hp_linears``, whose weight is the high-precision parameter ``<name>.weight``.

The programs:

- ``unit_forward(params, rows, x, aux, spec=)`` -> ``(out, saved)``: the forward and the
  linearization (``jax.vjp``) in one program; ``saved`` (the residuals: activations the backward
  needs, each MXFP8 linear's colwise x plane, and, for weights quantized here, their colwise
  planes) stays on the JAX side until the backward;
- ``unit_backward(saved, kept, dout, cols, spec=)`` -> the gradients packed into one uint8 array
  (``GradLayout``): dx, then each high-precision parameter's gradient, then each MXFP8 weight's
  dW (in ``spec.dw_dtypes``), so they cross back to Torch once. Gradients named in
  ``spec.grad_groups`` come instead laid out as the caller's flat buffers (``GradGroup``: an
  FSDP group's grad bucket, cast to its dtype, zeros in the padding), one segment per group, so
  the caller adds one segment per group instead of one gradient per parameter;
- ``unit_recompute_backward(params, rows, x, aux, dout, cols, spec=)``: activation recompute
  (``spec`` says nothing is kept): the forward runs again inside the backward program;
- ``unit_apply(params, rows, x, aux, spec=)``: the forward alone (the forward of a recomputing
  unit; ``bridge.units`` evaluates with ``unit_forward``, whose bits the training forward has).

A ``SpanFn`` (an FSDP unit of several blocks, one program) returns every block's output, and its
backward takes a cotangent, or None, for each (``_linearize``, ``_pullback``).

Weights. ``rows[i]`` is the i-th MXFP8 linear's rowwise plane (``FlatPlane`` inside a shared FSDP
buffer, or an ``MXFP8Tensor``), or its high-precision weight (an array), which the program then
quantizes as ``bf16(weight)`` (both planes, as the Flax twin does without planes). ``cols[i]`` is
its colwise plane, gathered only for the backward (FSDP's phase rule), or None when the forward
quantized it. A parameter is an array or a ``FlatTensor`` (a slice of a shared buffer).

How the colwise planes reach the backward: each MXFP8 linear is a ``jax.custom_vjp`` whose
residual is its x colwise plane only; its backward rule runs when ``unit_backward`` applies the
saved linearization -- i.e. while ``unit_backward`` is traced -- and takes the weight's colwise
plane (and returns dW) through ``_BackwardScope``, a trace-time table that ``unit_backward`` opens
around that call. A rule running outside such a scope is an internal error and says so.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeAlias, cast

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from common.formats import ALL_PLANES, Plane
from jax_side.linear import FlatPlane, backward, forward, high_precision_linear, quantize_weight
from jax_side.mxfp8 import MXFP8Tensor
from jax_side.mxfp8.kernels import ResolvedKernels

__all__ = ["FlatTensor", "Forwarded", "GradGroup", "GradLayout", "Saved", "SpanFn", "UnitSpec",
           "grad_layout", "unit_apply", "unit_backward", "unit_forward", "unit_recompute_backward"]

_ALIGN = 16  # byte alignment of every segment of the packed gradients (Torch views need it)

# The programs' pytree arguments and results (module docstring: "Weights"; Out: a jax.Array, or
# a SpanFn's tuple of them, and the cotangents alike), and gradient segment shapes:
Params: TypeAlias = Sequence[Any]
Rows: TypeAlias = Sequence[Any]
Cols: TypeAlias = Sequence[Any]
Out: TypeAlias = Any
_Shape: TypeAlias = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class FlatTensor:
    """A parameter inside a flat shared buffer: ``data[offset : offset + prod(shape)]``, reshaped
    (offset and shape are static, part of the compiled program)."""

    data: jax.Array
    offset: int
    shape: tuple[int, ...]

    def array(self) -> jax.Array:
        n = 1
        for d in self.shape:
            n *= d
        return lax.slice(self.data, (self.offset,), (self.offset + n,)).reshape(self.shape)


jax.tree_util.register_dataclass(FlatTensor, data_fields=["data"], meta_fields=["offset", "shape"])


class GradGroup(NamedTuple):
    """Gradients laid out in one flat buffer of the caller's (an FSDP group's grad bucket):
    ``numel`` elements of ``dtype``, gradient ``i`` (an index into the parameters, then the
    MXFP8 weights) cast to ``dtype`` at element ``start`` for each ``(i, start)`` of ``slots``,
    zeros elsewhere."""

    numel: int
    dtype: str
    slots: tuple[tuple[int, int], ...]


class UnitSpec(NamedTuple):
    """The static part of a unit program (hashable: equal blocks share compiled programs)."""

    fn: Callable  # fn(params, linear, x, *aux) -> out (module docstring)
    params: tuple[str, ...]  # high-precision parameter names, the order of ``params`` arguments
    mxfp8: tuple[str, ...]  # MXFP8 linear names, the order of ``rows`` / ``cols``
    hp_linears: tuple[str, ...]  # high-precision linear names (weights among ``params``)
    dw_dtypes: tuple[str, ...]  # dtype of each MXFP8 linear's dW (its Torch weight's dtype)
    kernels: ResolvedKernels
    grad_groups: tuple[GradGroup, ...] = ()  # gradients returned in flat buffers (GradGroup)


@dataclasses.dataclass(frozen=True)
class SpanFn:
    """Several unit functions applied in order as one program (an FSDP unit of several blocks):
    function ``i`` reads the parameters and linears named ``<i>.<name>`` as ``<name>`` and takes
    the previous one's output. The programs return every block's output (h_1, ..., h_n) and
    linearize each block on its own (``_linearize``); the backward takes a cotangent for any of
    the outputs and chains the blocks' rules, adding a block's own cotangent where one came, as
    one unit per block would (``_pullback``)."""

    fns: tuple[Callable, ...]

    def block(self, i: int, params: dict[str, Any], linear: Callable, x: jax.Array) -> Out:
        """Block ``i`` on ``x``; ``params`` holds (at least) its own ``<i>.<name>`` entries."""
        pre = f"{i}."
        own = {k[len(pre):]: v for k, v in params.items() if k.startswith(pre)}
        return self.fns[i](own, lambda name, h: linear(pre + name, h), x)


class GradLayout(NamedTuple):
    """Where each gradient sits in ``unit_backward``'s packed uint8 result: (byte offset, shape,
    dtype name) for dx, each parameter, each MXFP8 weight (None for one placed in a group), then
    each ``GradGroup``'s flat buffer."""

    dx: tuple[int, tuple[int, ...], str]
    params: tuple[tuple[int, tuple[int, ...], str] | None, ...]
    mxfp8: tuple[tuple[int, tuple[int, ...], str] | None, ...]
    nbytes: int
    groups: tuple[tuple[int, tuple[int, ...], str], ...] = ()


def _grouped(groups: tuple[GradGroup, ...]) -> frozenset[int]:
    return frozenset(i for g in groups for i, _ in g.slots)


def grad_layout(x_shape: _Shape, x_dtype: DTypeLike, param_shapes: Sequence[_Shape],
                param_dtypes: Sequence[DTypeLike], w_shapes: Sequence[_Shape],
                w_dtypes: Sequence[DTypeLike], groups: tuple[GradGroup, ...] = ()) -> GradLayout:
    """The packed layout for these shapes and dtypes (the Torch side cuts its views from it)."""
    cursor = 0

    def seg(shape: _Shape, dtype: DTypeLike) -> tuple[int, _Shape, str]:
        nonlocal cursor
        start = cursor
        size = jnp.dtype(dtype).itemsize
        for d in shape:
            size *= d
        cursor += -(-size // _ALIGN) * _ALIGN
        return start, tuple(shape), jnp.dtype(dtype).name

    grouped = _grouped(groups)
    n = len(param_shapes)
    dx = seg(x_shape, x_dtype)
    params = tuple(None if i in grouped else seg(s, d)
                   for i, (s, d) in enumerate(zip(param_shapes, param_dtypes, strict=True)))
    mx = tuple(None if n + j in grouped else seg(s, d)
               for j, (s, d) in enumerate(zip(w_shapes, w_dtypes, strict=True)))
    flat = tuple(seg((g.numel,), g.dtype) for g in groups)
    return GradLayout(dx, params, mx, cursor, flat)


def _flat_group(group: GradGroup, grads: Sequence[jax.Array]) -> jax.Array:
    """The group's flat buffer: each gradient cast and placed at its start, zeros between."""
    dt = jnp.dtype(group.dtype)
    parts, cursor = [], 0
    for i, start in sorted(group.slots, key=lambda s: s[1]):
        g = grads[i].reshape(-1).astype(dt)
        if start < cursor or start + g.shape[0] > group.numel:
            raise ValueError(f"GradGroup: gradient {i} at {start} overlaps or overflows {group}")
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
        pad = -raw.shape[0] % _ALIGN
        parts.append(raw)
        if pad:
            parts.append(jnp.zeros((pad,), jnp.uint8))
    return jnp.concatenate(parts)


def _pack_grads(dx: jax.Array, grads: list, groups: tuple[GradGroup, ...]) -> jax.Array:
    """dx, the gradients not in a group, then each group's flat buffer (``grad_layout``)."""
    grouped = _grouped(groups)
    alone = [g for i, g in enumerate(grads) if i not in grouped]
    return _pack([dx, *alone, *(_flat_group(g, grads) for g in groups)])


# ---------------------------------------------------------------- the MXFP8 linear of a unit


class _BackwardScope:
    """The colwise planes and dW dtypes of one ``unit_backward`` trace, and the dW it collects."""

    def __init__(self, cols: Cols, dw_dtypes: tuple[str, ...]) -> None:
        self.cols, self.dw_dtypes = cols, dw_dtypes
        self.dw: list = [None] * len(cols)


_SCOPES = threading.local()


def _scope() -> _BackwardScope:
    stack = getattr(_SCOPES, "stack", None)
    if not stack:
        raise AssertionError(
            "unit_program: an MXFP8 linear's backward rule ran outside unit_backward (its colwise "
            "weight plane comes from there); differentiate a unit function only through "
            "unit_forward / unit_backward"
        )
    return stack[-1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _unit_linear(x2d: jax.Array, w_row: Any, index: int, kernels: ResolvedKernels) -> jax.Array:
    return forward(x2d, w_row, out_dtype=x2d.dtype, keep_x_colwise=False, kernels=kernels).y


def _unit_linear_fwd(x2d, w_row, index, kernels):
    out = forward(x2d, w_row, out_dtype=x2d.dtype, keep_x_colwise=True, kernels=kernels)
    return out.y, (out.x_colwise, jnp.zeros((), x2d.dtype))


def _unit_linear_bwd(index, kernels, res, dy):
    x_colwise, x_dtype = res
    scope = _scope()
    out = backward(dy, scope.cols[index], x_colwise, dx_dtype=x_dtype.dtype,
                   dw_dtype=jnp.dtype(scope.dw_dtypes[index]), kernels=kernels)
    prev = scope.dw[index]
    scope.dw[index] = out.dw if prev is None else prev + out.dw  # a layer called twice
    return out.dx, None


_unit_linear.defvjp(_unit_linear_fwd, _unit_linear_bwd)


def _weights(rows, kernels):
    """(rowwise plane per MXFP8 linear, colwise plane quantized here or None)."""
    row_planes, own_cols = [], []
    for w in rows:
        if isinstance(w, (FlatPlane, MXFP8Tensor)):
            row_planes.append(w)
            own_cols.append(None)
        else:  # a high-precision weight: quantize bf16(w), both planes (the twin's rule)
            q = quantize_weight(w, planes=ALL_PLANES, kernels=kernels)
            row_planes.append(q.only(Plane.ROWWISE))
            own_cols.append(q.only(Plane.COLWISE))
    return row_planes, tuple(own_cols)


def _values(params: Params) -> tuple:
    return tuple(p.array() if isinstance(p, FlatTensor) else p for p in params)


def _bound(spec: UnitSpec, row_planes: Rows, aux: tuple, stage: int | None = None) -> Callable:
    """``f(param values, x) -> out`` with the linears filled in: the unit function over all
    of ``spec.params``, or block ``stage`` of a ``SpanFn`` over its own (``_stage``)."""
    index = {name: i for i, name in enumerate(spec.mxfp8)}
    hp_lin = set(spec.hp_linears)
    names = spec.params if stage is None else tuple(spec.params[i] for i in _stage(spec, stage))
    fn = spec.fn if stage is None else functools.partial(cast(SpanFn, spec.fn).block, stage)

    def f(values, x):
        params = dict(zip(names, values, strict=True))

        def linear(name, h):
            lead = h.shape[:-1]
            h2 = h.reshape(-1, h.shape[-1])
            if name in index:
                y2 = _unit_linear(h2, row_planes[index[name]], index[name], spec.kernels)
            elif name in hp_lin:
                y2 = high_precision_linear(h2, params[f"{name}.weight"], kernels=spec.kernels)
            else:
                raise KeyError(
                    f"unit program {spec.fn!r}: linear {name!r} is neither an MXFP8 linear "
                    f"{spec.mxfp8} nor a high-precision one {spec.hp_linears} of this unit"
                )
            return y2.reshape(*lead, y2.shape[-1])

        return fn(params, linear, x, *aux)

    return f


def _stage(spec: UnitSpec, k: int) -> tuple[int, ...]:
    """Indices into ``spec.params`` of block ``k`` of a ``SpanFn`` (named ``<k>.<name>``)."""
    return tuple(i for i, n in enumerate(spec.params) if n.startswith(f"{k}."))


def _linearize(spec: UnitSpec, row_planes: Rows, aux: tuple, values: tuple, x: jax.Array, *,
               vjp: bool = True) -> tuple[Out, Any, tuple]:
    """(out, linearization, outputs passed on): the unit function and its ``jax.vjp`` (None
    with ``vjp=False``). For a ``SpanFn``: one ``jax.vjp`` per block (of its own parameters and
    its input), out the tuple of the blocks' outputs, of which all but the last are passed on
    to the next block through ``_boundary``."""
    if not isinstance(spec.fn, SpanFn):
        f = _bound(spec, row_planes, aux)
        return (*jax.vjp(f, values, x), ()) if vjp else (f(values, x), None, ())
    outs, vjps = [], []
    for k in range(len(spec.fn.fns)):
        f, own = _bound(spec, row_planes, aux, k), tuple(values[i] for i in _stage(spec, k))
        if vjp:
            x, vjp_k = jax.vjp(f, own, x)
            vjps.append(vjp_k)
        else:
            x = f(own, x)
        outs.append(x if k == len(spec.fn.fns) - 1 else _boundary(x))
        x = outs[-1]
    return tuple(outs), tuple(vjps), tuple(outs[:-1])


def _boundary(h: jax.Array) -> jax.Array:
    """A value crossing from one block of a span to the next (an output forward, a cotangent
    backward), behind an optimization barrier: XLA then neither fuses across it nor keeps the
    value wider than its dtype (it may keep bf16 intermediates in fp32 inside a fusion, unless
    ``--xla_allow_excess_precision=false``), so the next block reads the rounded value, as it
    would from a program of its own: a span has the bits of one unit per block."""
    return lax.optimization_barrier(h)


def _pullback(spec: UnitSpec, vjp: Any, dout: Out) -> tuple[tuple, jax.Array]:
    """(gradient of each of ``spec.params``, dx). For a ``SpanFn``, ``dout`` holds a cotangent
    or None per block output (the last one present): block k's rule takes block k+1's dx plus
    block k's own cotangent, where one came, as autograd sums them for units of one block.
    Which are None is part of jit's cache key: a missing one costs nothing."""
    if not isinstance(spec.fn, SpanFn):
        return vjp(dout)
    if len(dout) != len(vjp) or dout[-1] is None:
        raise ValueError(f"unit_backward: a span of {len(vjp)} blocks takes a cotangent or "
                         f"None per output, the last one present; got {dout}")
    d_params: list = [None] * len(spec.params)
    ct = dout[-1]
    for k in reversed(range(len(vjp))):
        if k < len(vjp) - 1:
            ct = _boundary(ct if dout[k] is None else ct + dout[k])
        d_own, ct = vjp[k](ct)
        for i, g in zip(_stage(spec, k), d_own, strict=True):
            d_params[i] = g
    return tuple(d_params), ct


# ------------------------------------------------------------------------------- the programs


@functools.partial(jax.jit, static_argnames=("spec",))
def unit_apply(params: Params, rows: Rows, x: jax.Array, aux: tuple, *, spec: UnitSpec) -> Out:
    """The unit's output alone (no residuals kept)."""
    row_planes, _ = _weights(rows, spec.kernels)
    return _linearize(spec, row_planes, aux, _values(params), x, vjp=False)[0]


class Forwarded:
    """Which residuals of a forward are its own inputs, or outputs a span passes on to its next
    block, as static pytree data: ``positions`` = ((residual leaf index, source leaf index),
    ...) over ``jax.tree.leaves`` of the linearization and of ``(params, rows, x, aux, out)``.
    Such a residual is not returned by the program (XLA would copy it into a new output buffer,
    a device-to-device memcpy per call; in a CUDA-graph command buffer that copy failed on
    Torch-allocated inputs on the H200); the caller keeps those inputs and outputs (``kept``)
    and hands them to ``unit_backward``, as one unit per block keeps its input."""

    def __init__(self, positions: tuple[tuple[int, int], ...]):
        self.positions = positions

    def kept(self, params: Params, rows: Rows, x: jax.Array, aux: tuple, out: Out = None) -> tuple:
        """The source leaves the backward needs back, in ``positions`` order (``out``: the
        forward's output, needed where a span passes outputs on)."""
        flat = jax.tree.leaves((params, rows, x, aux, out))
        return tuple(flat[i] for _, i in self.positions)

    def kept_without_params(self, params: Params, rows: Rows, x: jax.Array, aux: tuple,
                            out: Out = None) -> tuple:
        """``kept``, with None where a leaf comes from ``params``: a caller that can give the
        same parameter values again at backward (FSDP gathers them again) does not hold the
        forward's parameter buffers until then; ``with_params`` fills them in."""
        n = len(jax.tree.leaves(params))
        flat = jax.tree.leaves((params, rows, x, aux, out))
        return tuple(None if i < n else flat[i] for _, i in self.positions)

    def with_params(self, kept: tuple, params: Params) -> tuple:
        """``kept_without_params``'s result completed from ``params`` (the same values)."""
        flat = jax.tree.leaves(params)
        return tuple(flat[i] if k is None else k
                     for (_, i), k in zip(self.positions, kept, strict=True))

    def __repr__(self) -> str:
        return f"Forwarded({self.positions})"


jax.tree_util.register_pytree_node(
    Forwarded, lambda f: ((), f.positions), lambda positions, _: Forwarded(positions)
)


class Saved(NamedTuple):
    """What ``unit_forward`` keeps for ``unit_backward`` (on the JAX side)."""

    vjp: object  # the linearization, inputs among its residuals replaced (``Forwarded``)
    own_cols: tuple  # colwise planes of weights quantized in the forward (else None)
    forwarded: Forwarded


def _strip_inputs(vjp, sources, passed):
    """(the linearization with residuals that are inputs or ``passed`` outputs replaced by
    scalars, Forwarded); ``sources`` = (params, rows, x, aux, out)."""
    leaves, tree = jax.tree.flatten(vjp)
    flat = jax.tree.leaves(sources)
    n_inputs = len(jax.tree.leaves(sources[:4]))
    passed_ids = {id(t) for t in jax.tree.leaves(passed)}
    where = {id(t): i for i, t in enumerate(flat) if i < n_inputs or id(t) in passed_ids}
    positions = []
    for k, leaf in enumerate(leaves):
        i = where.get(id(leaf))
        if i is not None:
            positions.append((k, i))
            leaves[k] = jnp.zeros((), leaf.dtype)
    return jax.tree.unflatten(tree, leaves), Forwarded(tuple(positions))


def _restore_inputs(saved: Saved, kept: tuple) -> Any:
    leaves, tree = jax.tree.flatten(saved.vjp)
    for (k, _), value in zip(saved.forwarded.positions, kept, strict=True):
        leaves[k] = value
    return jax.tree.unflatten(tree, leaves)


@functools.partial(jax.jit, static_argnames=("spec",))
def unit_forward(params: Params, rows: Rows, x: jax.Array, aux: tuple, *,
                 spec: UnitSpec) -> tuple[Out, Saved]:
    """(out, ``Saved``): the forward and its linearization (module docstring)."""
    row_planes, own_cols = _weights(rows, spec.kernels)
    out, vjp, passed = _linearize(spec, row_planes, aux, _values(params), x)
    vjp, forwarded = _strip_inputs(vjp, (params, rows, x, aux, out), passed)
    return out, Saved(vjp, own_cols, forwarded)


def _gradients(vjp: Any, own_cols: tuple, dout: Out, cols: Cols, spec: UnitSpec) -> jax.Array:
    cols = tuple(c if c is not None else o for c, o in zip(cols, own_cols, strict=True))
    missing = [spec.mxfp8[i] for i, c in enumerate(cols) if c is None]
    if missing:
        raise ValueError(
            f"unit_backward: no colwise plane for the MXFP8 linears {missing}: pass each "
            f"weight's colwise plane (or quantize it in the forward by passing the weight)"
        )
    scope = _BackwardScope(cols, spec.dw_dtypes)
    stack = _SCOPES.__dict__.setdefault("stack", [])
    stack.append(scope)
    try:
        # Library backward rules (jax.nn.dot_product_attention's) mix bf16 and fp32 internally;
        # under jax_numpy_dtype_promotion="strict" (the tests) they need the standard rules.
        with jax.numpy_dtype_promotion("standard"):
            d_params, dx = _pullback(spec, vjp, dout)
    finally:
        stack.pop()
    dws = [jnp.zeros(c.shape, jnp.dtype(dt)) if dw is None else dw
           for dw, c, dt in zip(scope.dw, cols, spec.dw_dtypes, strict=True)]
    return _pack_grads(dx, [*d_params, *dws], spec.grad_groups)


@functools.partial(jax.jit, static_argnames=("spec",))
def unit_backward(saved: Saved, kept: tuple, dout: Out, cols: Cols, *, spec: UnitSpec) -> jax.Array:
    """The packed gradients (``GradLayout``) from the forward's ``saved``, the inputs (and
    outputs) it forwarded (``saved.forwarded.kept(...)``) and the output gradient ``dout`` (for
    a ``SpanFn``: one per block output, None where none came, ``_pullback``); ``cols``: the
    colwise plane of each MXFP8 linear (None: quantized in the forward)."""
    return _gradients(_restore_inputs(saved, kept), saved.own_cols, dout, cols, spec)


@functools.partial(jax.jit, static_argnames=("spec",))
def unit_recompute_backward(params: Params, rows: Rows, x: jax.Array, aux: tuple, dout: Out,
                            cols: Cols, *, spec: UnitSpec) -> jax.Array:
    """Recompute the forward, then the backward, in one program (activation recompute)."""
    row_planes, own_cols = _weights(rows, spec.kernels)
    _, vjp, _ = _linearize(spec, row_planes, aux, _values(params), x)
    return _gradients(vjp, own_cols, dout, cols, spec)
