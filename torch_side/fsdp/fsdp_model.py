"""``fully_shard``: wrap an ``nn.Module`` into per-module FSDP units with MXFP8 model weights.

The pieces, one noun each (see each file's note):

- ``unit_builder``: which unit owns which parameters, groups by (device, format, requires_grad,
  DP group), the plane-injection hooks;
- ``FSDPUnit`` (``fsdp_unit``): one module's groups and the hooks that unshard, reshard, reduce;
- ``ExpertUnits`` (``expert_units``): the expert units a host unit schedules, so that an expert
  the router skips on some rank still joins its collectives there;
- ``ParamGroup`` (``param_group``): one group's buffers, plane states and collectives;
- ``FSDPState`` (``fsdp_state``): the iteration lifecycle and prefetch order shared by the units;
- ``state_dict``: full main weights, gradients and gathered model weights (collectives);
- ``init_sync``: every rank starts from rank 0's values (broadcast, or verified, at wrap time);
- ``sharded_state``: the sharded checkpoint parts of the model and the optimizer.

An exception escaping ``FSDPModel.forward`` resets the units it crossed before it propagates
(``FSDPState.abort_forward``); see ``fsdp_state`` for every exception path.

``FSDPModel`` is the ``nn.Module`` the user holds: it forwards to the wrapped module and exposes
those pieces. MXFP8 applies to the parameters modules declare block-scaled through
``mxfp8_params()`` (``common.formats.BlockScaledParams``: the weights of ``bridge.MXFP8Linear``
modules in ``LinearMode.MXFP8``). Its ``state_dict()`` / ``load_state_dict()`` speak the wrapped
module's names with full fp32 main weights (collectives, like ``full_state_dict``); the module
parameters themselves hold working storage only and are guarded against plain optimizers
(``param_guard``).
See docs/fsdp.md for the user guide.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from bridge import TorchMXFP8Tensor
from common.kernels import KernelConfig
from torch_side.comm.collectives import Communicator, Phase, WireRecord
from torch_side.fsdp import state_dict as sd
from torch_side.fsdp.batched_refresh import refresh_groups
from torch_side.fsdp.bucket_allocator import BucketAllocator
from torch_side.fsdp.fsdp_state import FSDPState
from torch_side.fsdp.fsdp_unit import FSDPUnit, GradCheck
from torch_side.fsdp.hybrid_mesh import mesh_groups
from torch_side.fsdp.init_sync import InitSync, initial_values
from torch_side.fsdp.meta_init import ParamInit, check_meta, stand_in_for_meta
from torch_side.fsdp.overlap import Overlap
from torch_side.fsdp.param_group import ParamGroup
from torch_side.fsdp.param_guard import mark
from torch_side.fsdp.policy import MixedPrecisionPolicy
from torch_side.fsdp.sharded_state import ModelState
from torch_side.fsdp.strategy import ShardingStrategy
from torch_side.fsdp.unit_builder import ModuleSpec, UnitConfig, build_units, install_plane_hooks

__all__ = ["FSDPModel", "fully_shard"]


def _check_group(group: dist.ProcessGroup | None, what: str) -> None:
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


def _initialise(groups: list[ParamGroup], init: ParamInit | None, init_sync: InitSync) -> None:
    """Main weights from rank 0's values (or, for a meta-device model, ``init``'s values of each
    rank's own pieces), model weights refreshed from them, parameters given their storage."""
    for g in groups:  # the same order on every rank: collectives match
        if init is not None:
            g.load_main_pieces(init)
        else:
            g.load_main_from(initial_values(g, init_sync))
    refresh_groups(groups, Phase.STATE)  # MXFP8 groups quantized in batches
    for g in groups:
        g.install_params()
        for e in g.entries:
            mark(e.param, e.name)


