"""Unit compute: a Torch block's forward as one JAX program and its backward as one.

The per-linear op (``bridge.linear``) enters JAX twice per linear layer and pays Python dispatch on
both sides each time; a GPT step is then bound by the host, not the GPU (docs/DESIGN.md section
8). Here a whole block -- a **unit** -- is one autograd op around ``jax_side.unit_program``: its
forward runs the block's JAX function (the Flax twin's math, ``gpt_math``) in one jitted program
that keeps its residuals on the JAX side, its backward one program that returns dx and every
parameter's gradient in one crossing.

Registering a block type: ``register_unit(BlockType, fn_for)``, where ``fn_for(module)`` returns
the block's JAX function ``fn(params, linear, x) -> y`` (a hashable callable:
``unit_program``'s contract). ``set_compute(model, Compute.UNIT)`` then runs every registered
block of ``model`` through it (an instance-level ``forward``; ``Compute.OP`` restores the class's
own forward, which the per-linear op serves). ``run_unit(module, fn, x, *aux, parts=...)`` runs
any function over any set of submodules (the GPT's head and loss use it). The GPT's own block and
head functions (``jax_side.models.gpt_math``) are re-exported here for ``torch_side``, which
reaches JAX only through the bridge.

What the unit reads, per parameter of the block (found once per module and cached):

- an ``MXFP8Linear`` in ``LinearMode.MXFP8`` (bias-free): its weight's planes. Under FSDP the
  module carries ``fsdp_sources["weight"]`` (set by ``torch_side``), whose ``shared(plane)`` is
  the plane inside FSDP's gathered bucket, shared with JAX once per bucket lifetime: the rowwise
  plane in forward, the colwise plane in backward (FSDP's phase rule). Without FSDP the weight
  itself crosses and the program quantizes ``bf16(weight)`` (both planes);
- every other parameter (LayerNorm, a high-precision linear's weight): by block-relative name;
  under FSDP ``fsdp_sources[name].shared_tensor()`` is its slice of the group's shared buffer,
  otherwise the tensor crosses.

Gradients: the backward returns dx and the gradients of all parameters in one uint8 array (one
crossing), cut into views. dW comes in each weight's own dtype (its ``dtype``), as from the
per-linear op. Without FSDP autograd hands them to the parameters. Under FSDP each parameter's
source names a ``GradTarget`` (``bridge.unit_targets``: its group's grad bucket): the program
then lays each group's gradients out as that bucket (``unit_program.GradGroup``: cast to the
bucket's dtype, zeros in the padding) and the op hands the segment to the group's sink (one add
into the bucket per group, ``torch_side.fsdp_unit.GroupGradSink``) and returns None to autograd
for those parameters -- instead of an autograd accumulation, a hook and a staging add per
parameter. The bytes that reach the bucket are the same (``tests/torch_side/test_grad_sinks.py``).

Recompute (``recompute=True``, or the model's ``set_compute(..., recompute=True)``): the forward
keeps nothing but its inputs; the backward program runs the forward again, then the backward
(under FSDP the rowwise planes are gathered again for it, phase ``RECOMPUTE``).

Evaluation (no gradients) runs the forward program of training, its residuals dropped at once
(``_evaluate``), for training's bits. An FSDP unit of several registered blocks runs as one
program per direction whose outputs its blocks return, each its own (``bridge.unit_spans``).

Ahead-of-time compilation: inside ``compile_ahead()`` both programs are submitted and the op
returns zeros, like the per-linear op.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import torch
from torch import nn

from bridge.compile_ahead import active, run_in, run_or_compile
from bridge.dlpack import to_jax
from bridge.dtypes import torch_dtype_for
from bridge.linear import MXFP8Linear, _result, _share, resolve_for
from bridge.shared import to_flat_plane, to_flat_tensor
from bridge.unit_spans import SpanRun, later_block_output
from bridge.unit_targets import SPAN_PENDING, SPECS_CACHE, UNIT_SPAN, GradTarget
from common import trace
from common.formats import Plane
from common.kernels import KernelConfig
from common.modes import Compute, LinearMode
from jax_side import unit_program as U
from jax_side.linear import FlatPlane
from jax_side.models.gpt_math import GPTBlockFn, GPTHeadFn

__all__ = [
    "GPTBlockFn",
    "GPTHeadFn",
    "register_unit", "registered_fn", "run_unit", "set_compute", "unit_modules"]

_REGISTRY: dict[type, Callable[[nn.Module], Callable]] = {}
TRACK = "jax: unit programs (dispatch)"  # trace track: host time to hand a program to JAX


def register_unit(module_type: type, fn_for: Callable[[nn.Module], Callable]) -> None:
    """Run ``module_type`` blocks as unit programs under ``Compute.UNIT`` (module docstring)."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_unit: expected an nn.Module subclass, got {module_type!r}")
    if not callable(fn_for):
        raise TypeError(f"register_unit: fn_for must be callable(module) -> fn, got {fn_for!r}")
    _REGISTRY[module_type] = fn_for


