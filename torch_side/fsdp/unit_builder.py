"""Building FSDP units from a module: which parameters each unit owns and how they are grouped.

Units: every module in ``unit_modules`` (module types or instances) becomes a unit owning the
parameters under it that no nested unit owns; the root unit owns the rest. An entry that is a
list or tuple of module instances makes them **one** unit (PyTorch FSDP2's
``fully_shard([m1, m2])``): one gather and one reduction for all of them, unsharded when its first
module runs and resharded after its last one (``FSDPUnit``); under ``Compute.UNIT`` such a unit of
registered blocks runs as one unit program per direction (``bridge.units``). Inside a unit,
parameters are grouped by ``GroupKey`` = (device, weight format, requires_grad, DP group), so
parameters of different formats never share a group; each group gets the codec of its format
(``weight_codecs.codec_for``, which refuses formats FSDP does not implement). Which format a
parameter takes is the policy's answer (``MixedPrecisionPolicy.param_format``) to what its module
declares through ``mxfp8_params()``; no layer class is checked here. Parameters under
``expert_modules`` are sharded over the expert-DP group. An expert module (or a module inside
one) may be a unit of its own, an **expert unit**: a router may skip it on some rank, so its
collectives are scheduled by its host, the nearest enclosing unit that is not an expert unit
(``_expert_hosts``, which refuses a host holding another unit; ``torch_side.fsdp.expert_units``);
experts inside an enclosing unit are reduced as ``fsdp_unit`` describes. For groups whose
parameters are placeholders (MXFP8), a forward pre-hook on each owning layer injects its planes
through the layer's ``weight_planes`` argument, so the model code calls the layer as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from bridge.unit_bindings import bind_param, bind_span, bind_weight, forget, hold_binding
from common.kernels import KernelConfig
from torch_side.comm.collectives import Communicator
from torch_side.fsdp.bucket_allocator import BucketAllocator
from torch_side.fsdp.fsdp_state import FSDPState
from torch_side.fsdp.fsdp_unit import FSDPUnit, GradCheck, ParamShare, WeightPlanes
from torch_side.fsdp.param_group import ROOT_UNIT, UNIT_JOIN, GroupKey, ParamEntry, ParamGroup
from torch_side.fsdp.policy import MixedPrecisionPolicy
from torch_side.fsdp.strategy import ShardingStrategy
from torch_side.fsdp.weight_codecs import ParamStorage, codec_for

__all__ = ["ModuleSpec", "UnitConfig", "build_units", "install_plane_hooks"]

ModuleSpec = Sequence[type[nn.Module] | nn.Module | Sequence[nn.Module]]


class UnitConfig(NamedTuple):
    """Everything ``build_units`` needs besides the module."""

    policy: MixedPrecisionPolicy
    strategy: ShardingStrategy
    comms: dict[str, Communicator]  # "dp"; with experts "expert_dp"; with HSDP "replicate"
    allocator: BucketAllocator
    grad_check: GradCheck
    kernels: KernelConfig | None


def _matches(module: nn.Module, spec: ModuleSpec) -> bool:
    return any(module is s or (isinstance(s, type) and isinstance(module, s)) for s in spec)


def _is_list(entry: object) -> bool:
    return isinstance(entry, (list, tuple))


def _check_device(name: str, p: torch.Tensor, comm: Communicator) -> None:
    if dist.get_backend(comm.group) == "nccl" and p.device.type != "cuda":
        raise ValueError(
            f"fully_shard: parameter {name!r} is on {p.device}, but the process group uses "
            f"NCCL, which moves GPU tensors only; call model.to('cuda') before wrapping"
        )


def _check_specs(root: nn.Module, unit_modules: ModuleSpec, what: str) -> list[str]:
    """Names of the modules matching a spec; a spec entry that matches nothing is an error."""
    names = [n for n, m in root.named_modules() if _matches(m, unit_modules)]
    for s in unit_modules:
        if not any(_matches(m, [s]) for m in root.modules()):
            label = s.__name__ if isinstance(s, type) else type(s).__name__ + " instance"
            raise ValueError(
                f"fully_shard: {what} entry {label} matches no module of the wrapped "
                f"{type(root).__name__}; pass module types or instances that occur in the model "
                f"(or drop the entry)"
            )
    return names


def _unit_members(root: nn.Module, unit_modules: ModuleSpec) -> list[tuple[str, ...]]:
    """The member module names of each non-root unit, in the model's module order: one per
    matching type / instance entry, one per list entry (its modules in the list's order)."""
    if isinstance(unit_modules, nn.Module) or not _is_list(unit_modules):
        raise TypeError(
            f"fully_shard: unit_modules must be a list or tuple of module types, instances or "
            f"lists of instances, got {type(unit_modules).__name__}; e.g. unit_modules=(Block,)"
        )
    names = {id(m): n for n, m in root.named_modules()}
    lists: list[Sequence[nn.Module]] = []
    single: list[type[nn.Module] | nn.Module | Sequence[nn.Module]] = []
    for entry in unit_modules:
        if isinstance(entry, list | tuple):
            lists.append(entry)
        else:
            single.append(entry)
    units = [(n,) for n in _check_specs(root, single, "unit_modules") if n]
    for entry in lists:
        members = []
        for m in entry:
            if not isinstance(m, nn.Module) or id(m) not in names or names[id(m)] == "":
                what = type(m).__name__ + (" (the wrapped root)" if names.get(id(m)) == "" else "")
                raise ValueError(
                    f"fully_shard: a unit_modules list holds {what}, expected submodule "
                    f"instances of the wrapped {type(root).__name__}; a list makes its modules "
                    f"one unit, e.g. unit_modules=[(model.h_0, model.h_1)]"
                )
            members.append(names[id(m)])
        if not members:
            raise ValueError("fully_shard: a unit_modules list is empty; drop it")
        units.append(tuple(members))
    seen: dict[str, tuple[str, ...]] = {}
    for unit in units:
        for name in unit:
            other = seen.setdefault(name, unit)
            if other is not unit:
                raise ValueError(
                    f"fully_shard: module {name!r} is in two units ({'+'.join(other)} and "
                    f"{'+'.join(unit)}); list each module once in unit_modules"
                )
    for unit in units:
        nested = [(a, b) for a in unit for b in unit if b.startswith(a + ".")]
        if nested:
            a, b = nested[0]
            raise ValueError(
                f"fully_shard: the unit {'+'.join(unit)} lists {b!r} inside its module {a!r}; "
                f"a unit's modules must not contain each other (list {a!r} alone)"
            )
    order = {n: i for i, n in enumerate(names.values())}
    return sorted(units, key=lambda u: order[u[0]])


def _in_expert(name: str, expert_prefixes: list[str]) -> bool:
    return any(name == e or name.startswith(e + ".") for e in expert_prefixes)


def _inside(name: str, prefix: str) -> bool:
    """Whether module ``name`` is module ``prefix`` or lies inside it (every module is in "")."""
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _host_of(i: int, units: list[tuple[str, ...]], expert: list[bool]) -> int:
    """The host of expert unit ``i``: the nearest unit enclosing its members, -1 for the root."""
    label = "+".join(units[i])
    hosts = set()
    for name in units[i]:
        around = [(len(o), j) for j, other in enumerate(units) if j != i
                  for o in other if _inside(name, o)]
        inner = max(around, default=(0, -1))[1]
        if inner >= 0 and expert[inner]:
            raise ValueError(
                f"fully_shard: unit_modules makes {label!r} an FSDP unit inside the expert unit "
                f"{'+'.join(units[inner])!r}; an expert unit may not hold other units (list the "
                f"expert alone, or only modules inside it)"
            )
        hosts.add(inner)
    if len(hosts) > 1:
        raise ValueError(
            f"fully_shard: the expert unit {label!r} lies in different enclosing units; list "
            f"together only experts of one MoE layer (or each expert alone)"
        )
    return hosts.pop()


def _expert_hosts(units: list[tuple[str, ...]], expert_prefixes: list[str]) -> dict[int, int]:
    """{index of an expert unit in ``units``: index of its host unit, -1 for the root}. An expert
    unit's modules are (inside) declared expert modules; a router may skip it on some rank, so
    its host, the nearest enclosing unit that is not an expert unit (it runs on every rank),
    schedules its collectives (``expert_units``). The host must hold no other unit: theirs would
    interleave with the expert units' differently on ranks that skip different experts."""
    expert = []
    for members in units:
        flags = [_in_expert(m, expert_prefixes) for m in members]
        if any(flags) and not all(flags):
            raise ValueError(
                f"fully_shard: the unit {'+'.join(members)} mixes expert modules with other "
                f"modules; list expert modules in units of their own (their collectives are "
                f"scheduled by an enclosing unit, since a router may skip them on some ranks)"
            )
        expert.append(all(flags))
    hosts = {i: _host_of(i, units, expert) for i in range(len(units)) if expert[i]}
    for i, h in hosts.items():
        host = units[h] if h >= 0 else ("",)
        dense = [j for j, members in enumerate(units) if j != h and not expert[j]
                 and any(_inside(m, o) for m in members for o in host)]
        if dense:
            where = "+".join(host) if h >= 0 else "<root>"
            raise ValueError(
                f"fully_shard: the expert unit {'+'.join(units[i])!r} is scheduled by its host, "
                f"the nearest enclosing unit ({where!r}), which also holds the unit "
                f"{'+'.join(units[dense[0]])!r}; a host may hold expert units only, since ranks "
                f"whose routers skip different experts would otherwise interleave the two "
                f"units' collectives differently. List the module that calls the experts (the "
                f"MoE layer) in unit_modules, so that it hosts them"
            )
    return hosts


def _link_experts(built: list[FSDPUnit], hosts: dict[int, int]) -> None:
    """Each expert unit gets its host; each host its expert units in module order, and reduces
    when backward leaves it (``FSDPUnit.reduce_on_exit``), after passing the expert units."""
    for i, h in sorted(hosts.items()):
        unit, host = built[i + 1], built[h + 1]  # built[0] is the root unit
        unit.host = host
        host.experts.units.append(unit)
        host.reduce_on_exit = True


_Owned = tuple[str, nn.Module, str, nn.Parameter]  # (qualified name, module, name, parameter)


def _owned_params(root: nn.Module, units: list[tuple[str, ...]]) -> dict[str, list[_Owned]]:
    """{unit name: [(qualified name, module, param name, parameter)]}; refuses tied weights.
    A parameter belongs to the unit of its innermost enclosing member module (the root unit
    "" otherwise)."""
    unit_of = {"": ""}
    for members in units:
        for m in members:
            unit_of[m] = _unit_name(members)
    per_unit: dict[str, list[_Owned]] = {u: [] for u in unit_of.values()}
    seen: dict[int, str] = {}  # id(parameter) -> first qualified name
    for mname, mod in root.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            qual = f"{mname}.{pname}" if mname else pname
            if id(p) in seen:
                raise ValueError(
                    f"fully_shard: parameter {qual!r} is the same tensor as {seen[id(p)]!r} "
                    f"(tied weights); FSDP units do not support tied parameters -- untie "
                    f"them (e.g. copy the tensor) before wrapping"
                )
            seen[id(p)] = qual
            member = max(
                (m for m in unit_of if m == "" or mname == m or mname.startswith(m + ".")),
                key=len,
            )
            per_unit[unit_of[member]].append((qual, mod, pname, p))
    return per_unit


def _unit_name(members: tuple[str, ...]) -> str:
    return UNIT_JOIN.join(members)


def _build_groups(uname: str, params: list[_Owned], expert_prefixes: Sequence[str],
                  cfg: UnitConfig) -> list[ParamGroup]:
    by_key: dict[GroupKey, list[ParamEntry]] = {}
    for qual, mod, pname, p in params:
        _check_device(qual, p, cfg.comms["dp"])
        fmt = cfg.policy.param_format(mod, pname, qual)
        is_expert = any(qual.startswith(e + ".") for e in expert_prefixes)
        key = GroupKey(p.device, fmt, p.requires_grad, "expert_dp" if is_expert else "dp")
        by_key.setdefault(key, []).append(ParamEntry(qual, mod, p, tuple(p.shape), p.dtype))
    groups = []
    replicate = cfg.comms.get("replicate")  # HSDP: gradients all-reduced across the replicas
    divisor = cfg.comms["dp"].world_size * (1 if replicate is None else replicate.world_size)
    for key, entries in by_key.items():
        label = key.label(uname)
        groups.append(
            ParamGroup(
                label,
                key,
                entries,
                cfg.policy,
                cfg.strategy,
                cfg.comms[key.dp_group],
                cfg.allocator,
                grad_divisor=divisor,
                codec=codec_for(key.weight_format, cfg.policy.gather),
                kernels=cfg.kernels,
                replicate=replicate,
            )
        )
    return groups


def build_units(
    root: nn.Module,
    unit_modules: ModuleSpec,
    expert_modules: ModuleSpec,
    cfg: UnitConfig,
    fsdp: FSDPState,
) -> list[FSDPUnit]:
    """The units of ``root`` (root unit first), their groups built and registered with ``fsdp``."""
    units = _unit_members(root, unit_modules)
    expert_prefixes = _check_specs(root, expert_modules, "expert_modules")
    hosts = _expert_hosts(units, expert_prefixes)
    per_unit = _owned_params(root, units)
    built = [FSDPUnit(ROOT_UNIT, (root,), _build_groups("", per_unit[""], expert_prefixes, cfg),
                      fsdp, cfg.grad_check)]
    for members in units:
        uname = _unit_name(members)
        modules = tuple(root.get_submodule(m) for m in members)
        groups = _build_groups(uname, per_unit[uname], expert_prefixes, cfg)
        built.append(FSDPUnit(uname, modules, groups, fsdp, cfg.grad_check))
    _link_experts(built, hosts)
    fsdp.units = built
    return built


def install_plane_hooks(units: list[FSDPUnit]) -> list:
    """Forward pre-hooks injecting ``weight_planes`` into layers whose weight is a placeholder,
    and each owning module's unit binding (``bridge.unit_bindings``): a ``WeightPlanes`` or
    ``ParamShare`` per parameter, what ``bridge.units`` reads a unit program's weights from,
    and for a unit of several modules its ``UnitSpan``: ``bridge.units`` runs them as one
    program. Each unit keeps its members' bindings and those it filled alive
    (``FSDPUnit.bindings``)."""
    for unit in units:  # unit programs made before read no FSDP sources
        forget(m for member in unit.modules for m in member.modules())
    handles = []
    for unit in units:
        # each member's too: what a unit program found for it (the root's: the GPT's head)
        # is kept between steps
        held = (bind_span(unit.modules) if len(unit.modules) > 1
                else [hold_binding(unit.modules[0])])
        for g in unit.groups:
            placeholder = g.codec.param_storage is ParamStorage.PLACEHOLDER
            for i, e in enumerate(g.entries):
                local = e.name.rsplit(".", 1)[-1]
                if not placeholder:
                    held.append(bind_param(e.module, local, ParamShare(unit, g, i)))
                    continue
                planes = WeightPlanes(unit, g, i)
                held.append(bind_weight(e.module, local, planes))

                def inject(module, args, kwargs, planes=planes):
                    kwargs = dict(kwargs)
                    kwargs["weight_planes"] = planes
                    return args, kwargs

                handles.append(e.module.register_forward_pre_hook(inject, with_kwargs=True))
        unit.bindings = tuple(held)
    return handles
