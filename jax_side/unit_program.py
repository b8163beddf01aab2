"""Unit programs: a whole block's forward as one jitted JAX program and its backward as one.

A **unit function** ``fn(params, linear, x, *aux) -> out`` (e.g. ``gpt_math.GPTBlockFn``) is the
block's math with its linears left open. A block of several differentiable inputs takes them all
before ``aux`` (the programs' ``x`` is then a tuple of them: ``fn(params, linear, *x, *aux)``),
and one of several outputs returns a tuple. ``linear(name, h)`` is filled in here (and
``linear(name, h, parts=n)``: y's n equal column parts, as ``jnp.split`` cuts them; with the
``fp8_blocked`` GEMM and N/n a multiple of 128, n GEMMs against the weight's row parts, whose
cotangents reach the backward as they are: ``unit_linear.unit_linear_parts``; and
``linear(name, h, pre=fn)``: the linear of ``fn(h)`` for an elementwise ``fn`` of h's shape and
dtype, checked by ``jax_side.mxfp8.elementwise.check``, which with the ``fp8_blocked`` GEMM
runs inside the quantize of h so that ``fn(h)`` is never written out:
``unit_linear.unit_linear_pre``; elsewhere ``jax.checkpoint(fn)(h)`` first; and
``linear(name, h, post="gelu_tanh")``: the GELU of the linear's output, written by the
``fp8_blocked`` GEMM's epilogue with the output itself for bfloat16 activations
(``unit_linear.unit_linear_post``, ``jax_side.mxfp8.epilogue``), elsewhere
``jax.checkpoint(gelu)`` of the linear's output) with

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
- ``unit_backward(saved, kept, dout, cols, spec=)`` -> ``Grads`` (``jax_side.unit_grads``): the
  gradients packed into one uint8 array -- dx (one per input), then each high-precision
  parameter's gradient, then each MXFP8 weight's dW (in ``spec.dw_dtypes``), so they cross back
  to Torch once -- except those named in ``spec.grad_groups``, which come laid out as the
  caller's flat buffers, one array per group (``GradGroup``: an FSDP group's grad bucket,
  adopted whole). ``dout``: a cotangent for each output;
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

How the colwise planes reach the backward, and the weight gradients leave it
(``jax_side.unit_linear``): each MXFP8 linear is a ``jax.custom_vjp`` whose residual is its x
colwise plane only; its backward rule runs when ``unit_backward`` applies the saved
linearization -- i.e. while ``unit_backward`` is traced -- and reads the weight's colwise plane
from a read-only trace-time table that ``unit_backward`` opens around that call (the plane exists
only then: FSDP gathers it for the backward). dW leaves through autodiff, explicitly: each linear
also takes a **gradient carrier**, zeros of the weight's shape in dW's dtype that the forward does
not read (XLA drops them), and its rule returns dW as the carrier's cotangent. So dW is an output
of ``jax.vjp`` like any other gradient -- summed by autodiff where a layer is called twice, and
correct where the rule runs in an inner trace (a unit function under ``jax.checkpoint``, whose
rules run while its backward is re-traced: ``tests/jax_side/test_unit_program.py``). A rule
running outside such a scope is an internal error and says so.

**dW in the gradient bucket.** With the ``fp8_blocked`` GEMM, a linear whose dW goes into a
``GradGroup`` of dW's own dtype has its wgrad GEMM write dW straight into the group's buffer
(``cublaslt.blocked_gemm_into`` on the GPU; the product and a ``dynamic_update_slice``, the same
bytes, elsewhere), so no (M, N) dW temporary and no copy into the bucket remain. This needs the
unit function to declare ``linears_at_top = True`` (a class attribute, as ``gpt_math.GPTBlockFn``
does): it calls no linear under a transformation of its own (``jax.checkpoint``, ``vmap``, ...),
so every rule runs in ``unit_backward``'s own trace. Undeclared functions keep dW via autodiff
and a copy (``_deferrable``; docs/extending.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeAlias, cast

import jax
import jax.numpy as jnp
from jax import lax

from common.formats import ALL_PLANES, Plane
from jax_side.linear import FlatPlane, high_precision_linear, quantize_weight
from jax_side.mxfp8 import MXFP8Tensor, elementwise, epilogue
from jax_side.mxfp8.blocked_operands import BLOCKED_GEMMS
from jax_side.mxfp8.kernels import ResolvedKernels
from jax_side.unit_grads import GradGroup, GradLayout, Grads, grad_layout, pack_grads
from jax_side.unit_linear import (
    backward_scope,
    fuses,
    fuses_post,
    splits,
    unit_linear,
    unit_linear_parts,
    unit_linear_post,
    unit_linear_pre,
)

__all__ = [
    "FlatTensor",
    "Forwarded",
    "GradGroup",
    "GradLayout",
    "Grads",
    "Saved",
    "SpanFn",
    "UnitSpec",
    "grad_layout",
    "unit_apply",
    "unit_backward",
    "unit_forward",
    "unit_recompute_backward",
]

# The programs' pytree arguments and results (module docstring: "Weights"; Out: a jax.Array, or
# a tuple of them: several outputs, or a SpanFn's; the cotangents alike):
Params: TypeAlias = Sequence[Any]  # each a jax.Array or a FlatTensor
Rows: TypeAlias = Sequence[Any]  # each a FlatPlane, an MXFP8Tensor, or a high-precision jax.Array
Cols: TypeAlias = Sequence[Any]  # each a FlatPlane, an MXFP8Tensor, or None
Out: TypeAlias = Any

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


class UnitSpec(NamedTuple):
    """The static part of a unit program (hashable: equal blocks share compiled programs)."""

    fn: Callable | SpanFn  # fn(params, linear, x, *aux) -> out, or several x and outs
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

    @property
    def linears_at_top(self) -> bool:
        """``linears_at_top`` of every block (``_deferrable``)."""
        return all(getattr(f, "linears_at_top", False) for f in self.fns)

    def block(self, i: int, params: dict[str, Any], linear: Callable, x: jax.Array) -> Out:
        """Block ``i`` on ``x``; ``params`` holds (at least) its own ``<i>.<name>`` entries."""
        prefix = f"{i}."
        own = {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}
        return self.fns[i](own, lambda name, h, parts=1, pre=None, post=None: linear(
            prefix + name, h, parts, pre, post), x)


# ---------------------------------------------------------------- the MXFP8 linear of a unit


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


def _carriers(spec: UnitSpec, row_planes: Rows, linears: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """Gradient carriers of the MXFP8 linears ``linears`` (indices into ``spec.mxfp8``): zeros of
    each weight's shape in its dW dtype, whose cotangents are the dW (``unit_linear``)."""
    return tuple(jnp.zeros(row_planes[i].shape, jnp.dtype(spec.dw_dtypes[i])) for i in linears)