def registered_fn(module: nn.Module) -> Callable | None:
    """The JAX function of a registered block (None for other modules)."""
    for cls in type(module).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls](module)
    return None


def _registered(module: nn.Module) -> Callable:
    fn = registered_fn(module)
    assert fn is not None, type(module)  # called on registered blocks only
    return fn


def unit_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every registered block in ``model``."""
    return [(n, m) for n, m in model.named_modules() if registered_fn(m) is not None]


def set_compute(model: nn.Module, compute: Compute | str, *, recompute: bool = False) -> int:
    """Run every registered block of ``model`` as a unit (``Compute.UNIT``) or through its own
    forward (``Compute.OP``); returns how many blocks were switched."""
    compute = Compute.parse(compute)
    mods = unit_modules(model)
    for _, m in mods:
        m.__dict__.pop("forward", None)  # back to the class's forward
        if compute is Compute.UNIT:  # the function is asked for at each call (device moves)
            m.forward = types.MethodType(
                lambda self, x: _block_forward(self, x, recompute), m
            )
    return len(mods)


# ------------------------------------------------ several blocks, one program (an FSDP unit)


def _span_of(block: nn.Module) -> tuple[nn.Module, ...] | None:
    """The modules of ``block``'s FSDP unit when they are several registered blocks."""
    span = block.__dict__.get(UNIT_SPAN)
    if span is None or any(not isinstance(m, tuple(_REGISTRY)) for m in span):
        return None
    return span


def _block_forward(block: nn.Module, x: torch.Tensor, recompute: bool) -> torch.Tensor:
    """A registered block's forward under ``Compute.UNIT``: its own unit program; or, when it
    is the first of an FSDP unit of several blocks (``UNIT_SPAN``), one program for all of
    them, whose outputs the unit's blocks then return, each its own (``bridge.unit_spans``)."""
    span = _span_of(block)
    if span is None:
        return run_unit(block, _registered(block), x, recompute=recompute)
    if span[0] is not block:
        return later_block_output(block, span, x)
    prev = block.__dict__.get(SPAN_PENDING)
    if prev is not None:
        prev.check_previous()  # the previous forward skipped one of them (FSDP drops the
        # record of a forward an exception aborted: FSDPUnit.abort)
    fn = U.SpanFn(tuple(_registered(m) for m in span))
    run_ = SpanRun(span, torch.is_grad_enabled())
    outs = _run(block, fn, x, (), recompute, span=span, span_run=weakref.ref(run_))
    for m in span:
        m.__dict__[SPAN_PENDING] = run_
    return run_.start(outs)


# ------------------------------------------------------------------ what a unit reads (cached)


class _Param(NamedTuple):
    name: str  # block-relative
    owner: nn.Module
    local: str  # name inside owner
    param: nn.Parameter


