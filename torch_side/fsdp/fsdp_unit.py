"""``FSDPUnit``: one module's parameter groups and the hooks that unshard, reshard and reduce.

A unit may also be several modules (a ``unit_modules`` list, ``unit_builder``): its pre-hook is
on the first, its post-hook on the last, so the model is expected to call them in that order
(a transformer's block loop). A member called out of that order still reads correct weights (a
plane asked for outside the hooks is gathered lazily, below), only with an extra gather.

Lifecycle of a unit in one iteration (``TrainingState``):

- forward pre-hook: unshard the forward planes (MXFP8: rowwise; high precision: the weights).
  If backward is already running, this forward is an activation-recompute forward
  (``torch.utils.checkpoint``): unshard all planes, since the backward that follows needs colwise.
- forward post-hook: reshard (ZeRO-3) and register the pre-backward hook on the outputs.
  During a recompute forward it does nothing (backward still needs the planes).
- pre-backward (first gradient reaching an output): unshard the backward planes (MXFP8: colwise;
  high precision: the weights), and start the same gathers for the unit that ran before this one
  in forward (backward prefetch; forward prefetch starts the next unit's rowwise gather).
- post-accumulate-grad hook of each parameter: stage its gradient in the group's grad bucket
  (``param.grad`` is taken first, so it is cleared even when ``GradCheck.FINITE`` raises); when
  the unit's last gradient arrives (post-backward): reduce(-scatter) into the main grads and
  reshard. A unit program (``bridge.units``) hands a group's gradients over at once instead,
  laid out as the grad bucket (``GroupGradSink``: one add, counted as that many gradients).
  The final callback (``FSDPState.finish_backward``) does the same for units whose
  parameters got no gradient.

Every rank must issue the same collectives in the same order, whatever tokens it routed: the
triggers above are rank-independent for units whose parameters all get gradients on every rank.
A unit holding **expert** parameters may see some of them get no gradient on one rank only (an
expert that received no tokens, or was not called), so counting gradients would reduce it at a
rank-dependent moment. Such a unit is instead reduced when backward leaves it: the gradient of
its forward inputs (``_PostBackward``, an identity on the inputs whose backward runs after the
unit's own backward), or, when no input takes gradients, in the final callback -- on every rank
at the same point of the dense graph. Zeros stand in for the gradients that never came. (A
gradient that reaches such a unit after that point -- one whose path does not run through the
unit's inputs -- is staged again and reduced in the final callback.)

An expert module may also be a unit of its own (an **expert unit**, ``host`` set): where the
router skips it, its hooks do not run, so its host -- the nearest enclosing unit, which runs on
every rank -- passes it in a rank-independent order (``torch_side.fsdp.expert_units``): an expert
unit's pre-forward and pre-backward first ``skip`` the host's expert units before it that did not
run here (the same gathers, prefetches and reductions, with zeros for the gradients), and the
host passes the rest at its post-forward and at its own reduction, which is therefore on exit
too. A unit that is not declared an expert and is skipped on some rank still diverges, which
only ``check_collectives`` names.

The backward hook carries the ``weights_version`` its forward read; a different version at
pre-backward (an optimizer step or a state load in between) raises instead of differentiating
the forward's activations against new weights.

"Already unsharded" is tracked per plane of each ``ParamGroup`` (its ``PlaneBucket``s'
``PlaneState``); a plane asked for outside these hooks (a recompute of a submodule inside the
unit, a user reading weights) is gathered lazily by ``WeightPlanes`` with the phase of the moment.
Gradients are staged and reduced by each group's ``GradReducer``, through the group's
``stage_grad`` / ``stage_grads`` / ``reduce_grads`` / ``drop_grads`` (``GroupGrads``).
"""

from __future__ import annotations

import enum
import functools
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from bridge.shared import SharedPlane, SharedTensor
from bridge.unit_bindings import GradTarget, UnitBinding, drop_span_run
from common import trace
from common.formats import Plane
from torch_side.comm.collectives import Phase
from torch_side.fsdp.expert_units import ExpertUnits, Sweep
from torch_side.fsdp.fsdp_state import FSDPState
from torch_side.fsdp.param_group import ParamGroup, PlaneState

