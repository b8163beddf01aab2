"""``fully_shard``: wrap an ``nn.Module`` into per-module FSDP units with MXFP8 model weights.

Units: every module in ``unit_modules`` (module types or instances) becomes a unit owning the
parameters under it that no nested unit owns; the root unit owns the rest. Inside a unit,
parameters are grouped by ``GroupKey`` = (device, weight format, requires_grad, DP group), so
MXFP8 and high-precision parameters never share a group. Parameters under ``expert_modules`` are
sharded over ``expert_group`` (their amax all-reduce and gradient reduction run there).

MXFP8 applies to the weights of ``bridge.MXFP8Linear`` modules in ``LinearMode.MXFP8``; the
wrapper hands each of them its planes through the ``weight_planes`` argument (a forward pre-hook),
so the model code calls the layer as usual. See docs/fsdp.md for the user guide.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from bridge import LinearMode, MXFP8Linear, TorchMXFP8Tensor
from jax_side.mxfp8 import Plane
from torch_side.bucket_allocator import BucketAllocator
from torch_side.collectives import Communicator, Phase, WireRecord
from torch_side.fsdp_unit import FSDPUnit, GradCheck, MXFP8Planes
from torch_side.param_group import GroupKey, ParamEntry, ParamGroup
from torch_side.policy import MixedPrecisionPolicy
from torch_side.strategy import ShardingStrategy

__all__ = ["FSDPModel", "fully_shard"]

ModuleSpec = Sequence[type[nn.Module] | nn.Module]


def _matches(module: nn.Module, spec: ModuleSpec) -> bool:
    return any(module is s or (isinstance(s, type) and isinstance(module, s)) for s in spec)


def _is_mxfp8_linear_weight(module: nn.Module, pname: str) -> bool:
    return isinstance(module, MXFP8Linear) and module.mode is LinearMode.MXFP8 and pname == "weight"


def _check_group(group, what: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"fully_shard: torch.distributed is not initialised; call "
            f"dist.init_process_group(...) first (or torchrun), then wrap ({what})"
        )
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(
            f"fully_shard: rank {dist.get_rank()} is not a member of the {what} process group; "
            f"every rank that wraps the model must belong to it (build it with dist.new_group "
            f"on all ranks and pass each rank its own group)"
        )


class FSDPModel(nn.Module):
    """The wrapped model. ``module`` is the original model (its parameters now hold working
    storage only; the truth is in the groups' main weights)."""

    def __init__(
        self,
        module,
        unit_modules,
        group,
        strategy,
        policy,
        expert_modules,
        expert_group,
        grad_check: GradCheck,
    ):
        super().__init__()
        _check_group(group, "data-parallel")
        if expert_modules:
            _check_group(expert_group, "expert data-parallel")
        self.module = module
        self.strategy = ShardingStrategy.parse(strategy)
        if not isinstance(policy, MixedPrecisionPolicy):
            raise TypeError(f"fully_shard: policy must be a MixedPrecisionPolicy, got {policy!r}")
        self.policy = policy
        self.grad_check = GradCheck(grad_check)
        self.allocator = BucketAllocator()
        self.comms = {"dp": Communicator(group, "dp")}
        if expert_modules:
            self.comms["expert_dp"] = Communicator(expert_group, "expert_dp")
        self.backward_active = False
        self._forward_order: list[FSDPUnit] = []
        self._order_frozen = False
        self.units = self._build_units(unit_modules, expert_modules)
        for unit in self.units:
            for g in unit.groups:
                g.load_main_from([e.param for e in g.entries])
                g.refresh_model_weights(Phase.STATE)
                g.install_params()
        self._planes_handles = self._install_plane_hooks()

    # ---- construction ---------------------------------------------------------------------
    def _build_units(self, unit_modules, expert_modules) -> list[FSDPUnit]:
        unit_names = [""] + [
            n for n, m in self.module.named_modules() if n and _matches(m, unit_modules)
        ]
        expert_prefixes = [n for n, m in self.module.named_modules() if _matches(m, expert_modules)]
        per_unit: dict[str, list[tuple[str, nn.Module, str, nn.Parameter]]] = {
            u: [] for u in unit_names
        }
        seen: dict[int, str] = {}  # id(parameter) -> first qualified name
        for mname, mod in self.module.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                qual = f"{mname}.{pname}" if mname else pname
                if id(p) in seen:
                    raise ValueError(
                        f"fully_shard: parameter {qual!r} is the same tensor as {seen[id(p)]!r} "
                        f"(tied weights); FSDP units do not support tied parameters -- untie "
                        f"them (e.g. copy the tensor) before wrapping"
                    )
                seen[id(p)] = qual
                unit = max(
                    (u for u in unit_names if u == "" or mname == u or mname.startswith(u + ".")),
                    key=len,
                )
                per_unit[unit].append((qual, mod, pname, p))
        units = []
        for uname in unit_names:
            module = self.module if uname == "" else self.module.get_submodule(uname)
            groups = self._build_groups(uname, per_unit[uname], expert_prefixes)
            units.append(FSDPUnit(uname or "<root>", module, groups, self))
        return units

    def _build_groups(self, uname, params, expert_prefixes) -> list[ParamGroup]:
        by_key: dict[GroupKey, list[ParamEntry]] = {}
        for qual, mod, pname, p in params:
            self._check_device(qual, p)
            fmt = self.policy.weight_format(qual, p, _is_mxfp8_linear_weight(mod, pname))
            is_expert = any(qual.startswith(e + ".") for e in expert_prefixes)
            key = GroupKey(p.device, fmt, p.requires_grad, "expert_dp" if is_expert else "dp")
            by_key.setdefault(key, []).append(ParamEntry(qual, mod, p, tuple(p.shape), p.dtype))
        groups = []
        for key, entries in by_key.items():
            label = f"{uname or '<root>'}/{key.weight_format.value}/{key.dp_group}"
            if not key.requires_grad:
                label += "/frozen"
            groups.append(
                ParamGroup(
                    label,
                    key,
                    entries,
                    self.policy,
                    self.strategy,
                    self.comms[key.dp_group],
                    self.allocator,
                    grad_divisor=self.comms["dp"].world_size,
                )
            )
        return groups

    def _check_device(self, name: str, p: torch.Tensor) -> None:
        backend = dist.get_backend(self.comms["dp"].group)
        if backend == "nccl" and p.device.type != "cuda":
            raise ValueError(
                f"fully_shard: parameter {name!r} is on {p.device}, but the process group uses "
                f"NCCL, which moves GPU tensors only; call model.to('cuda') before wrapping"
            )

    def _install_plane_hooks(self):
        handles = []
        for unit in self.units:
            for g in unit.groups:
                if not g.is_mxfp8:
                    continue
                for i, e in enumerate(g.entries):
                    planes = MXFP8Planes(unit, g, i)

                    def inject(module, args, kwargs, planes=planes):
                        kwargs = dict(kwargs)
                        kwargs["weight_planes"] = planes
                        return args, kwargs

                    handles.append(e.module.register_forward_pre_hook(inject, with_kwargs=True))
        return handles

    # ---- forward / backward bookkeeping (called by the units) ------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def record_forward_order(self, unit: FSDPUnit) -> None:
        if not self._order_frozen and unit not in self._forward_order:
            self._forward_order.append(unit)

    def prefetch_after(self, unit: FSDPUnit) -> None:
        """Forward prefetch: start the next unit's rowwise all-gather now (async), in the unit
        order recorded during the first iteration; the next unit's pre-forward waits for it."""
        nxt = self._neighbour(unit, +1)
        if nxt is not None:
            for g in nxt.groups:
                g.unshard(Plane.ROWWISE, Phase.FORWARD, async_op=True)

    def prefetch_before(self, unit: FSDPUnit) -> None:
        """Backward prefetch: start the backward planes of the unit that ran before ``unit`` in
        forward (it is the next one backward reaches); its pre-backward waits for them."""
        prev = self._neighbour(unit, -1)
        if prev is not None:
            for g in prev.groups:
                g.unshard(g.backward_plane, Phase.BACKWARD, async_op=True)

    def _neighbour(self, unit: FSDPUnit, step: int) -> FSDPUnit | None:
        if not self._order_frozen or unit not in self._forward_order:
            return None
        i = self._forward_order.index(unit) + step
        return self._forward_order[i] if 0 <= i < len(self._forward_order) else None

    def on_pre_backward(self) -> None:
        if not self.backward_active:
            self.backward_active = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        for unit in reversed(self.units):
            unit.finish_backward()
        self.backward_active = False
        self._order_frozen = True

    def check_finite(self, name: str, grad: torch.Tensor) -> None:
        if not torch.isfinite(grad).all():
            bad = int((~torch.isfinite(grad)).sum())
            raise FloatingPointError(
                f"rank {dist.get_rank()}: gradient of parameter {name!r} has {bad} non-finite "
                f"values (NaN/Inf) this micro-batch; check the loss and learning rate. Other "
                f"ranks may now hang in their next collective."
            )

    # ---- groups, grads, state ----------------------------------------------------------------
    @property
    def param_groups(self) -> list[ParamGroup]:
        return [g for u in self.units for g in u.groups]

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 -- nn.Module signature
        """Zero the main gradients (the module parameters never keep ``.grad``)."""
        for g in self.param_groups:
            if g.main_grad is not None:
                g.main_grad.zero_()

    def refresh_model_weights(self) -> None:
        """After the main weights changed: requantize / recast the model weight buffers."""
        for g in self.param_groups:
            g.refresh_model_weights(Phase.OPTIMIZER)

    def wire_log(self) -> list[WireRecord]:
        return [r for c in self.comms.values() for r in c.records]

    def clear_wire_log(self) -> None:
        for c in self.comms.values():
            c.records.clear()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{qualified name: full fp32 main weight} (a collective: call on every rank)."""
        out = {}
        for g in self.param_groups:
            full = g.full_main()
            for s in g.layout.slots:
                out[s.name] = full[s.start : s.end].view(s.shape).clone()
        return out

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set the main weights from full high-precision values and refresh the model weights."""
        for g in self.param_groups:
            missing = [s.name for s in g.layout.slots if s.name not in state]
            if missing:
                raise KeyError(f"load_full_state_dict: missing parameters {missing}")
            g.load_main_from([state[s.name] for s in g.layout.slots])
            g.refresh_model_weights(Phase.STATE)

    @contextlib.contextmanager
    def gathered_weights(self) -> Iterator[dict[str, TorchMXFP8Tensor | torch.Tensor]]:
        """All-gather every model weight (a collective). Yields {name: unsharded value}:
        ``TorchMXFP8Tensor`` (both planes, uint8, dtype bf16) for MXFP8 parameters, the bf16/fp32
        tensor for the others. Views into temporary buckets: valid inside the ``with`` only."""
        out = {}
        for g in self.param_groups:
            for plane in (Plane.ROWWISE, Plane.COLWISE):
                g.unshard(plane, Phase.STATE)
            for i, s in enumerate(g.layout.slots):
                if g.is_mxfp8:
                    row, col = g.plane_views(i, Plane.ROWWISE), g.plane_views(i, Plane.COLWISE)
                    out[s.name] = TorchMXFP8Tensor(*row, *col, s.shape, torch.bfloat16)
                else:
                    out[s.name] = g.full_buffer(Plane.ROWWISE)[s.start : s.end].view(s.shape)
        try:
            yield out
        finally:
            out.clear()
            for g in self.param_groups:
                g.reshard()


def fully_shard(
    module: nn.Module,
    *,
    unit_modules: ModuleSpec = (),
    group: dist.ProcessGroup | None = None,
    strategy: ShardingStrategy | str = ShardingStrategy.OPTIM_GRADS_PARAMS,
    policy: MixedPrecisionPolicy | None = None,
    expert_modules: ModuleSpec = (),
    expert_group: dist.ProcessGroup | None = None,
    grad_check: GradCheck = GradCheck.OFF,
) -> FSDPModel:
    """Wrap ``module`` for sharded data-parallel training (see the module docstring).

    group: DP process group (None: world). strategy: a ``ShardingStrategy`` or its string value.
    policy: ``MixedPrecisionPolicy()`` by default (MXFP8 linear weights, fp32 others). The module
    must hold the same initial values on every rank (or load them with ``load_full_state_dict``).
    grad_check: ``GradCheck.FINITE`` raises, naming the parameter and rank, on a non-finite local
    gradient (the other ranks then hang in their next collective until the timeout).
    """
    return FSDPModel(
        module,
        unit_modules,
        group,
        strategy,
        policy or MixedPrecisionPolicy(),
        expert_modules,
        expert_group,
        grad_check,
    )