class _Layout(NamedTuple):
    """The unit's parameters and MXFP8 linears, found once per (module, parts)."""

    params: tuple[_Param, ...]
    linears: tuple[tuple[str, MXFP8Linear], ...]  # MXFP8 mode
    hp_linears: tuple[str, ...]
    grad_layouts: dict  # (spec, x shape, x dtype) -> U.GradLayout, filled on first use


def _walk(module: nn.Module, parts: Sequence[str] | None) -> Iterator[tuple[str, nn.Module]]:
    if parts is None:
        yield from module.named_modules()
        return
    for part in parts:
        sub = module.get_submodule(part)
        for name, m in sub.named_modules():
            yield (f"{part}.{name}" if name else part), m


def _walk_span(span: tuple[nn.Module, ...]) -> Iterator[tuple[str, nn.Module]]:
    """A span's modules, named ``<i>.<name>`` by their place in it (``jax_side``'s ``SpanFn``)."""
    for i, member in enumerate(span):
        for name, m in member.named_modules():
            yield (f"{i}.{name}" if name else str(i)), m


def _find_layout(module: nn.Module, parts: Sequence[str] | None,
                 span: tuple[nn.Module, ...] | None = None) -> _Layout:
    params, linears, hp_linears = [], [], []
    for mname, mod in (_walk(module, parts) if span is None else _walk_span(span)):
        mx = isinstance(mod, MXFP8Linear)
        if mx and mod.bias is not None:
            raise ValueError(
                f"unit compute: {type(module).__name__} layer {mname!r} is an MXFP8Linear with "
                f"a bias; a unit program's linears are bias-free (as the GPT's): build the layer "
                f"with bias=False, or run this block with Compute.OP"
            )
        if mx and mod.mode is LinearMode.MXFP8:
            linears.append((mname, mod))
            continue
        if mx:
            hp_linears.append(mname)
        for pname, p in mod.named_parameters(recurse=False):
            params.append(_Param(f"{mname}.{pname}" if mname else pname, mod, pname, p))
    if not linears and not params:
        raise ValueError(
            f"unit compute: {type(module).__name__} (parts {parts}) has no parameters to run"
        )
    return _Layout(tuple(params), tuple(linears), tuple(hp_linears), {})


def _layout(module: nn.Module, parts: Sequence[str] | None) -> _Layout:
    cache = module.__dict__.setdefault("_unit_layouts", {})
    key = None if parts is None else tuple(parts)
    if key not in cache:
        cache[key] = _find_layout(module, parts)
    return cache[key]


def _param_input(p: _Param) -> U.FlatTensor | jax.Array:
    source = getattr(p.owner, "fsdp_sources", {}).get(p.local)
    if source is not None:
        return to_flat_tensor(source.shared_tensor())
    return _share(p.param)


def _plane_input(lin: MXFP8Linear, plane: Plane) -> FlatPlane | jax.Array | None:
    """The weight's plane shared from FSDP, or (rowwise only) the weight itself to quantize."""
    source = getattr(lin, "fsdp_sources", {}).get("weight")
    if source is not None:
        return to_flat_plane(source.shared(plane))
    return _share(lin.weight) if plane is Plane.ROWWISE else None


class _Call(NamedTuple):
    """One unit call: what the autograd op needs besides tensors."""

    layout: _Layout
    spec: U.UnitSpec
    n_aux: int
    recompute: bool
    sinks: tuple[tuple[object, int], ...]  # (sink, gradients it takes), grad_groups order
    span_run: weakref.ref | None = None  # a span's call: its ``SpanRun`` (checked at backward)


