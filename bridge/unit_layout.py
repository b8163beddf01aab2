"""What a unit program reads of a module, found once per (module, parts, function, device).

Per parameter of the unit (a block, a span of blocks, or named submodules ``parts``):

- an ``MXFP8Linear`` in ``LinearMode.MXFP8`` (bias-free): its weight's planes. Under FSDP the
  layer is bound to a ``WeightSource`` (``bridge.unit_bindings``), whose ``shared(plane)`` is
  the plane inside FSDP's gathered bucket, shared with JAX once per bucket lifetime: the rowwise
  plane in forward, the colwise plane in backward (FSDP's phase rule). Without FSDP the weight
  itself crosses and the program quantizes ``bf16(weight)`` (both planes);
- every other parameter (LayerNorm, a high-precision linear's weight): by block-relative name;
  under FSDP its ``ParamSource.shared_tensor()`` is its slice of the group's shared buffer,
  otherwise the tensor crosses.

A source that names a ``GradTarget`` puts the gradient in its sink's flat buffer (the program's
``GradGroup``) instead of autograd. What is found here -- the layout, the program's
``UnitSpec``, the sinks -- is kept in the module's ``UnitBinding`` (``programs``), so a call
only looks it up (a unit call is on the host-bound path); FSDP empties it when it binds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import torch
from torch import nn

from bridge.linear import MXFP8Linear, _share, resolve_for
from bridge.shared import to_flat_plane, to_flat_tensor
from bridge.unit_bindings import (
    GradSink,
    ParamSource,
    UnitBinding,
    WeightSource,
    binding_of,
)
from bridge.unit_spans import UnitSpan
from common.formats import Plane
from common.kernels import KernelConfig
from common.modes import LinearMode
from jax_side import unit_program as U
from jax_side.linear import FlatPlane

__all__ = ["Prepared", "UnitLayout", "UnitLinear", "UnitParam", "jax_name", "prepared"]


class UnitParam(NamedTuple):
    """A high-precision parameter of the unit: its block-relative name, the parameter and,
    under FSDP, where the program reads it."""

    name: str
    param: nn.Parameter
    source: ParamSource | None

    def jax_input(self) -> U.FlatTensor | jax.Array:
        if self.source is not None:
            return to_flat_tensor(self.source.shared_tensor())
        return _share(self.param)


class UnitLinear(NamedTuple):
    """An MXFP8 linear of the unit: its name, its weight and, under FSDP, its planes' source."""

    name: str
    weight: nn.Parameter
    source: WeightSource | None

    def plane(self, plane: Plane) -> FlatPlane | jax.Array | None:
        """The weight's plane shared from FSDP, or (rowwise only) the weight itself to
        quantize; None (colwise without FSDP): the program quantized it in the forward."""
        if self.source is not None:
            return to_flat_plane(self.source.shared(plane))
        return _share(self.weight) if plane is Plane.ROWWISE else None


class UnitLayout(NamedTuple):
    """The unit's parameters and MXFP8 linears."""

    params: tuple[UnitParam, ...]
    linears: tuple[UnitLinear, ...]  # MXFP8 mode
    hp_linears: tuple[str, ...]
    kernels: KernelConfig | None  # the linears' (one for all)
    grad_layouts: dict  # (spec, inputs' shapes and dtypes) -> U.GradLayout, filled on first use


class Prepared(NamedTuple):
    """What a unit call needs besides tensors: the layout, the program's spec and the sinks its
    gradient groups go to, each with how many gradients it takes (``spec.grad_groups`` order)."""

    layout: UnitLayout
    spec: U.UnitSpec
    sinks: tuple[tuple[GradSink, int], ...]


def _walk(module: nn.Module, parts: Sequence[str] | None) -> Iterator[tuple[str, nn.Module]]:
    if parts is None:
        yield from module.named_modules()
        return
    for part in parts:
        sub = module.get_submodule(part)
        for name, m in sub.named_modules():
            yield (f"{part}.{name}" if name else part), m


def _walk_span(span: UnitSpan) -> Iterator[tuple[str, nn.Module]]:
    """A span's modules, named ``<i>.<name>`` by their place in it (``jax_side``'s ``SpanFn``)."""
    for i, member in enumerate(span.members):
        for name, m in member.named_modules():
            yield (f"{i}.{name}" if name else str(i)), m