def _call(fn, params, linear, x, aux):
    """``fn(params, linear, *inputs, *aux)``: ``x`` is the one input, or a tuple of them."""
    return fn(params, linear, *x, *aux) if isinstance(x, tuple) else fn(params, linear, x, *aux)


def _bound(spec: UnitSpec, row_planes: Rows, aux: tuple, stage: int | None = None) -> Callable:
    """``f((param values, carriers), x) -> out`` with the linears filled in: the unit function
    over all of ``spec.params`` and ``spec.mxfp8``, or block ``stage`` of a ``SpanFn`` over its
    own (``_stage``)."""
    index = {name: i for i, name in enumerate(spec.mxfp8)}
    hp_lin = set(spec.hp_linears)
    names = spec.params if stage is None else tuple(spec.params[i] for i in _stage(spec, stage))
    own = {i: k for k, i in enumerate(_linears_of(spec, stage))}  # spec.mxfp8 -> carrier
    fn = spec.fn if stage is None else functools.partial(cast(SpanFn, spec.fn).block, stage)

    def f(weights, x):
        values, carriers = weights
        params = dict(zip(names, values, strict=True))

        def linear(name, h, parts=1, pre=None, post=None):
            if post is not None:
                epilogue.check_post(post, f"unit program {spec.fn!r}: linear {name!r}")
                if parts != 1:
                    raise ValueError(f"unit program {spec.fn!r}: linear {name!r}: post applies "
                                     f"to one output, not to parts={parts}")
                if not (name in index and pre is None and fuses_post(
                        row_planes[index[name]], spec.kernels, h.dtype)):
                    return jax.checkpoint(epilogue.EPILOGUES[post].fn)(linear(name, h, 1, pre))
            if parts != 1:
                _check_parts(spec, name, parts, row_planes[index[name]].shape[0]
                             if name in index else params[f"{name}.weight"].shape[0]
                             if name in hp_lin else None)
            if pre is not None:
                elementwise.check(pre, h.dtype, f"unit program {spec.fn!r}: linear {name!r}")
                if not (name in index and parts == 1 and fuses(row_planes[index[name]],
                                                               spec.kernels)):
                    h, pre = jax.checkpoint(pre)(h), None  # pre(h) first, then the linear
            lead = h.shape[:-1]
            h2 = h.reshape(-1, h.shape[-1])
            if name in index:
                i = index[name]
                if parts > 1 and splits(row_planes[i], parts, spec.kernels):
                    ys = unit_linear_parts(h2, row_planes[i], carriers[own[i]], i,
                                           spec.kernels, parts)
                    return tuple(y.reshape(*lead, y.shape[-1]) for y in ys)
                args = (h2, row_planes[i], carriers[own[i]], i, spec.kernels)
                y2 = (unit_linear_post(*args, post) if post is not None else
                      unit_linear(*args) if pre is None else unit_linear_pre(*args, pre))
            elif name in hp_lin:
                y2 = high_precision_linear(h2, params[f"{name}.weight"], kernels=spec.kernels)
            else:
                raise KeyError(
                    f"unit program {spec.fn!r}: linear {name!r} is neither an MXFP8 linear "
                    f"{spec.mxfp8} nor a high-precision one {spec.hp_linears} of this unit"
                )
            y = y2.reshape(*lead, y2.shape[-1])
            return y if parts == 1 else tuple(jnp.split(y, parts, axis=-1))

        return _call(fn, params, linear, x, aux)

    return f