__all__ = [
    "FSDPUnit", "GradCheck", "GroupGradSink", "ParamShare", "TrainingState", "WeightPlanes",
    "check_finite",
]

TRACK = "compute: units"  # trace track of each unit's forward / backward (host view)


class GradCheck(enum.Enum):
    """Optional check of each local gradient before it is staged for reduction."""

    OFF = "off"
    FINITE = "finite"  # raise, naming the parameter and rank, on NaN/Inf


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"  # pre-backward ran, gradients pending
    REDUCED = "reduced"  # post-backward ran in this backward


class WeightPlanes:
    """``bridge.MXFP8WeightPlanes`` of one block-scaled parameter, gathered lazily per plane;
    ``blocks``: its format's ``common.formats.ScaleBlocks`` (the layer reads the planes by
    them)."""

    def __init__(self, unit: FSDPUnit, group: ParamGroup, index: int):
        self.unit, self.group, self.index = unit, group, index
        self.shape = tuple(group.slots[index].shape)
        self.blocks = group.blocks

    def rowwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        phase = Phase.RECOMPUTE if self.unit.fsdp.backward_active else Phase.FORWARD
        _lazy_unshard(self.unit, self.group, [Plane.ROWWISE], phase)
        return self.group.plane_views(self.index, Plane.ROWWISE)

    def colwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        _lazy_unshard(self.unit, self.group, [Plane.COLWISE], Phase.BACKWARD)
        return self.group.plane_views(self.index, Plane.COLWISE)

    def grad_target(self) -> GradTarget | None:
        """Where a unit program puts this weight's gradient (its group's grad bucket)."""
        return self.unit.grad_sink(self.group).target(self.index)

    def shared(self, plane: Plane) -> SharedPlane:
        """The plane inside the group's buffers shared with JAX (``bridge.shared.SharedPlane``):
        the bridge op reads it without a per-layer crossing."""
        if plane is Plane.ROWWISE:
            phase = Phase.RECOMPUTE if self.unit.fsdp.backward_active else Phase.FORWARD
        else:
            phase = Phase.BACKWARD
        _lazy_unshard(self.unit, self.group, [plane], phase)
        return self.group.shared_plane(self.index, plane)


class GroupGradSink:
    """Where a unit program hands one group's gradients (``bridge.unit_bindings.GradSink``):
    laid out as the group's grad bucket, added in one go (``GradReducer.stage_flat``) and
    counted as that many staged gradients -- what the per-parameter hooks do one at a time."""

    def __init__(self, unit: FSDPUnit, group: ParamGroup):
        self.unit, self.group = unit, group

    def target(self, index: int) -> GradTarget | None:
        slot = self.group.grad_slot(index)
        return None if slot is None else GradTarget(self, *slot)

    def stage_segment(self, flat: torch.Tensor, n: int) -> None:
        if self.unit.grad_check is GradCheck.FINITE and not torch.isfinite(flat).all():
            for e, s in zip(self.group.entries, self.group.slots, strict=True):
                check_finite(e.name, flat[s.start : s.end])
        self.group.stage_grads(flat)
        self.unit.count_staged(n)


class ParamShare:
    """A high-precision parameter of a unit inside its group's weights buffer, shared with JAX
    (``bridge.shared.SharedTensor``) for the unit programs (``bridge.units``); gathered lazily
    with the phase of the moment, like ``WeightPlanes``."""

    def __init__(self, unit: FSDPUnit, group: ParamGroup, index: int):
        self.unit, self.group, self.index = unit, group, index

    def grad_target(self) -> GradTarget | None:
        """Where a unit program puts this parameter's gradient (its group's grad bucket)."""
        return self.unit.grad_sink(self.group).target(self.index)

    def shared_tensor(self) -> SharedTensor:
        phase = Phase.RECOMPUTE if self.unit.fsdp.backward_active else Phase.FORWARD
        if self.unit.state is TrainingState.BACKWARD:
            phase = Phase.BACKWARD
        g = self.group
        _lazy_unshard(self.unit, g, [g.forward_plane], phase)
        data = g.shared_full_buffer(g.forward_plane)  # the full buffer, shared once
        s = g.slots[self.index]
        return SharedTensor(data, s.start, tuple(s.shape))


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs once the gradients of all of them
    are complete, i.e. after the unit's own backward, and reduces the unit's gradients."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.on_inputs_grad()
        return (None, *grads)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def check_finite(name: str, grad: torch.Tensor) -> None:
    """Raise, naming the parameter and rank, if a local gradient holds NaN/Inf."""
    if not torch.isfinite(grad).all():
        bad = int((~torch.isfinite(grad)).sum())
        raise FloatingPointError(
            f"rank {_rank()}: gradient of parameter {name!r} has {bad} non-finite "
            f"values (NaN/Inf) this micro-batch; check the loss and learning rate. Other "
            f"ranks may now hang in their next collective."
        )