class FSDPModel(nn.Module):
    """The wrapped model. ``module`` is the original model (its parameters now hold working
    storage only; the truth is in the groups' main weights)."""

    def __init__(
        self,
        module: nn.Module,
        unit_modules: ModuleSpec,
        group: dist.ProcessGroup | None,
        strategy: ShardingStrategy | str,
        policy: MixedPrecisionPolicy,
        expert_modules: ModuleSpec,
        expert_group: dist.ProcessGroup | None,
        grad_check: GradCheck,
        kernels: KernelConfig | None,
        init_sync: InitSync | str,
        check_collectives: bool = False,
        overlap: Overlap | None = None,
        init: ParamInit | None = None,
        device: torch.device | str | None = None,
        mesh: Any = None,
    ):
        super().__init__()
        if check_meta(module, init):
            stand_in_for_meta(module, torch.device("cpu" if device is None else device))
        _check_group(group, "data-parallel")
        groups = mesh_groups(mesh, group, bool(expert_modules))
        group = groups.shard
        if expert_modules:
            _check_group(expert_group, "expert data-parallel")
        if not isinstance(policy, MixedPrecisionPolicy):
            raise TypeError(f"fully_shard: policy must be a MixedPrecisionPolicy, got {policy!r}")
        if kernels is not None and not isinstance(kernels, KernelConfig):
            raise TypeError(f"fully_shard: kernels must be a KernelConfig, got {kernels!r}")
        self.module = module
        self.strategy = ShardingStrategy.parse(strategy)
        self.policy, self.kernels = policy, kernels
        self.grad_check = GradCheck(grad_check)
        self.init_sync = InitSync.parse(init_sync)
        if overlap is not None and not isinstance(overlap, Overlap):
            raise TypeError(
                f"fully_shard: overlap must be a torch_side.Overlap (or None for the default), "
                f"got {overlap!r}"
            )
        overlap = Overlap() if overlap is None else overlap
        self.allocator = BucketAllocator(retiring_limit=overlap.freed_grad_buckets)
        streams = overlap.streams_at_world_1
        self.comms = {"dp": Communicator(group, "dp", bool(check_collectives), streams)}
        self.mesh_shape = groups.shape  # (replicas, shards): (1, DP size) without a mesh
        if groups.replicate is not None:  # HSDP (torch_side.fsdp.hybrid_mesh)
            self.comms["replicate"] = Communicator(groups.replicate, "replicate",
                                                   bool(check_collectives), streams)
        if expert_modules:
            self.comms["expert_dp"] = Communicator(expert_group, "expert_dp",
                                                   bool(check_collectives), streams)
        self.state = FSDPState(overlap)
        cfg = UnitConfig(
            policy, self.strategy, self.comms, self.allocator, self.grad_check, kernels
        )
        self.units: list[FSDPUnit] = build_units(
            module, unit_modules, expert_modules, cfg, self.state
        )
        _initialise(self.param_groups, init, self.init_sync)
        self._planes_handles = install_plane_hooks(self.units)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.module(*args, **kwargs)
        except BaseException:
            # The post-forward hooks of the units the exception crossed never ran: without this
            # their gathered planes would outlive the next optimizer step (fsdp_state's note).
            self.state.abort_forward()
            raise

    # ---- groups, grads, wire ---------------------------------------------------------------
    @property
    def param_groups(self) -> list[ParamGroup]:
        return [g for u in self.units for g in u.groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the main gradients and reset whatever an unfinished iteration left (a backward
        or forward that an exception aborted): buckets freed, staged gradients dropped, every
        ``param.grad`` cleared (``FSDPState.reset_iteration``). With ``set_to_none`` (Torch's
        default) the main grads also give their memory back until the next backward's first
        reduction (or a read) takes it again (``GradReducer``'s note); readers see zeros
        either way."""
        self.state.reset_iteration()
        for g in self.param_groups:
            g.zero_main_grad(release=set_to_none)  # written by the next reduction, or a reader

    def refresh_model_weights(self) -> None:
        """After the main weights changed: requantize / recast the model weight buffers (the
        MXFP8 groups of each communicator in one batch: ``torch_side.fsdp.batched_refresh``).
        Refused (nothing changed) while an iteration is unfinished (``FSDPState.require_idle``)."""
        self.state.require_idle("refresh_model_weights()")
        refresh_groups(self.param_groups, Phase.OPTIMIZER)  # MXFP8 groups quantized in batches
        self.state.weights_changed()

    def wire_log(self) -> list[WireRecord]:
        return [r for c in self.comms.values() for r in c.records]

    def clear_wire_log(self) -> None:
        for c in self.comms.values():
            c.records.clear()

    # ---- full values (collectives: call on every rank) ---------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{qualified name: full fp32 main weight}."""
        return sd.full_state_dict(self.param_groups)

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Set the main weights from full values (names and shapes checked first) and refresh
        the model weights. Refused (nothing changed) while an iteration is unfinished."""
        self.state.require_idle("load_full_state_dict()")
        sd.load_full_state_dict(self.param_groups, state)
        self.state.weights_changed()

    def state_dict(
        self, *args: object, destination: dict[str, Any] | None = None, prefix: str = "",
        keep_vars: bool = False,
    ) -> dict[str, Any]:
        """COLLECTIVE (call on every rank): the wrapped module's ``state_dict()`` with every
        parameter replaced by its full fp32 main weight (``full_state_dict``); buffers as
        they are. Keys are the wrapped module's own (no ``module.`` prefix), so it loads into an
        unwrapped copy of the model. Not a placeholder: ``torch.save`` of it is a checkpoint."""
        if args:
            raise TypeError("FSDPModel.state_dict: pass destination/prefix/keep_vars by keyword")
        full = self.full_state_dict()
        local = self.module.state_dict(keep_vars=keep_vars)
        if destination is not None:
            for key, value in local.items():
                destination[prefix + key] = full.get(key, value)
            return destination
        out: collections.OrderedDict[str, Any] = collections.OrderedDict()
        for key, value in local.items():
            out[prefix + key] = full.get(key, value)
        if not prefix and hasattr(local, "_metadata"):
            out._metadata = local._metadata  # type: ignore[attr-defined]  # as nn.Module sets it
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False
    ) -> tuple[list[str], list[str]]:
        """COLLECTIVE: load what ``state_dict()`` returns (the wrapped module's names). Parameters
        go through ``load_full_state_dict`` (shapes checked, planes requantized); buffers are
        copied. strict: missing or unexpected keys raise, naming them; with ``strict=False``
        missing parameters keep their current values (one more collective) and unexpected keys
        are ignored. Returns ``(missing_keys, unexpected_keys)`` like ``nn.Module``."""
        rank = self.comms["dp"].rank
        if assign:
            raise ValueError(
                f"rank {rank}: FSDPModel.load_state_dict: assign=True is not supported (FSDP "
                f"copies values into its fp32 main weights); use assign=False"
            )
        params, buffers = sd.split_state_keys(self.param_groups, self.module)
        missing = sorted((params | buffers) - set(state_dict))
        unexpected = sorted(set(state_dict) - (params | buffers))
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"rank {rank}: FSDPModel.load_state_dict: missing keys {missing}, unexpected "
                f"keys {unexpected}; pass the wrapped module's parameter and buffer names (what "
                f"FSDPModel.state_dict() returns), or strict=False; nothing was loaded"
            )
        sd.check_buffers(self.module, {k: v for k, v in state_dict.items() if k in buffers})
        values = {k: state_dict[k] for k in params if k in state_dict}
        if len(values) < len(params):
            values = {**self.full_state_dict(), **values}
        self.load_full_state_dict(values)
        with torch.no_grad():
            for name in buffers & set(state_dict):
                self.module.get_buffer(name).copy_(state_dict[name])
        return _IncompatibleKeys(missing, unexpected)

    def _load_from_state_dict(self, *args, **kwargs):
        raise RuntimeError(
            "FSDPModel: a parent module cannot load an FSDPModel's state (it would write into "
            "working storage); call fsdp_model.load_state_dict(...) on the FSDPModel itself"
        )

    def sharded_state(self) -> ModelState:
        """This model's part of a sharded checkpoint (``torch_side.fsdp.sharded_state``): the main
        weight pieces this rank holds, saved and loaded at any world size; a load re-derives
        the MXFP8 planes. Save / load with ``sharded_state.save_parts`` / ``load_parts``."""
        return ModelState(self)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """{qualified name: full reduced gradient, fp32} (after backward)."""
        return sd.full_grads(self.param_groups)

    @contextlib.contextmanager
    def gathered_weights(self) -> Iterator[dict[str, TorchMXFP8Tensor | torch.Tensor]]:
        """All-gathered model weights, valid inside the ``with`` (see
        ``state_dict.gathered_weights``)."""
        with sd.gathered_weights(self.param_groups) as out:
            yield out


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
    kernels: KernelConfig | None = None,
    init_sync: InitSync | str = InitSync.BROADCAST,
    check_collectives: bool = False,
    overlap: Overlap | None = None,
    init: ParamInit | None = None,
    device: torch.device | str | None = None,
    mesh: Any = None,
) -> FSDPModel:
    """Wrap ``module`` for sharded data-parallel training (see the module docstring).

    group: DP process group (None: world). strategy: a ``ShardingStrategy`` or its string value.
    policy: ``MixedPrecisionPolicy()`` when None (MXFP8 linear weights, fp32 others).
    init_sync: every rank starts from rank 0's parameter values (``InitSync.BROADCAST``, rank 0 of
    the expert-DP group for expert parameters), or, with ``InitSync.VERIFY``, the wrap refuses on
    every rank, naming the first differing parameter, if the ranks built different values
    (``torch_side.fsdp.init_sync``; collectives at wrap time).
    grad_check: ``GradCheck.FINITE`` raises, naming the parameter and rank, on a non-finite local
    gradient. kernels: the ``KernelConfig`` of FSDP's own MXFP8 numerics (the refresh after each
    step; None: the device default); the layers' GEMMs use their own: pass the same config (with
    ``fp8_blocked`` on CUDA the refresh zeroes only its images' gaps; BENCHMARKS.md session 19).
    check_collectives: before each FSDP collective, check that every rank is about to run the
    same one, and raise naming each rank's unit if not (a debug switch with a cost per
    collective; the applications set it from the environment variable
    ``MXFP8_FSDP_CHECK_COLLECTIVES=1``; ``torch_side.comm.collective_check``). overlap: how far
    all-gathers run ahead of the compute and whether gradient reductions are asynchronous
    (``torch_side.Overlap``; None: one unit ahead, asynchronous reductions).
    init, device: for a model built on the meta device, the ``ParamInit`` that fills each rank's
    shard of the main weights (only the shard is ever materialised; no initial values are
    broadcast, ``init_sync`` does not apply) and the device FSDP allocates on (default cpu);
    ``torch_side.fsdp.meta_init``. mesh: a 2-D ``DeviceMesh`` (replicate, shard) for HSDP instead
    of ``group``: each strategy runs inside the shard groups, gradients are all-reduced across
    the replicas (``torch_side.fsdp.hybrid_mesh``).
    """
    return FSDPModel(
        module,
        unit_modules,
        group,
        strategy,
        MixedPrecisionPolicy() if policy is None else policy,
        expert_modules,
        expert_group,
        grad_check,
        kernels,
        init_sync,
        check_collectives,
        overlap,
        init,
        device,
        mesh,
    )