def _check_parts(spec: UnitSpec, name: str, parts: int, n: int | None) -> None:
    """``linear(name, h, parts=...)``: a positive int that divides the output's N (None: the
    linear is unknown, which the caller reports)."""
    if n is not None and (not isinstance(parts, int) or parts < 1 or n % parts):
        raise ValueError(
            f"unit program {spec.fn!r}: linear {name!r} asked for parts={parts!r}; its output "
            f"has {n} features, so parts must be a positive integer that divides {n}"
        )


def _stage(spec: UnitSpec, k: int) -> tuple[int, ...]:
    """Indices into ``spec.params`` of block ``k`` of a ``SpanFn`` (named ``<k>.<name>``)."""
    return tuple(i for i, n in enumerate(spec.params) if n.startswith(f"{k}."))


def _linears_of(spec: UnitSpec, k: int | None) -> tuple[int, ...]:
    """Indices into ``spec.mxfp8`` of block ``k`` of a ``SpanFn`` (all of them for None)."""
    return tuple(i for i, n in enumerate(spec.mxfp8) if k is None or n.startswith(f"{k}."))


def _linearize(spec: UnitSpec, row_planes: Rows, aux: tuple, values: tuple, x: Out, *,
               vjp: bool = True) -> tuple[Out, Any, tuple]:
    """(out, linearization, outputs passed on): the unit function and its ``jax.vjp`` of the
    parameters, the gradient carriers and the input(s) (None with ``vjp=False``). For a
    ``SpanFn``: one ``jax.vjp`` per block (of its own parameters and carriers and its input),
    out the tuple of the blocks' outputs, of which all but the last are passed on to the next
    block through ``_boundary``."""
    if not isinstance(spec.fn, SpanFn):
        f = _bound(spec, row_planes, aux)
        weights = (values, _carriers(spec, row_planes, _linears_of(spec, None)))
        return (*jax.vjp(f, weights, x), ()) if vjp else (f(weights, x), None, ())
    outs, vjps = [], []
    for k in range(len(spec.fn.fns)):
        f = _bound(spec, row_planes, aux, k)
        own = (tuple(values[i] for i in _stage(spec, k)),
               _carriers(spec, row_planes, _linears_of(spec, k)))
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


def _pullback(spec: UnitSpec, vjp: Any, dout: Out) -> tuple[tuple, tuple, Out]:
    """(gradient of each of ``spec.params``, dW of each of ``spec.mxfp8``, dx). For a
    ``SpanFn``, ``dout`` holds a cotangent or None per block output (the last one present):
    block k's rule takes block k+1's dx plus block k's own cotangent, where one came, as
    autograd sums them for units of one block. Which are None is part of jit's cache key: a
    missing one costs nothing."""
    if not isinstance(spec.fn, SpanFn):
        (d_params, dws), dx = vjp(dout)
        return d_params, dws, dx
    if len(dout) != len(vjp) or dout[-1] is None:
        raise ValueError(f"unit_backward: a span of {len(vjp)} blocks takes a cotangent or "
                         f"None per output, the last one present; got {dout}")
    grads: list = [None] * len(spec.params)
    dw: list = [None] * len(spec.mxfp8)
    ct = dout[-1]
    for k in reversed(range(len(vjp))):
        if k < len(vjp) - 1:
            ct = _boundary(ct if dout[k] is None else ct + dout[k])
        (d_own, dw_own), ct = vjp[k](ct)
        for i, g in zip(_stage(spec, k), d_own, strict=True):
            grads[i] = g
        for i, g in zip(_linears_of(spec, k), dw_own, strict=True):
            dw[i] = g
    return tuple(grads), tuple(dw), ct