def _layout_and_spec(
    module: nn.Module, fn: Callable, parts: Sequence[str] | None, device: torch.device,
    span: tuple[nn.Module, ...] | None = None,
) -> tuple[_Layout, U.UnitSpec, tuple[tuple[object, int], ...]]:
    """The unit's layout, program spec and gradient sinks, made once per (parts, function,
    device) and cached on the module: the per-call path only looks them up (a unit call is on
    the host-bound path). ``torch_side`` drops the cache when it (re)installs FSDP sources
    (and with it the span: a span's layout lives only here, keyed on its first module)."""
    cache = module.__dict__.setdefault(SPECS_CACHE, {})
    key = (None if parts is None else tuple(parts), fn, device, span is not None)
    if key not in cache:
        layout = _layout(module, parts) if span is None else _find_layout(module, None, span)
        groups, sinks = _grad_groups(layout)
        cache[key] = layout, _spec(fn, layout, device, _kernels(layout, module), groups), sinks
    return cache[key]


def _spec(fn: Callable, layout: _Layout, device: torch.device, kernels: KernelConfig | None,
          groups: tuple[U.GradGroup, ...] = ()) -> U.UnitSpec:
    return U.UnitSpec(
        fn,
        tuple(p.name for p in layout.params),
        tuple(n for n, _ in layout.linears),
        layout.hp_linears,
        tuple(str(lin.weight.dtype).removeprefix("torch.") for _, lin in layout.linears),
        resolve_for(kernels, device),
        groups,
    )


def _grad_target(owner: nn.Module, local: str, param: nn.Parameter) -> GradTarget | None:
    source = getattr(owner, "fsdp_sources", {}).get(local)
    target = getattr(source, "grad_target", None)
    return target() if target is not None and param.requires_grad else None


def _grad_groups(layout: _Layout) -> tuple[tuple[U.GradGroup, ...], tuple[tuple[object, int], ...]]:
    """Gradients whose FSDP source names a target (``GradTarget``), grouped by sink: the
    program lays each group out as the sink's flat buffer (``U.GradGroup``)."""
    owners = [(p.owner, p.local, p.param) for p in layout.params]
    owners += [(lin, "weight", lin.weight) for _, lin in layout.linears]
    by_sink: dict[int, list] = {}  # (FSDP refuses tied parameters: no slot is targeted twice)
    for i, (owner, local, param) in enumerate(owners):
        t = _grad_target(owner, local, param)
        if t is None:
            continue
        entry = by_sink.setdefault(id(t.sink), [t.sink, t.numel, t.dtype, []])
        if (entry[1], entry[2]) != (t.numel, t.dtype):
            raise ValueError(f"unit compute: gradient targets of one sink disagree: {t}")
        entry[3].append((i, t.start))
    groups = tuple(U.GradGroup(numel, _jax_name(dtype), tuple(slots))
                   for _, numel, dtype, slots in by_sink.values())
    return groups, tuple((sink, len(slots)) for sink, _, _, slots in by_sink.values())


def _kernels(layout: _Layout, module: nn.Module) -> KernelConfig | None:
    configs = {lin.kernels for _, lin in layout.linears}
    if len(configs) > 1:
        raise ValueError(
            f"unit compute: the MXFP8 linears of {type(module).__name__} were built with "
            f"different KernelConfigs {configs}; a unit program runs one: build them alike"
        )
    return next(iter(configs), None)


def _jax_inputs(
    call: _Call, x: torch.Tensor, aux: Sequence[torch.Tensor]
) -> tuple[U.Params, U.Rows, jax.Array, tuple[jax.Array, ...]]:
    params = tuple(_param_input(p) for p in call.layout.params)
    rows = tuple(_plane_input(lin, Plane.ROWWISE) for _, lin in call.layout.linears)
    return params, rows, _share(x), tuple(to_jax(_aux32(a)) for a in aux)


def _aux32(a: torch.Tensor) -> torch.Tensor:
    """int64 (Torch's index dtype) as int32, which JAX uses without x64 (a small copy)."""
    a = a.detach()
    return a.to(torch.int32) if a.dtype == torch.int64 else a


