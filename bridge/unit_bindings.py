"""What a unit program reads about a module, typed: one ``UnitBinding`` per module.

A unit program (``bridge.units``) reads a block's parameters and hands back their gradients.
Without FSDP it reads the parameters themselves and autograd takes the gradients. Under FSDP,
``torch_side`` binds to each module that owns parameters of a unit what the program reads
instead, through three declared interfaces:

- ``WeightSource``: a block-scaled weight's planes inside FSDP's gathered buckets
  (``torch_side.fsdp.fsdp_unit.WeightPlanes``): ``shared(plane)`` is the plane shared with JAX once
  per bucket lifetime (rowwise for the forward, colwise for the backward);
- ``ParamSource``: a high-precision parameter's slice of its group's shared weights buffer
  (``torch_side.fsdp.fsdp_unit.ParamShare``): ``shared_tensor()``;
- both offer ``grad_target()``, a ``GradTarget`` or None: where the program lays that gradient
  out instead of returning it to autograd -- element ``start`` of a flat buffer that a
  ``GradSink`` (``torch_side.fsdp.fsdp_unit.GroupGradSink``: the group's grad bucket) takes whole.

FSDP also binds each module of a unit of several blocks to the unit's ``UnitSpan``
(``bridge.unit_spans``): one program runs them all. The bridge keeps in the binding what it
found for the module (``programs``: layouts and program specs, made once; FSDP's ``bind_*``
calls empty it).

Where a binding lives: a bridge-owned ``weakref.WeakKeyDictionary`` from the module to it --
nothing is written on the module. The map holds the binding weakly too, since a binding refers
to its module (through FSDP's sources, the span, the cached layouts) and a mapping that held it
strongly would keep the module alive for ever. Whoever binds keeps the binding alive: FSDP's
unit (``bind_*`` returns the binding for it to hold) and the forward ``set_compute`` installs.
FSDP holds each unit member's too, so the GPT's head (``run_unit`` on the root) finds its layout
once. A binding nobody holds lasts one call (``run_unit`` on a module outside FSDP and
``set_compute``: its layout is found again at each call, ~25 us for the GPT's head on CPU).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import NamedTuple, Protocol

import torch
from torch import nn

from bridge.shared import SharedPlane, SharedTensor
from bridge.unit_spans import UnitSpan
from common.formats import Plane

__all__ = [
    "GradSink",
    "GradTarget",
    "ParamSource",
    "UnitBinding",
    "WeightSource",
    "bind_param",
    "bind_span",
    "bind_weight",
    "binding_of",
    "drop_span_run",
    "forget",
    "hold_binding",
]


class GradSink(Protocol):
    """Takes a flat buffer of gradients a unit program laid out (``GradTarget``)."""

    def stage_segment(self, flat: torch.Tensor, n: int) -> None:
        """Take ``flat`` (``numel`` elements of ``dtype``, zeros where no gradient sits), which
        holds ``n`` parameters' gradients. ``flat`` is handed over: the caller keeps no other
        reference to it (it is a unit program's own output), so the sink may keep it and write
        into it (FSDP's reducer adopts it as its grad bucket)."""
        ...


class GradTarget(NamedTuple):
    """Where a parameter's gradient goes instead of autograd: element ``start`` of a flat
    buffer of ``numel`` elements of ``dtype`` that ``sink.stage_segment(segment, n)`` takes
    whole, ``n`` the gradients in it."""

    sink: GradSink
    numel: int
    dtype: torch.dtype
    start: int


class WeightSource(Protocol):
    """A block-scaled weight as FSDP holds it (module docstring)."""

    def shared(self, plane: Plane) -> SharedPlane:
        """The weight's ``plane`` inside shared buffers (gathered on demand)."""
        ...

    def grad_target(self) -> GradTarget | None:
        """Where the program puts dW, or None: returned to autograd."""
        ...


class ParamSource(Protocol):
    """A high-precision parameter as FSDP holds it (module docstring)."""

    def shared_tensor(self) -> SharedTensor:
        """The parameter inside a shared buffer (gathered on demand)."""
        ...

    def grad_target(self) -> GradTarget | None:
        """Where the program puts the gradient, or None: returned to autograd."""
        ...


class UnitBinding:
    """One module's binding (module docstring): FSDP's ``weights`` and ``params`` (by the
    parameter's name in the module) and ``span``; the bridge's ``programs`` cache."""

    __slots__ = ("__weakref__", "params", "programs", "span", "weights")

    def __init__(self) -> None:
        self.weights: dict[str, WeightSource] = {}
        self.params: dict[str, ParamSource] = {}
        self.span: UnitSpan | None = None
        self.programs: dict = {}  # bridge.units: (parts, fn, device, span?) -> what it found

    def __repr__(self) -> str:
        return (f"UnitBinding(weights={sorted(self.weights)}, params={sorted(self.params)}, "
                f"span={self.span.names if self.span else None}, programs={len(self.programs)})")


_BINDINGS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[UnitBinding]] = (
    weakref.WeakKeyDictionary()
)


def binding_of(module: nn.Module) -> UnitBinding | None:
    """``module``'s binding, or None where none is held."""
    ref = _BINDINGS.get(module)
    return None if ref is None else ref()


def hold_binding(module: nn.Module) -> UnitBinding:
    """``module``'s binding, made if it has none; the caller keeps it alive (module docstring)."""
    binding = binding_of(module)
    if binding is None:
        binding = UnitBinding()
        _BINDINGS[module] = weakref.ref(binding)
    return binding


def _fresh(module: nn.Module) -> UnitBinding:
    """The binding FSDP fills: what the bridge found for the module before is forgotten."""
    binding = hold_binding(module)
    binding.programs.clear()
    return binding


def bind_weight(module: nn.Module, name: str, source: WeightSource) -> UnitBinding:
    """Unit programs read ``module``'s block-scaled parameter ``name`` from ``source``."""
    binding = _fresh(module)
    binding.params.pop(name, None)
    binding.weights[name] = source
    return binding


def bind_param(module: nn.Module, name: str, source: ParamSource) -> UnitBinding:
    """Unit programs read ``module``'s high-precision parameter ``name`` from ``source``."""
    binding = _fresh(module)
    binding.weights.pop(name, None)
    binding.params[name] = source
    return binding


def bind_span(modules: tuple[nn.Module, ...]) -> list[UnitBinding]:
    """``modules`` (several, in call order) are one unit: its registered blocks run as one
    program (``bridge.unit_spans.UnitSpan``); one binding per module."""
    span = UnitSpan(tuple(modules))
    bindings = [_fresh(m) for m in modules]
    for binding in bindings:
        binding.span = span
    return bindings


def forget(modules: Iterable[nn.Module]) -> None:
    """Drop what FSDP bound to ``modules`` and what the bridge found for them (FSDP, before it
    binds a model's modules again)."""
    for m in modules:
        binding = binding_of(m)
        if binding is not None:
            binding.weights.clear()
            binding.params.clear()
            binding.span = None
            binding.programs.clear()


def drop_span_run(module: nn.Module) -> None:
    """Forget the last program run of ``module``'s span, if any (FSDP, after a forward an
    exception aborted)."""
    binding = binding_of(module)
    if binding is not None and binding.span is not None:
        binding.span.drop()