def _weight_source(
    mname: str, lin: MXFP8Linear, binding: UnitBinding | None
) -> WeightSource | None:
    if binding is None:
        return None
    if "weight" in binding.params:
        raise ValueError(
            f"unit compute: FSDP holds the weight of the MXFP8 linear {mname!r} in high "
            f"precision (its policy's format for it), but a unit program reads an MXFP8 "
            f"linear's planes; give the layer's weight a block-scaled format, build the layer "
            f"in LinearMode.HIGH_PRECISION, or run with Compute.OP"
        )
    return binding.weights.get("weight")


def _find_layout(module: nn.Module, walk: Iterator[tuple[str, nn.Module]], what: str) -> UnitLayout:
    params, linears, hp_linears, configs = [], [], [], set()
    for mname, mod in walk:
        binding = binding_of(mod)
        mx = isinstance(mod, MXFP8Linear)
        if mx and mod.bias is not None:
            raise ValueError(
                f"unit compute: {type(module).__name__} layer {mname!r} is an MXFP8Linear with "
                f"a bias; a unit program's linears are bias-free (as the GPT's): build the layer "
                f"with bias=False, or run this block with Compute.OP"
            )
        if mx and mod.mode is LinearMode.MXFP8:
            linears.append(UnitLinear(mname, mod.weight, _weight_source(mname, mod, binding)))
            configs.add(mod.kernels)
            continue
        if mx:
            hp_linears.append(mname)
        for pname, p in mod.named_parameters(recurse=False):
            source = binding.params.get(pname) if binding is not None else None
            params.append(UnitParam(f"{mname}.{pname}" if mname else pname, p, source))
    if not linears and not params:
        raise ValueError(f"unit compute: {type(module).__name__} ({what}) has no parameters to run")
    if len(configs) > 1:
        raise ValueError(
            f"unit compute: the MXFP8 linears of {type(module).__name__} were built with "
            f"different KernelConfigs {configs}; a unit program runs one: build them alike"
        )
    return UnitLayout(tuple(params), tuple(linears), tuple(hp_linears),
                      next(iter(configs), None), {})


def prepared(binding: UnitBinding, module: nn.Module, fn: Callable | U.SpanFn,
             parts: Sequence[str] | None, device: torch.device,
             span: UnitSpan | None = None) -> Prepared:
    """The unit's layout, program spec and gradient sinks, made once per (parts, function,
    device, span or not) and kept in ``binding`` (a span's: in its first block's)."""
    key = (None if parts is None else tuple(parts), fn, device, span is not None)
    found = binding.programs.get(key)
    if found is None:
        if span is None:
            layout = _find_layout(module, _walk(module, parts), f"parts {parts}")
        else:
            layout = _find_layout(module, _walk_span(span), f"a span of {len(span.members)}")
        groups, sinks = _grad_groups(layout)
        spec = U.UnitSpec(
            fn,
            tuple(p.name for p in layout.params),
            tuple(lin.name for lin in layout.linears),
            layout.hp_linears,
            tuple(jax_name(lin.weight.dtype) for lin in layout.linears),
            resolve_for(layout.kernels, device),
            groups,
        )
        found = binding.programs[key] = Prepared(layout, spec, sinks)
    return found


def _grad_groups(layout: UnitLayout) -> tuple[tuple[U.GradGroup, ...],
                                             tuple[tuple[GradSink, int], ...]]:
    """Gradients whose FSDP source names a target (``GradTarget``), grouped by sink: the
    program lays each group out as the sink's flat buffer (``U.GradGroup``)."""
    sources: list[tuple[ParamSource | WeightSource | None, nn.Parameter]] = [
        (p.source, p.param) for p in layout.params]
    sources += [(lin.source, lin.weight) for lin in layout.linears]
    by_sink: dict[int, list] = {}  # (FSDP refuses tied parameters: no slot is targeted twice)
    for i, (source, param) in enumerate(sources):
        t = source.grad_target() if source is not None and param.requires_grad else None
        if t is None:
            continue
        entry = by_sink.setdefault(id(t.sink), [t.sink, t.numel, t.dtype, []])
        if (entry[1], entry[2]) != (t.numel, t.dtype):
            raise ValueError(f"unit compute: gradient targets of one sink disagree: {t}")
        entry[3].append((i, t.start))
    groups = tuple(U.GradGroup(numel, jax_name(dtype), tuple(slots))
                   for _, numel, dtype, slots in by_sink.values())
    return groups, tuple((sink, len(slots)) for sink, _, _, slots in by_sink.values())


def jax_name(dtype: torch.dtype) -> str:
    """A Torch dtype's JAX name (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")