class _UnitFn(torch.autograd.Function):
    """forward: ``unit_forward`` (or ``unit_apply`` when recomputing); backward:
    ``unit_backward`` (or ``unit_recompute_backward``), one crossing back for every gradient.
    A span's op has one output per block; an output that got no gradient is None in backward
    (``set_materialize_grads(False)``) and picks the program that takes no cotangent for it."""

    @staticmethod
    def forward(ctx: Any, call: _Call, x: torch.Tensor,
                *rest: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        aux = rest[: call.n_aux]
        params, rows, xj, auxj = _jax_inputs(call, x, aux)
        ctx.set_materialize_grads(False)
        ctx.call, ctx.ahead, ctx.device = call, active(), x.device
        ctx.x_dtype, ctx.x_shape = x.dtype, tuple(x.shape)
        if call.recompute:
            ctx.save_for_backward(x, *aux)
            with trace.span(TRACK, "unit_apply"):
                out = run_or_compile(U.unit_apply, params, rows, xj, auxj, spec=call.spec)
        else:
            with trace.span(TRACK, "unit_forward"):
                out, ctx.saved = run_or_compile(U.unit_forward, params, rows, xj, auxj,
                                                spec=call.spec)
            # inputs that are residuals (e.g. x, saved by a checkpointed LayerNorm) stay here,
            # as do a span's outputs that its later blocks keep; parameters are read again at
            # backward (FSDP gathers them for it), so the forward's gathered buckets go back
            # to FSDP's pool at reshard instead of living till then
            ctx.kept = ctx.saved.forwarded.kept_without_params(params, rows, xj, auxj, out)
            ctx.save_for_backward(x.new_empty(0))  # a freed graph raises Torch's own error
        outs = _results(out, x.device)
        ctx.out_meta = [(tuple(o.shape), o.dtype) for o in outs]
        return outs if call.span_run is not None else outs[0]

    @staticmethod
    def backward(ctx, *douts):
        call = ctx.call
        run_ = call.span_run() if call.span_run is not None else None
        if run_ is not None:
            run_.check_done()
        cols = tuple(_plane_input(lin, Plane.COLWISE) for _, lin in call.layout.linears)
        dj = _cotangents(ctx, douts)
        if call.recompute:
            x, *aux = ctx.saved_tensors
            params, rows, xj, auxj = _jax_inputs(call, x, aux)
            with trace.span(TRACK, "unit_recompute_backward"):
                packed = run_in(ctx.ahead, U.unit_recompute_backward, params, rows, xj, auxj,
                                dj, cols, spec=call.spec)
        else:
            ctx.saved_tensors  # noqa: B018 -- raises once the graph was freed
            kept = ctx.kept
            if any(k is None for k in kept):
                params = tuple(_param_input(p) for p in call.layout.params)
                kept = ctx.saved.forwarded.with_params(kept, params)
            with trace.span(TRACK, "unit_backward"):
                packed = run_in(ctx.ahead, U.unit_backward, ctx.saved, kept, dj, cols,
                                spec=call.spec)
        grads, segments = _unpack(_result(packed, ctx.device), ctx)
        for (sink, n), segment in zip(call.sinks, segments, strict=True):
            sink.stage_segment(segment, n)  # FSDP's grad bucket: one add per group
        return (None, grads[0], *([None] * call.n_aux), *grads[1:])


def _results(out: U.Out, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A program's output (one array, or a span's tuple of them) as Torch tensors."""
    return tuple(_result(o, device) for o in (out if isinstance(out, tuple) else (out,)))


def _cotangents(ctx, douts):
    """The output gradients as the backward program takes them: one, or a span's tuple with
    None where no gradient came. The last block's output always has one (zeros when the model
    read only earlier outputs: rare, and not on a block loop's path)."""
    last = douts[-1]
    if last is None:
        shape, dtype = ctx.out_meta[-1]
        last = torch.zeros(shape, dtype=dtype, device=ctx.device)
    if ctx.call.span_run is None:
        return _share(last)
    return (*(None if d is None else _share(d) for d in douts[:-1]), _share(last))


def _grad_layout(call: _Call, x_shape: tuple[int, ...], x_dtype: torch.dtype) -> U.GradLayout:
    cache = call.layout.grad_layouts
    key = (call.spec, x_shape, x_dtype)
    if key not in cache:
        cache[key] = U.grad_layout(
            x_shape, _jax_name(x_dtype),
            [tuple(p.param.shape) for p in call.layout.params],
            [_jax_name(p.param.dtype) for p in call.layout.params],
            [tuple(lin.weight.shape) for _, lin in call.layout.linears], call.spec.dw_dtypes,
            call.spec.grad_groups,
        )
    return cache[key]


def _view(raw: torch.Tensor, seg: tuple[int, tuple[int, ...], str]) -> torch.Tensor:
    start, shape, dtype = seg
    t = torch_dtype_for(dtype)
    n = t.itemsize
    for d in shape:
        n *= d
    return raw[start:start + n].view(t).view(shape)


def _unpack(
    raw: torch.Tensor, ctx: Any
) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """(dx, each parameter's gradient, each MXFP8 weight's dW -- None for those in a group --;
    each gradient group's flat buffer): views of the one packed array."""
    call = ctx.call
    layout = _grad_layout(call, ctx.x_shape, ctx.x_dtype)
    segs = [layout.dx, *layout.params, *layout.mxfp8]
    needs = ctx.needs_input_grad[1:2] + ctx.needs_input_grad[2 + call.n_aux:]
    out = [None if seg is None or not need else _view(raw, seg)
           for seg, need in zip(segs, needs, strict=True)]
    return out, [_view(raw, seg) for seg in layout.groups]


def _jax_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run_unit(
    module: nn.Module, fn: Callable, x: torch.Tensor, *aux: torch.Tensor,
    parts: Sequence[str] | None = None, recompute: bool = False,
) -> torch.Tensor:
    """``fn(params, linear, x, *aux)`` over ``module``'s parameters (or those of its submodules
    ``parts``) as one JAX program per direction (module docstring). x: the activations
    (contiguous where possible: one Torch-side copy otherwise); aux: further non-differentiable
    tensors (e.g. targets)."""
    return _run(module, fn, x, aux, recompute, parts=parts)


def _run(module, fn, x, aux, recompute, *, parts=None, span=None, span_run=None):
    layout, spec, sinks = _layout_and_spec(module, fn, parts, x.device, span)
    call = _Call(layout, spec, len(aux), recompute, sinks, span_run)
    if not torch.is_grad_enabled():
        return _evaluate(call, x, aux)
    # (parameters whose gradients go to a sink stay inputs -- the output takes gradients as
    # before -- and get None from the backward)
    tensors = [p.param for p in layout.params] + [lin.weight for _, lin in layout.linears]
    return _UnitFn.apply(call, x, *aux, *tensors)


def _evaluate(
    call: _Call, x: torch.Tensor, aux: Sequence[torch.Tensor]
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The forward without gradients: the very program the forward with gradients runs
    (``unit_forward``, its residuals dropped at once; ``unit_apply`` when recomputing). A
    forward-only program is another XLA program, which may round bf16 intermediates elsewhere
    (XLA keeps them in fp32 inside a fusion unless ``--xla_allow_excess_precision=false``), so
    evaluation would differ from training by an ulp; this way it has training's bits."""
    params, rows, xj, auxj = _jax_inputs(call, x, aux)
    if call.recompute:
        out = run_or_compile(U.unit_apply, params, rows, xj, auxj, spec=call.spec)
    else:
        out, _ = run_or_compile(U.unit_forward, params, rows, xj, auxj, spec=call.spec)
    outs = _results(out, x.device)
    return outs if call.span_run is not None else outs[0]