# ------------------------------------------------------------------------------- the programs


@functools.partial(jax.jit, static_argnames=("spec",))
def unit_apply(params: Params, rows: Rows, x: Out, aux: tuple, *, spec: UnitSpec) -> Out:
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

    def kept(self, params: Params, rows: Rows, x: Out, aux: tuple, out: Out = None) -> tuple:
        """The source leaves the backward needs back, in ``positions`` order (``out``: the
        forward's output, needed where a span passes outputs on)."""
        flat = jax.tree.leaves((params, rows, x, aux, out))
        return tuple(flat[i] for _, i in self.positions)

    def kept_without_params(self, params: Params, rows: Rows, x: Out, aux: tuple,
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
def unit_forward(params: Params, rows: Rows, x: Out, aux: tuple, *,
                 spec: UnitSpec) -> tuple[Out, Saved]:
    """(out, ``Saved``): the forward and its linearization (module docstring)."""
    row_planes, own_cols = _weights(rows, spec.kernels)
    out, vjp, passed = _linearize(spec, row_planes, aux, _values(params), x)
    vjp, forwarded = _strip_inputs(vjp, (params, rows, x, aux, out), passed)
    return out, Saved(vjp, own_cols, forwarded)


def _deferrable(spec: UnitSpec) -> frozenset[int]:
    """MXFP8 linears whose dW its wgrad GEMM can write into a gradient group itself: an
    ``fp8_blocked`` GEMM, a group of dW's own dtype (no cast between), and a unit function that
    declares ``linears_at_top = True``: it calls no linear under a transformation of its own
    (``jax.checkpoint``, ``vmap``, ...), so every rule runs in ``unit_backward``'s own trace and
    the operands it records are values of that trace (a rule run in an ended inner trace would
    hand over values that fail only when the program runs). Undeclared: dW via autodiff."""
    if spec.kernels.gemm not in BLOCKED_GEMMS or not getattr(spec.fn, "linears_at_top", False):
        return frozenset()
    n = len(spec.params)
    dtype = {i: g.dtype for g in spec.grad_groups for i, _ in g.slots}
    return frozenset(j for j, dw in enumerate(spec.dw_dtypes)
                     if jnp.dtype(dtype.get(n + j, "bool")) == jnp.dtype(dw))


def _gradients(vjp: Any, own_cols: tuple, dout: Out, cols: Cols, spec: UnitSpec) -> Grads:
    cols = tuple(c if c is not None else o for c, o in zip(cols, own_cols, strict=True))
    missing = [spec.mxfp8[i] for i, c in enumerate(cols) if c is None]
    if missing:
        raise ValueError(
            f"unit_backward: no colwise plane for the MXFP8 linears {missing}: pass each "
            f"weight's colwise plane (or quantize it in the forward by passing the weight)"
        )
    # Library backward rules (jax.nn.dot_product_attention's) mix bf16 and fp32 internally;
    # under jax_numpy_dtype_promotion="strict" (the tests) they need the standard rules.
    with backward_scope(cols, _deferrable(spec)) as scope, jax.numpy_dtype_promotion("standard"):
        d_params, dws, dx = _pullback(spec, vjp, dout)
    return pack_grads(dx, [*d_params, *dws], spec.grad_groups, scope.writers(len(spec.params)))


@functools.partial(jax.jit, static_argnames=("spec",))
def unit_backward(saved: Saved, kept: tuple, dout: Out, cols: Cols, *,
                  spec: UnitSpec) -> Grads:
    """The gradients (``Grads``: packed as ``GradLayout`` says, and the groups' buffers) from
    the forward's ``saved``, the inputs (and outputs) it forwarded
    (``saved.forwarded.kept(...)``) and the output gradient ``dout`` (for a ``SpanFn``: one per
    block output, None where none came, ``_pullback``); ``cols``: the colwise plane of each
    MXFP8 linear (None: quantized in the forward)."""
    return _gradients(_restore_inputs(saved, kept), saved.own_cols, dout, cols, spec)


@functools.partial(jax.jit, static_argnames=("spec",))
def unit_recompute_backward(params: Params, rows: Rows, x: Out, aux: tuple, dout: Out,
                            cols: Cols, *, spec: UnitSpec) -> Grads:
    """Recompute the forward, then the backward, in one program (activation recompute)."""
    row_planes, own_cols = _weights(rows, spec.kernels)
    _, vjp, _ = _linearize(spec, row_planes, aux, _values(params), x)
    return _gradients(vjp, own_cols, dout, cols, spec)