# What a unit's hooks issue, shared with ``FSDPUnit.skip`` (an expert unit the router skipped).
def _forward_gathers(unit: FSDPUnit) -> None:
    """Pre-forward: record the execution order, gather the forward planes, prefetch."""
    unit.fsdp.schedule.order.record(unit)
    for g in unit.groups:
        g.unshard([g.forward_plane], Phase.FORWARD)
    unit.fsdp.schedule.prefetch_after(unit)


def _recompute_gathers(unit: FSDPUnit) -> None:
    """Pre-forward of a recompute: every plane (the backward that follows needs colwise)."""
    for g in unit.groups:
        g.unshard(g.planes, Phase.RECOMPUTE)


def _backward_gathers(unit: FSDPUnit) -> None:
    """Pre-backward: gather the backward planes, prefetch."""
    for g in unit.groups:
        g.unshard([g.backward_plane], Phase.BACKWARD)
    unit.fsdp.schedule.prefetch_before(unit)


def _lazy_unshard(unit: FSDPUnit, group: ParamGroup, planes: list[Plane], phase: Phase) -> None:
    """Gather planes a layer asks for outside the unit's hooks (a no-op where they are gathered
    already). Refused where the gather's place among the collectives would depend on what the
    router skipped: in an expert unit, and in a host during its backward sweep (a recompute of
    part of the unit: a checkpointed submodule)."""
    if unit.host is not None or unit.experts.sweep is Sweep.BACKWARD:
        stored = {group.codec.stored_plane(p) for p in planes}
        if any(group.state[p] is PlaneState.SHARDED for p in stored):
            role = "an expert unit" if unit.host is not None else "the host of expert units"
            raise RuntimeError(
                f"rank {_rank()}: FSDP unit {unit.name!r} ({role}) gathers "
                f"{sorted(p.value for p in stored)} of group {group.label!r} outside its hooks "
                f"(a recompute of part of the unit inside backward, i.e. a checkpointed "
                f"submodule): where that gather falls among the expert units' collectives would "
                f"differ between ranks whose routers skip different experts. Checkpoint the "
                f"experts' host unit as a whole, or list the MoE layer in unit_modules, so that "
                f"it hosts the experts and the checkpointed module lies outside it. Other ranks "
                f"may now hang in a collective"
            )
    group.unshard(planes, phase)


def _check_weights_version(unit: FSDPUnit, version: int) -> None:
    now = unit.fsdp.weights_version
    if version != now:
        raise RuntimeError(
            f"rank {_rank()}: FSDP unit {unit.name!r}: the model weights changed between "
            f"this forward and its backward (weights version {version} at forward, {now} "
            f"now: FSDPOptimizer.step(), refresh_model_weights() or load_full_state_dict() "
            f"ran in between), so backward would differentiate against the new weights. "
            f"Call backward before opt.step() (and redo this forward)"
        )


def _register_post_backward(unit: FSDPUnit, args: tuple) -> tuple | None:
    """Wrap the forward inputs that take gradients in ``_PostBackward`` (None: no such input,
    the unit is reduced in the final callback)."""
    flat, spec = tree_flatten(args)
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return None
    outs = _PostBackward.apply(unit, *(flat[i] for i in idx))
    for i, t in zip(idx, outs, strict=True):
        flat[i] = t
    return tree_unflatten(flat, spec)


