"""Unit compute: a Torch block's forward as one JAX program and its backward as one.

The per-linear op (``bridge.linear``) enters JAX twice per linear layer and pays Python dispatch on
both sides each time; a GPT step is then bound by the host, not the GPU (docs/DESIGN.md section
8). Here a whole block -- a **unit** -- is one autograd op around ``jax_side.unit_program``
(``bridge.unit_op``): its forward runs the block's JAX function in one jitted program that keeps
its residuals on the JAX side, its backward one program that returns the gradient of every input
and parameter in one crossing. What the programs read of the block is found once
(``bridge.unit_layout``); under FSDP they read FSDP's buffers through the module's typed binding
(``bridge.unit_bindings``).

**Block types** are an extension point: a table from a Torch module type to its ``BlockType``,
which the model side fills with ``register_unit(module_type, fn_for, inputs=1, outputs=1)``:
``fn_for(module)`` returns the block's JAX function ``fn(params, linear, *inputs) -> output`` (a
hashable callable: ``jax_side.unit_program``'s contract), ``inputs`` how many differentiable
tensors the block's forward takes, ``outputs`` how many it returns (a tuple when several). The
GPT registers its ``Block`` in ``models/torch_gpt.py`` with the functions of
``models.gpt_math``; a test or a user's package registers its own the same way
(docs/extending.md, "A block type"). The bridge names no model: a new block type needs no bridge
edit.

``set_compute(model, Compute.UNIT)`` runs every registered block of ``model`` through its program;
``Compute.OP`` restores the class's own forward, which the per-linear op serves. How: the block's
``forward`` becomes a ``UnitForward`` (an instance attribute, as Torch calls ``module.forward``).
A wrapper module would change what the model's code calls and the module tree that state dicts,
FSDP's hooks and ``unit_modules`` name; Torch's hooks run around a forward but cannot replace it.
``run_unit(module, fn, x, *aux, parts=...)`` runs any function over any set of submodules (the
GPT's head and loss use it).

An FSDP unit of several registered blocks (one input, one output each) runs as one program per
direction whose outputs its blocks return, each its own (``bridge.unit_spans``); a unit of blocks
of several inputs or outputs runs each block's own program, and so does every unit on CUDA under
XLA's deterministic ops (``span_programs_run_on``: XLA:GPU fails to execute a span's backward
there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from bridge.determinism import xla_deterministic_ops
from bridge.unit_bindings import UnitBinding, hold_binding
from bridge.unit_op import run_op
from common.modes import Compute
from jax_side import unit_program as U

__all__ = [
    "BlockType",
    "UnitForward",
    "block_type",
    "register_unit",
    "run_unit",
    "set_compute",
    "span_programs_run_on",
    "unit_modules",
    "unregister_unit",
]


class BlockType(NamedTuple):
    """A registered block type: ``fn_for(module)`` -> its JAX function, called as
    ``fn(params, linear, *inputs)``; ``inputs`` differentiable tensors in, ``outputs`` out."""

    module_type: type[nn.Module]
    fn_for: Callable[[nn.Module], Callable]
    inputs: int = 1
    outputs: int = 1


_BLOCK_TYPES: dict[type[nn.Module], BlockType] = {}


def register_unit(module_type: type[nn.Module], fn_for: Callable[[nn.Module], Callable], *,
                  inputs: int = 1, outputs: int = 1) -> BlockType:
    """Run ``module_type`` blocks (and subclasses) as unit programs under ``Compute.UNIT``
    (module docstring); registering a type again replaces its entry."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_unit: expected an nn.Module subclass, got {module_type!r}")
    if not callable(fn_for):
        raise TypeError(f"register_unit: fn_for must be callable(module) -> fn, got {fn_for!r}")
    for what, n in (("inputs", inputs), ("outputs", outputs)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"register_unit: {what}={n!r} for {module_type.__name__}, expected "
                             f"how many tensors its forward takes / returns (an integer >= 1)")
    entry = _BLOCK_TYPES[module_type] = BlockType(module_type, fn_for, inputs, outputs)
    return entry


def unregister_unit(module_type: type[nn.Module]) -> None:
    """Remove ``module_type``'s entry (a plugin or a test undoing ``register_unit``); its blocks
    already switched keep their ``UnitForward`` until ``set_compute`` runs again."""
    if _BLOCK_TYPES.pop(module_type, None) is None:
        raise KeyError(f"unregister_unit: {module_type!r} is not registered")


