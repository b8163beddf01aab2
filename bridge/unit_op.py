"""The autograd op of a unit program: its forward runs one JAX program, its backward one.

``run_op(module, fn, inputs, aux, ...)`` runs ``fn`` over what ``bridge.unit_layout`` found in
``module`` as one ``torch.autograd.Function`` around ``jax_side.unit_program``: the forward
program keeps its residuals on the JAX side, the backward program returns the gradient of every
differentiable input and every parameter in one uint8 array (one crossing back), cut into views.
dW comes in each weight's own dtype, as from the per-linear op. Without FSDP autograd hands the
gradients to the parameters; under FSDP the gradients of parameters whose source names a
``GradTarget`` come laid out as their group's grad bucket, one array per group (one more
crossing each), and go to its sink, which takes the buffer whole
(``torch_side.fsdp.fsdp_unit.GroupGradSink``: the group's reducer adopts it as the bucket, or
adds it to one already staged), and autograd gets None for them -- the bytes that reach the
bucket are the same (``tests/torch_side/test_grad_sinks.py``).

Inputs and outputs: ``inputs`` are the differentiable tensors (one for the GPT's block; a block
type may declare several), ``aux`` further non-differentiable ones (e.g. targets). The op returns
the program's output, or a tuple where the function returns several (a block with several
outputs, a span's one per block). In backward an output that got no gradient is None
(``set_materialize_grads(False)``): a span's program takes None for it; elsewhere zeros stand in.

Residual lifetime: the forward program's residuals (JAX arrays) live as long as autograd's
saved tensors (``bridge.residuals``): freed right after this node's backward, or, for
``backward(retain_graph=True)``, with the graph.

Recompute (``recompute=True``): the forward keeps nothing but its inputs; the backward program
runs the forward again, then the backward (under FSDP the rowwise planes are gathered again for
it, phase ``RECOMPUTE``). Evaluation (no gradients) runs the forward program of training, its
residuals dropped at once (``_evaluate``), for training's bits. Inside ``compile_ahead()`` both
programs are submitted and the op returns zeros, like the per-linear op.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeAlias

import jax
import torch
from torch import nn

from bridge import residuals
from bridge.compile_ahead import active, run_in, run_or_compile
from bridge.dlpack import to_jax
from bridge.dtypes import torch_dtype_for
from bridge.linear import _result, _share
from bridge.unit_bindings import UnitBinding, binding_of
from bridge.unit_layout import Prepared, jax_name, prepared
from bridge.unit_spans import SpanRun, UnitSpan
from common import trace
from common.formats import Plane
from jax_side import unit_program as U

__all__ = ["run_op"]

TRACK = "jax: unit programs (dispatch)"  # trace track: host time to hand a program to JAX


class _Call(NamedTuple):
    """One unit call: what the autograd op needs besides tensors."""

    found: Prepared
    n_inputs: int
    n_aux: int
    recompute: bool
    span_run: weakref.ref[SpanRun] | None = None  # a span's call: its run (checked at backward)


def _jax_inputs(
    call: _Call, inputs: Sequence[torch.Tensor], aux: Sequence[torch.Tensor]
) -> tuple[U.Params, U.Rows, U.Out, tuple[jax.Array, ...]]:
    """(params, rows, x, aux) as the programs take them; x: the one input, or a tuple."""
    layout = call.found.layout
    params = tuple(p.jax_input() for p in layout.params)
    rows = tuple(lin.plane(Plane.ROWWISE) for lin in layout.linears)
    xs = tuple(_share(x) for x in inputs)
    return params, rows, xs[0] if len(xs) == 1 else xs, tuple(to_jax(_aux32(a)) for a in aux)


def _aux32(a: torch.Tensor) -> torch.Tensor:
    """int64 (Torch's index dtype) as int32, which JAX uses without x64 (a small copy)."""
    a = a.detach()
    return a.to(torch.int32) if a.dtype == torch.int64 else a


Returned: TypeAlias = torch.Tensor | tuple[torch.Tensor, ...]  # one output, or several (a span's)


def _returned(outs: tuple[torch.Tensor, ...], several: bool) -> Returned:
    return outs if several else outs[0]


class _UnitFn(torch.autograd.Function):
    """forward: ``unit_forward`` (or ``unit_apply`` when recomputing); backward:
    ``unit_backward`` (or ``unit_recompute_backward``), one crossing back for every gradient
    and one per gradient group (module docstring). Arguments: the call, its inputs, its aux
    tensors, its parameters."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *tensors: torch.Tensor) -> Returned:
        inputs, aux = tensors[:call.n_inputs], tensors[call.n_inputs:call.n_inputs + call.n_aux]
        spec = call.found.spec
        params, rows, xj, auxj = _jax_inputs(call, inputs, aux)
        device = inputs[0].device
        ctx.set_materialize_grads(False)
        ctx.call, ctx.ahead, ctx.device = call, active(), device
        ctx.x_meta = tuple((tuple(x.shape), x.dtype) for x in inputs)
        if call.recompute:
            ctx.save_for_backward(*inputs, *aux)
            with trace.span(TRACK, "unit_apply"):
                out = run_or_compile(U.unit_apply, params, rows, xj, auxj, spec=spec)
        else:
            with trace.span(TRACK, "unit_forward"):
                out, saved = run_or_compile(U.unit_forward, params, rows, xj, auxj, spec=spec)
            # inputs that are residuals (e.g. x, saved by a checkpointed LayerNorm) stay here,
            # as do a span's outputs that its later blocks keep; parameters are read again at
            # backward (FSDP gathers them for it), so the forward's gathered buckets go back
            # to FSDP's pool at reshard instead of living till then
            kept = saved.forwarded.kept_without_params(params, rows, xj, auxj, out)
            ctx.save_for_backward(residuals.holder((saved, kept)))
        outs = _results(out, device)
        ctx.several = isinstance(out, tuple)
        ctx.out_meta = [(tuple(o.shape), o.dtype) for o in outs]
        return _returned(outs, ctx.several)

    @staticmethod
    def backward(ctx, *douts):
        call = ctx.call
        spec = call.found.spec
        run_ = call.span_run() if call.span_run is not None else None
        if run_ is not None:
            run_.check_done()
        cols = tuple(lin.plane(Plane.COLWISE) for lin in call.found.layout.linears)
        dj = _cotangents(ctx, douts)
        if call.recompute:
            saved = ctx.saved_tensors
            inputs, aux = saved[:call.n_inputs], saved[call.n_inputs:]
            params, rows, xj, auxj = _jax_inputs(call, inputs, aux)
            with trace.span(TRACK, "unit_recompute_backward"):
                grads = run_in(ctx.ahead, U.unit_recompute_backward, params, rows, xj, auxj,
                               dj, cols, spec=spec)
        else:
            saved, kept = residuals.saved(ctx)  # raises once the graph was freed
            if any(k is None for k in kept):
                params = tuple(p.jax_input() for p in call.found.layout.params)
                kept = saved.forwarded.with_params(kept, params)
            with trace.span(TRACK, "unit_backward"):
                grads = run_in(ctx.ahead, U.unit_backward, saved, kept, dj, cols, spec=spec)
        dxs, param_grads = _unpack(_result(grads.packed, ctx.device), ctx)
        for (sink, n), flat in zip(call.found.sinks, grads.groups, strict=True):
            # FSDP's grad bucket: the buffer taken whole (adopted, or one add)
            sink.stage_segment(_result(flat, ctx.device), n)
        return (None, *dxs, *([None] * call.n_aux), *param_grads)


def _results(out: U.Out, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A program's output (one array, or a tuple of them) as Torch tensors."""
    return tuple(_result(o, device) for o in (out if isinstance(out, tuple) else (out,)))


def _cotangents(ctx, douts):
    """The output gradients as the backward program takes them: one array, or a tuple. A span's
    has None where no gradient came, except the last block's output, which always has one
    (zeros when the model read only earlier outputs: rare, and not on a block loop's path); a
    function of several outputs has zeros for each output that got none."""
    zeros = [torch.zeros(shape, dtype=dtype, device=ctx.device) if d is None else d
             for d, (shape, dtype) in zip(douts, ctx.out_meta, strict=True)]
    if not ctx.several:
        return _share(zeros[0])
    if ctx.call.span_run is None:
        return tuple(_share(d) for d in zeros)
    return (*(None if d is None else _share(d) for d in douts[:-1]), _share(zeros[-1]))


def _grad_layout(ctx: Any) -> U.GradLayout:
    found: Prepared = ctx.call.found
    cache = found.layout.grad_layouts
    key = (found.spec, ctx.x_meta)
    if key not in cache:
        layout, spec = found.layout, found.spec
        cache[key] = U.grad_layout(
            [(shape, jax_name(dtype)) for shape, dtype in ctx.x_meta],
            [tuple(p.param.shape) for p in layout.params],
            [jax_name(p.param.dtype) for p in layout.params],
            [tuple(lin.weight.shape) for lin in layout.linears], spec.dw_dtypes,
            spec.grad_groups,
        )
    return cache[key]


def _view(raw: torch.Tensor, seg: tuple[int, tuple[int, ...], str]) -> torch.Tensor:
    start, shape, dtype = seg
    t = torch_dtype_for(dtype)
    n = t.itemsize
    for d in shape:
        n *= d
    return raw[start:start + n].view(t).view(shape)


def _unpack(raw: torch.Tensor, ctx: Any) -> tuple[list[torch.Tensor | None],
                                                  list[torch.Tensor | None]]:
    """(each input's gradient; each parameter's gradient, then each MXFP8 weight's dW -- None
    for those in a group or not needed): views of the one packed array."""
    call = ctx.call
    layout = _grad_layout(ctx)
    n = call.n_inputs
    needs = ctx.needs_input_grad
    dxs = [_view(raw, seg) if need else None
           for seg, need in zip(layout.dxs, needs[1:1 + n], strict=True)]
    grads = [None if seg is None or not need else _view(raw, seg)
             for seg, need in zip((*layout.params, *layout.mxfp8),
                                  needs[1 + n + call.n_aux:], strict=True)]
    return dxs, grads


def run_op(module: nn.Module, fn: Callable | U.SpanFn, inputs: Sequence[torch.Tensor],
           aux: Sequence[torch.Tensor], recompute: bool, *, parts: Sequence[str] | None = None,
           binding: UnitBinding | None = None, span: UnitSpan | None = None,
           span_run: SpanRun | None = None) -> Returned:
    """``fn`` over ``module``'s parameters (those of ``parts``, or of ``span``'s blocks) as one
    program per direction (module docstring). ``binding``: the module's, where the caller holds
    it (else the one FSDP holds, or a fresh one for this call)."""
    if binding is None:
        binding = binding_of(module) or UnitBinding()
    found = prepared(binding, module, fn, parts, inputs[0].device, span)
    call = _Call(found, len(inputs), len(aux), recompute,
                 None if span_run is None else weakref.ref(span_run))
    if not torch.is_grad_enabled():
        return _evaluate(call, inputs, aux)
    # (parameters whose gradients go to a sink stay inputs -- the output takes gradients as
    # before -- and get None from the backward)
    layout = found.layout
    tensors = [p.param for p in layout.params] + [lin.weight for lin in layout.linears]
    return _UnitFn.apply(call, *inputs, *aux, *tensors)


def _evaluate(call: _Call, inputs: Sequence[torch.Tensor],
              aux: Sequence[torch.Tensor]) -> Returned:
    """The forward without gradients: the very program the forward with gradients runs
    (``unit_forward``, its residuals dropped at once; ``unit_apply`` when recomputing). A
    forward-only program is another XLA program, which may round bf16 intermediates elsewhere
    (XLA keeps them in fp32 inside a fusion unless ``--xla_allow_excess_precision=false``), so
    evaluation would differ from training by an ulp; this way it has training's bits."""
    spec = call.found.spec
    params, rows, xj, auxj = _jax_inputs(call, inputs, aux)
    if call.recompute:
        out = run_or_compile(U.unit_apply, params, rows, xj, auxj, spec=spec)
    else:
        out, _ = run_or_compile(U.unit_forward, params, rows, xj, auxj, spec=spec)
    return _returned(_results(out, inputs[0].device), isinstance(out, tuple))