class FSDPUnit:
    """One unit: the groups of the parameters under ``modules`` (one module, or several that
    form one unit: unsharded when the first runs, resharded after the last one returns)."""

    def __init__(
        self,
        name: str,
        modules: tuple[nn.Module, ...],
        groups: list[ParamGroup],
        fsdp: FSDPState,
        grad_check: GradCheck = GradCheck.OFF,
    ):
        self.name, self.modules, self.groups, self.fsdp = name, tuple(modules), groups, fsdp
        self.grad_check = grad_check
        self.state = TrainingState.IDLE
        self.host: FSDPUnit | None = None  # the unit scheduling this expert unit (expert_units)
        self.experts = ExpertUnits(name)  # the expert units this unit hosts (often none)
        self._pending = 0
        # the trace interval of this unit's forward or backward
        self._span: trace.Pending | None = None
        self._sinks: dict[str, GroupGradSink] = {}  # grad_sink(), per group label
        # what unit_builder.install_plane_hooks bound for unit programs: the unit keeps them
        # alive (bridge.unit_bindings holds them weakly)
        self.bindings: tuple[UnitBinding, ...] = ()
        self._grad_params = sum(1 for g in groups if g.key.requires_grad for _ in g.entries)
        # Gradients of expert parameters may not arrive on every rank: reduce when backward
        # leaves the unit (or at the end), never when the count of gradients completes. A host
        # of expert units too (``unit_builder._link_experts``): its reduction passes them first.
        self.reduce_on_exit = any(
            g.key.dp_group == "expert_dp" and g.key.requires_grad for g in groups
        )
        self._handles = [
            self.modules[0].register_forward_pre_hook(self._pre_forward),
            self.modules[-1].register_forward_hook(self._post_forward),
        ]
        for g in groups:
            if g.key.requires_grad:
                for i, e in enumerate(g.entries):
                    self._handles.append(
                        e.param.register_post_accumulate_grad_hook(self._make_grad_hook(g, i))
                    )

    @property
    def module(self) -> nn.Module:
        """The unit's module (the first of a unit of several)."""
        return self.modules[0]

    # ---- forward ----------------------------------------------------------------------------
    def _pre_forward(self, module, args):
        if self.fsdp.in_backward():
            if self.host is not None:
                self.host.experts.reach(self, Sweep.RECOMPUTE)
            _recompute_gathers(self)
            self.experts.begin(Sweep.RECOMPUTE)
            return None
        if self.host is not None:  # first the host's expert units the router skipped
            self.host.experts.reach(self, Sweep.FORWARD)
        self.state = TrainingState.FORWARD
        self._span = trace.begin(TRACK, f"forward {self.name}")
        _forward_gathers(self)
        self.experts.begin(Sweep.FORWARD)
        if self.reduce_on_exit and torch.is_grad_enabled():
            return _register_post_backward(self, args)
        return None

    def _post_forward(self, module, args, output):
        if self.fsdp.backward_active:
            self.experts.finish(Sweep.RECOMPUTE)
            return None
        self.experts.finish(Sweep.FORWARD)
        self._end_span()
        for g in self.groups:
            g.reshard()
        tensors = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if tensors and torch.is_grad_enabled():
            hook = functools.partial(self._pre_backward, self.fsdp.weights_version)
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
        return None

    def _end_span(self) -> None:
        span, self._span = self._span, None
        if span is not None:
            span.end()

    # ---- backward ---------------------------------------------------------------------------
    def _pre_backward(self, version: int, grad: torch.Tensor) -> None:
        _check_weights_version(self, version)
        self.fsdp.on_pre_backward()
        if self.state is TrainingState.BACKWARD:
            return
        if self.host is not None:  # first the host's expert units backward did not reach
            self.host.experts.reach(self, Sweep.BACKWARD)
        self.state = TrainingState.BACKWARD
        self._pending = self._grad_params
        self._span = trace.begin(TRACK, f"backward {self.name}")
        _backward_gathers(self)
        self.experts.begin(Sweep.BACKWARD)

    def _make_grad_hook(self, group: ParamGroup, index: int) -> Callable[[torch.Tensor], None]:
        # The hook lives on the parameter (Torch keeps it with the tensor), and the group holds
        # the parameter: strong references from the hook back to the unit or the group would
        # close a cycle through the tensor, which Python's collector cannot see through, so
        # the whole model -- its buffers, GPU memory included -- would outlive it. Weak ones.
        unit_ref, group_ref = weakref.ref(self), weakref.ref(group)

        def hook(param: torch.Tensor) -> None:
            unit, grp = unit_ref(), group_ref()
            if unit is None or grp is None:  # the model is gone; the parameter outlived it
                return
            grad, param.grad = param.grad, None  # FSDP owns it now, even if the check raises
            if grad is None:
                return
            if unit.grad_check is GradCheck.FINITE:
                check_finite(grp.entries[index].name, grad)
            grp.stage_grad(index, grad)
            unit.count_staged(1)

        return hook

    def count_staged(self, n: int) -> None:
        """``n`` more gradients of this unit are staged; the last one reduces the unit."""
        if self.state is not TrainingState.BACKWARD:  # no output hook ran (e.g. no_grad out)
            self.state, self._pending = TrainingState.BACKWARD, self._grad_params
        self._pending -= n
        if self._pending == 0 and not self.reduce_on_exit:
            self.post_backward()

    def grad_sink(self, group: ParamGroup) -> GroupGradSink:
        """The sink unit programs hand ``group``'s gradients to (one per group)."""
        sink = self._sinks.get(group.label)
        if sink is None:
            sink = self._sinks[group.label] = GroupGradSink(self, group)
        return sink

    def post_backward(self) -> None:
        """Reduce this micro-batch's gradients into the main grads (asynchronously under
        ``Overlap.async_reduce``: settled where they are read) and reshard; a host first passes
        the expert units backward did not reach (``ExpertUnits.finish``)."""
        self.experts.finish(Sweep.BACKWARD)
        self._end_span()
        async_op = self.fsdp.overlap.async_reduce
        for g in self.groups:
            in_flight = g.reduce_grads(async_op)
            if in_flight is not None:
                self.fsdp.schedule.track_reduction(in_flight)
            g.reshard()
        self.state = TrainingState.REDUCED

    def on_inputs_grad(self) -> None:
        """``_PostBackward``: backward has left this unit (expert units reduce here)."""
        if self.state is TrainingState.BACKWARD:
            self.post_backward()

    def finish_backward(self) -> None:
        """Root's end-of-backward callback: reduce if some gradients never arrived; reset. An
        expert unit is finished by its host, after the host's own reduction (``FSDPState``)."""
        if self.state is TrainingState.BACKWARD:
            self.post_backward()
        for g in self.groups:
            g.reshard()
        self.state = TrainingState.IDLE
        self.experts.finish_backward()

    def skip(self, sweep: Sweep) -> None:
        """Issue what this expert unit's hooks would have issued in ``sweep`` on a rank whose
        router did not call it (``ExpertUnits``): forward, gather and reshard; recompute, gather;
        backward, gather, prefetch and reduce (zeros for gradients that never came)."""
        if sweep is Sweep.FORWARD:
            _forward_gathers(self)
            for g in self.groups:
                g.reshard()
        elif sweep is Sweep.RECOMPUTE:
            _recompute_gathers(self)
        elif self.state is not TrainingState.REDUCED:
            if self.state is not TrainingState.BACKWARD:
                self.state, self._pending = TrainingState.BACKWARD, self._grad_params
                _backward_gathers(self)
            self.post_backward()

    def abort(self) -> None:
        """After a forward or backward that an exception aborted (or at ``zero_grad``): wait for
        gathers in flight, free the buckets, drop staged gradients, clear gradients the hooks did
        not consume, and go back to IDLE (no collective is issued)."""
        for g in self.groups:
            g.drop_grads()
            g.reshard()
            for e in g.entries:
                e.param.grad = None
        drop_span_run(self.modules[0])  # an aborted forward's span program run (bridge.units)
        self.state, self._pending = TrainingState.IDLE, 0
        self.experts.reset()