def block_type(module: nn.Module) -> BlockType | None:
    """The entry of ``module``'s type or its nearest registered base class (None: not a block)."""
    for cls in type(module).__mro__:
        entry = _BLOCK_TYPES.get(cls)
        if entry is not None:
            return entry
    return None


def unit_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every registered block in ``model``."""
    return [(n, m) for n, m in model.named_modules() if block_type(m) is not None]


class UnitForward:
    """A registered block's forward under ``Compute.UNIT`` (module docstring): its own unit
    program, or, for the blocks of an FSDP unit of several, their one program (the first block
    runs it, every block returns its own output). Holds the block's ``UnitBinding`` (which the
    bridge's map holds weakly)."""

    __slots__ = ("binding", "module", "recompute")

    def __init__(self, module: nn.Module, recompute: bool):
        self.module, self.recompute = module, recompute
        self.binding: UnitBinding = hold_binding(module)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        module, entry = self.module, block_type(self.module)
        if entry is None:
            raise RuntimeError(f"unit compute: {type(module).__name__} is no longer registered "
                               f"(unregister_unit); call set_compute(model, 'op') to run its "
                               f"own forward")
        if len(inputs) != entry.inputs:
            raise TypeError(
                f"unit compute: {type(module).__name__} is registered with inputs="
                f"{entry.inputs} but was called with {len(inputs)} tensors; register it with "
                f"the number of differentiable tensors its forward takes"
            )
        span = self.binding.span
        if span is None or not all(_one_to_one(m) for m in span.members) or not (
                span_programs_run_on(inputs[0].device)):
            return run_op(module, entry.fn_for(module), inputs, (), self.recompute,
                          binding=self.binding)
        if span.members[0] is not module:
            return span.output_of(module, inputs[0])
        fn = U.SpanFn(tuple(_registered(m).fn_for(m) for m in span.members))
        run_ = span.begin(torch.is_grad_enabled())
        outs = run_op(module, fn, inputs, (), self.recompute, binding=self.binding, span=span,
                      span_run=run_)
        return span.start(run_, outs)

    def __repr__(self) -> str:
        return f"UnitForward({type(self.module).__name__}, recompute={self.recompute})"


def span_programs_run_on(device: torch.device) -> bool:
    """Whether the blocks of an FSDP unit of several run as one program per direction on
    ``device`` (else each block runs its own: the same bits). Not on CUDA when XLA runs with
    deterministic ops (``bridge.determinism.xla_deterministic_ops``: XLA:GPU fails to execute
    the span's backward there)."""
    return not (device.type == "cuda" and xla_deterministic_ops())


def _registered(module: nn.Module) -> BlockType:
    entry = block_type(module)
    assert entry is not None, type(module)  # every member passed _one_to_one
    return entry


def _one_to_one(module: nn.Module) -> bool:
    entry = block_type(module)
    return entry is not None and entry.inputs == entry.outputs == 1


def set_compute(model: nn.Module, compute: Compute | str, *, recompute: bool = False) -> int:
    """Run every registered block of ``model`` as a unit (``Compute.UNIT``) or through its own
    forward (``Compute.OP``); returns how many blocks were switched. The function is asked for
    at each call (a block moved to another device gets another one)."""
    compute = Compute.parse(compute)
    mods = unit_modules(model)
    for _, m in mods:
        if isinstance(m.__dict__.get("forward"), UnitForward):
            del m.forward  # back to the class's forward
        if compute is Compute.UNIT:
            m.forward = UnitForward(m, recompute)
    return len(mods)


def run_unit(
    module: nn.Module, fn: Callable, x: torch.Tensor, *aux: torch.Tensor,
    parts: Sequence[str] | None = None, recompute: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``fn(params, linear, x, *aux)`` over ``module``'s parameters (or those of its submodules
    ``parts``) as one JAX program per direction (``bridge.unit_op``). x: the activations
    (contiguous where possible: one Torch-side copy otherwise), or a tuple of several inputs;
    aux: further non-differentiable tensors (e.g. targets)."""
    inputs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    return run_op(module, fn, inputs, aux, recompute, parts=parts)
